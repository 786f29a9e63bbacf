//! Tile and workgroup sizes of the kernels: the one place they are chosen.
//!
//! Every kernel keeps its tiles in workgroup memory (the GPU's SRAM), so
//! the adapter's `max_compute_workgroup_storage_size` bounds them: 16 KiB
//! on any WebGPU adapter, 32 KiB on lavapipe, 48 KiB on NVIDIA. The sizes
//! reach the WGSL as pipeline overrides, never by editing shader text.

/// The compute kernels of the backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kernel {
    Forward,
    BackwardPreprocess,
    BackwardDkDv,
    BackwardDq,
    /// The register-tiled float32 forward (shaders/forward_tiled.wgsl);
    /// `forward_kernel` chooses it over `Forward` where it fits.
    ForwardTiled,
    /// The register-tiled float32 backward (shaders/backward_*_tiled.wgsl);
    /// `backward_kernels` chooses them where they fit.
    BackwardDqTiled,
    BackwardDkDvTiled,
    /// The float16 forward on cooperative matrices (tensor cores,
    /// shaders/forward_coop.wgsl); `coop_tiles` sizes it where the device
    /// has them.
    ForwardCoop,
    /// The float16 backward on cooperative matrices
    /// (shaders/backward_*_coop.wgsl); `coop_backward_tiles` sizes them.
    BackwardDqCoop,
    BackwardDkDvCoop,
}

impl Kernel {
    pub const ALL: [Kernel; 4] = [
        Kernel::Forward,
        Kernel::BackwardPreprocess,
        Kernel::BackwardDkDv,
        Kernel::BackwardDq,
    ];

    /// The register-tiled kernels (run without naga's index clamps).
    pub fn is_tiled(self) -> bool {
        matches!(
            self,
            Kernel::ForwardTiled | Kernel::BackwardDqTiled | Kernel::BackwardDkDvTiled
        )
    }

    /// The cooperative-matrix kernels (their sources open with `enable`
    /// lines and need the device's cooperative-matrix feature).
    pub fn is_coop(self) -> bool {
        matches!(
            self,
            Kernel::ForwardCoop | Kernel::BackwardDqCoop | Kernel::BackwardDkDvCoop
        )
    }

    pub fn name(self) -> &'static str {
        match self {
            Kernel::Forward => "forward",
            Kernel::BackwardPreprocess => "backward_preprocess",
            Kernel::BackwardDkDv => "backward_dkdv",
            Kernel::BackwardDq => "backward_dq",
            Kernel::ForwardTiled => "forward_tiled",
            Kernel::BackwardDqTiled => "backward_dq_tiled",
            Kernel::BackwardDkDvTiled => "backward_dkdv_tiled",
            Kernel::ForwardCoop => "forward_coop",
            Kernel::BackwardDqCoop => "backward_dq_coop",
            Kernel::BackwardDkDvCoop => "backward_dkdv_coop",
        }
    }
}

/// What the choice depends on from the adapter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceCaps {
    pub workgroup_storage_bytes: u32,
    pub max_invocations: u32,
    pub max_workgroup_size_x: u32,
    /// Subgroup operations with subgroups of at least 8 lanes (a row group
    /// of the tiled forward reduces within one subgroup).
    pub subgroups: bool,
}

impl DeviceCaps {
    /// The limits every WebGPU adapter guarantees.
    pub const WEBGPU_DEFAULT: DeviceCaps = DeviceCaps {
        workgroup_storage_bytes: 16 * 1024,
        max_invocations: 256,
        max_workgroup_size_x: 256,
        subgroups: false,
    };
}

/// Tiles of one kernel: `q_rows` query rows and `k_rows` key rows staged
/// together, `workgroup` threads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Tiles {
    pub q_rows: u32,
    pub k_rows: u32,
    pub workgroup: u32,
    /// Tiled kernels: the two streamed tiles share workgroup memory, the
    /// second loaded over the first once the products that read it are
    /// done, instead of side by side (for head dimensions that do not fit).
    /// The forward streams K then V; dQ streams V then K; dK/dV streams dO,
    /// then Q, then dO again.
    pub kv_shared: bool,
    /// Tiled kernels: vec4s of the next streamed tiles each invocation
    /// prefetches into registers during the current tile (0: none).
    pub prefetch: u32,
}

/// Threads per workgroup: enough to keep a GPU's SIMD lanes busy on the
/// per-element loops, few enough that a software rasteriser's barriers
/// stay cheap.
const WORKGROUP: u32 = 64;

/// Candidate (primary, secondary) tile heights, best first. The primary
/// tile is the one a workgroup owns (query rows in the forward and dQ
/// kernels, key rows in dK/dV); the secondary one is streamed through.
const CANDIDATES: [(u32, u32); 13] = [
    (64, 64),
    (64, 32),
    (32, 32),
    (32, 16),
    (16, 16),
    (16, 8),
    (8, 8),
    (8, 4),
    (4, 4),
    (4, 2),
    (2, 2),
    (2, 1),
    (1, 1),
];

/// Key rows per tile and invocations per row group of the tiled forward;
/// fixed by its hand-unrolled 4x4 register tile (shaders/forward_tiled.wgsl).
pub const TILED_BK: u32 = 32;
pub const TILED_CG: u32 = 8;

/// vec4 columns of the output per invocation in the tiled forward.
pub fn tiled_nv(dv: u32) -> u32 {
    dv.div_ceil(4 * TILED_CG).max(1)
}

/// Workgroup memory of the tiled forward, mirroring its arrays (in vec4s
/// of 16 bytes; rows padded by one vec4), plus the reduction scratch of
/// the variant without subgroups.
pub fn tiled_workgroup_vec4s(d: u32, dv: u32, t: Tiles, subgroups: bool) -> (u64, u64, u64, u64) {
    let (bq, bk) = (t.q_rows as u64, t.k_rows as u64);
    let qs4 = d as u64 / 4 + 1;
    let vs4 = 8 * tiled_nv(dv) as u64 + 1;
    let q = bq * qs4;
    let kv = if t.kv_shared {
        (bk * qs4).max(bk * vs4)
    } else {
        bk * qs4 + bk * vs4
    };
    let p = bq * 9;
    let red = if subgroups { 0 } else { t.workgroup as u64 };
    (q, kv, p, red)
}

/// Bytes of workgroup memory a kernel declares for the given tiles; must
/// mirror the `var<workgroup>` arrays of its shader.
pub fn workgroup_bytes(kernel: Kernel, d: u32, dv: u32, t: Tiles) -> u64 {
    let (bq, bk) = (t.q_rows as u64, t.k_rows as u64);
    let (d, dv) = (d as u64, dv as u64);
    let e = |n: u64| n.max(1);
    // K and V tiles have rows padded by one word (see KS/VS in the shaders).
    let (kt, vt) = (e(bk * (d + 1)), e(bk * (dv + 1)));
    let words = match kernel {
        Kernel::Forward => e(bq * d) + kt + vt + e(bq * bk) + e(bq * dv) + 3 * e(bq),
        // The dK/dV accumulators are sized like the K/V tiles.
        Kernel::BackwardDkDv => {
            2 * kt + 2 * vt + e(bq * d) + e(bq * dv) + 2 * e(bq * bk) + 3 * e(bq)
        }
        Kernel::BackwardDq => 2 * e(bq * d) + e(bq * dv) + kt + vt + e(bq * bk) + 3 * e(bq),
        Kernel::BackwardPreprocess => 0,
        Kernel::ForwardTiled => {
            let (q, kv, p, red) = tiled_workgroup_vec4s(d as u32, dv as u32, t, false);
            // vec4s of four words each.
            4 * (q + kv + p + red)
        }
        Kernel::BackwardDqTiled | Kernel::BackwardDkDvTiled => {
            4 * BackwardLayout::new(kernel, d as u32, dv as u32, t).total()
        }
        Kernel::ForwardCoop => return coop_workgroup_bytes(d as u32, dv as u32, t),
        Kernel::BackwardDqCoop | Kernel::BackwardDkDvCoop => {
            return CoopBackwardLayout::new(kernel, d as u32, dv as u32, t).bytes()
        }
    };
    4 * words
}

/// Workgroup arrays of a tiled backward kernel in vec4s, mirroring
/// shaders/backward_*_tiled.wgsl. Owned rows are `q_rows` for dQ and
/// `k_rows` for dK/dV; the streamed side is TILED_BK rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BackwardLayout {
    /// The owned tiles: Q and dO for dQ, K and V for dK/dV.
    pub a0: u64,
    pub a1: u64,
    /// The streamed tiles, B0 (K for dQ, Q for dK/dV) and B1 (V, dO).
    pub b0: u64,
    pub b1: u64,
    /// Where B1 starts in the streamed region: 0 when it shares B0's space.
    pub b1_offset: u64,
    /// The streamed region: both tiles, or the larger where they share.
    pub b: u64,
    /// P and dS: one array of `w` for dQ, two for dK/dV, except where its
    /// streamed tiles share (then one array holds dS, later P).
    pub w: u64,
    pub w_arrays: u64,
}

impl BackwardLayout {
    pub fn new(kernel: Kernel, d: u32, dv: u32, t: Tiles) -> Self {
        let (d4, dv4) = (d as u64 / 4, dv as u64 / 4);
        let (nd, nv) = (tiled_nv(d) as u64, tiled_nv(dv) as u64);
        let bc = TILED_BK as u64;
        let (br, b1, w_arrays) = match kernel {
            Kernel::BackwardDqTiled => (t.q_rows as u64, bc * (dv4 + 1), 1),
            _ => (
                t.k_rows as u64,
                bc * (8 * nv + 1),
                if t.kv_shared { 1 } else { 2 },
            ),
        };
        let b0 = bc * (8 * nd + 1);
        let (b1_offset, b) = if t.kv_shared {
            (0, b0.max(b1))
        } else {
            (b0, b0 + b1)
        };
        BackwardLayout {
            a0: br * (d4 + 1),
            a1: br * (dv4 + 1),
            b0,
            b1,
            b1_offset,
            b,
            w: br * 9,
            w_arrays,
        }
    }

    pub fn total(&self) -> u64 {
        self.a0 + self.a1 + self.b + self.w_arrays * self.w
    }
}

/// The tiles of the tiled dQ and dK/dV kernels, or None where the simple
/// backward kernels must run (head dims not multiples of 4 or above 128,
/// or tiles that do not fit the workgroup memory). float32 and float16
/// inputs take the same tiles: float16 is widened as it is loaded.
pub fn backward_kernels(d: u32, dv: u32, caps: DeviceCaps) -> Option<(Tiles, Tiles)> {
    backward_kernels_of_at_most(d, dv, caps, u32::MAX)
}

/// `backward_kernels` with blocks of at most `max_rows` owned rows (the
/// benchmarks compare block heights on one adapter).
pub fn backward_kernels_of_at_most(
    d: u32,
    dv: u32,
    caps: DeviceCaps,
    max_rows: u32,
) -> Option<(Tiles, Tiles)> {
    let budget = (caps.workgroup_storage_bytes as u64).saturating_sub(256);
    let shape_ok = d % 4 == 0 && dv % 4 == 0 && (4..=128).contains(&d) && (4..=128).contains(&dv);
    if !shape_ok {
        return None;
    }
    let pick = |kernel: Kernel| {
        // Larger row blocks first (more reuse of each streamed tile, more
        // invocations per workgroup), and the streamed tiles side by side
        // before sharing (fewer barriers and no second read of dO). In 48
        // KiB, d = 64 fits as 56-row blocks and d = 128 as 16-row blocks
        // only by sharing. Measured on the H100 at d = 64: 48-row shared
        // blocks ran forward+backward in 73.1 ms, 32-row side by side 95.2.
        let candidates = [16u32, 14, 12, 10, 8, 6, 4, 2]
            .into_iter()
            .filter(|rg| 4 * rg <= max_rows.max(8))
            .flat_map(|rg| [(rg, false), (rg, true)]);
        candidates.into_iter().find_map(|(rg, kv_shared)| {
            let (own, streamed) = (4 * rg, TILED_BK);
            let wg = TILED_CG * rg;
            // vec4s of the streamed tiles per invocation: prefetched into
            // the named registers pa0..pa7 / pb0..pb7 where they fit.
            let (w0, w1) = match kernel {
                Kernel::BackwardDqTiled => (8 * tiled_nv(d), dv / 4),
                _ => (8 * tiled_nv(d), 8 * tiled_nv(dv)),
            };
            let per = (streamed * w0.max(w1)).div_ceil(wg);
            // At most 8, as in the forward: with up to 16 (16 KiB tiles of 16
            // or 32 invocations) the Rust GPU tests did not finish in 100 s on
            // the H100 (run 4, benchmarks/GPU_NOTES.md); suspected register
            // pressure or compile time there, not verified.
            let prefetch = if per <= 8 { per } else { 0 };
            let t = match kernel {
                Kernel::BackwardDqTiled => Tiles {
                    q_rows: own,
                    k_rows: streamed,
                    workgroup: wg,
                    kv_shared,
                    prefetch,
                },
                _ => Tiles {
                    q_rows: streamed,
                    k_rows: own,
                    workgroup: wg,
                    kv_shared,
                    prefetch,
                },
            };
            let bytes = 16 * BackwardLayout::new(kernel, d, dv, t).total();
            (bytes <= budget
                && t.workgroup <= caps.max_invocations
                && t.workgroup <= caps.max_workgroup_size_x)
                .then_some(t)
        })
    };
    Some((
        pick(Kernel::BackwardDqTiled)?,
        pick(Kernel::BackwardDkDvTiled)?,
    ))
}

/// The forward kernel and its tiles for head dimensions `d`, `dv` on an
/// adapter with `caps`: the register-tiled kernel where its constraints
/// hold (head dimensions multiples of 4 up to 128 for the output, 256 for
/// q/k, tiles within workgroup memory; float32 or float16 inputs alike),
/// else the simple kernel, which handles every shape.
pub fn forward_kernel(d: u32, dv: u32, caps: DeviceCaps) -> (Kernel, Tiles) {
    forward_kernel_of_at_most(d, dv, caps, u32::MAX)
}

/// `forward_kernel` with blocks of at most `max_rows` query rows (the
/// benchmarks compare block heights on one adapter).
pub fn forward_kernel_of_at_most(
    d: u32,
    dv: u32,
    caps: DeviceCaps,
    max_rows: u32,
) -> (Kernel, Tiles) {
    let budget = (caps.workgroup_storage_bytes as u64).saturating_sub(256);
    let shape_ok = d % 4 == 0 && dv % 4 == 0 && (4..=256).contains(&d) && (4..=128).contains(&dv);
    if shape_ok {
        let tiles = |rg: u32, kv_shared: bool| {
            let wg = TILED_CG * rg;
            // Prefetch where the tiles split into at most 8 vec4s per
            // invocation (the named registers pk0..pk7, pv0..pv7).
            let per = (TILED_BK * (d / 4))
                .max(TILED_BK * 8 * tiled_nv(dv))
                .div_ceil(wg);
            Tiles {
                q_rows: 4 * rg,
                k_rows: TILED_BK,
                workgroup: wg,
                kv_shared,
                prefetch: if !kv_shared && per <= 8 { per } else { 0 },
            }
        };
        let fits = |t: &Tiles| {
            let (q, kv, p, red) = tiled_workgroup_vec4s(d, dv, *t, caps.subgroups);
            16 * (q + kv + p + red) <= budget
                && t.workgroup <= caps.max_invocations
                && t.workgroup <= caps.max_workgroup_size_x
        };
        let heights = [16u32, 12, 11, 10, 8, 4]
            .into_iter()
            .filter(|rg| 4 * rg <= max_rows.max(16));
        // First K and V side by side with the register prefetch, tallest
        // first; else the tallest block at all (V over K where needed). On
        // the H100 at d = 64 (4,16,4096,64), 64 rows with the prefetch ran
        // 13.1 ms, 96 and 80 rows with V over K (no prefetch) 15.2 and 18.1
        // (benchmarks/GPU_NOTES.md, session 3); d = 128 fits 44 rows only
        // with V over K.
        let prefetching = heights
            .clone()
            .map(|rg| tiles(rg, false))
            .find(|t| t.prefetch > 0 && fits(t));
        let tallest = || {
            heights
                .clone()
                .flat_map(|rg| [tiles(rg, false), tiles(rg, true)])
                .find(fits)
        };
        if let Some(t) = prefetching.or_else(tallest) {
            return (Kernel::ForwardTiled, t);
        }
    }
    (Kernel::Forward, choose(Kernel::Forward, d, dv, caps))
}

/// Array sizes of the cooperative-matrix forward in elements, mirroring
/// shaders/forward_coop.wgsl: [K, V, Q/P (f16), scratch (f32)]. Rows are
/// padded by 16 bytes; `q_rows` is 16 per subgroup of 32 lanes.
pub fn coop_elems(d: u32, dv: u32, t: Tiles) -> [u64; 4] {
    let (bq, bk) = (t.q_rows as u64, t.k_rows as u64);
    let (d, dv) = (d as u64, dv as u64);
    [
        bk * (d + 8),
        bk * (dv + 8),
        (bq * (d + 8)).max(bq * (bk + 8)),
        bq * (bk.max(coop_o_columns(dv as u32, t) as u64) + 4),
    ]
}

/// Columns of O the cooperative forward passes through its f32 scratch at
/// a time (a rescale, the output): all of them where the scratch is as
/// wide anyway, else the key tile's width, so that the scratch stays one
/// score tile (workgroup memory bounds the rows per workgroup).
pub fn coop_o_columns(dv: u32, t: Tiles) -> u32 {
    dv.min(t.k_rows.max(16))
}

/// Words (pairs of halves) of a K and of a V tile that each invocation of
/// the cooperative forward stages through its registers.
pub fn coop_staged_words(d: u32, dv: u32, t: Tiles) -> (u32, u32) {
    let per = |width: u32| (t.k_rows * width / 2).div_ceil(t.workgroup);
    (per(d), per(dv))
}

/// The most words shaders/forward_coop.wgsl stages per invocation (MAXW).
pub const COOP_MAX_STAGED_WORDS: u32 = 64;

pub fn coop_workgroup_bytes(d: u32, dv: u32, t: Tiles) -> u64 {
    let [k, v, qp, f] = coop_elems(d, dv, t);
    // Plus the per-row l and m and the rescale flag (a vec4).
    2 * (k + v + qp) + 4 * f + 8 * t.q_rows as u64 + 16
}

/// Tiles of the cooperative-matrix forward for head dimensions d, dv
/// (multiples of 16 up to 128), or None where no tile fits: the largest
/// row block first (each staged K/V tile serves more rows), then the
/// longer key tile (fewer barriers per key). `force` = (subgroups, keys)
/// pins one (benchmarks).
pub fn coop_tiles(d: u32, dv: u32, caps: DeviceCaps, force: Option<(u32, u32)>) -> Option<Tiles> {
    let shape_ok =
        d % 16 == 0 && dv % 16 == 0 && (16..=128).contains(&d) && (16..=128).contains(&dv);
    if !shape_ok {
        return None;
    }
    const CANDIDATES: [(u32, u32); 7] = [
        (8, 32),
        (4, 64),
        (4, 32),
        (2, 64),
        (2, 32),
        (1, 32),
        (1, 16),
    ];
    CANDIDATES
        .into_iter()
        .filter(|&c| force.is_none_or(|f| f == c))
        .map(|(w, bk)| Tiles {
            q_rows: 16 * w,
            k_rows: bk,
            workgroup: 32 * w,
            kv_shared: false,
            prefetch: 0,
        })
        .find(|&t| {
            let (kw, vw) = coop_staged_words(d, dv, t);
            coop_workgroup_bytes(d, dv, t) <= caps.workgroup_storage_bytes as u64
                && t.workgroup <= caps.max_invocations
                && t.workgroup <= caps.max_workgroup_size_x
                && kw.max(vw) <= COOP_MAX_STAGED_WORDS
        })
}

/// Workgroup arrays of a cooperative-matrix backward kernel, mirroring
/// shaders/backward_*_coop.wgsl. Owned rows (16 per subgroup) are `q_rows`
/// for dQ and `k_rows` for dK/dV; the other side streams through in tiles
/// of `streamed` rows. All sizes in elements; f16 rows padded by 8 halves,
/// f32 rows by 4 floats (16 bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CoopBackwardLayout {
    pub owned: u32,
    pub streamed: u32,
    /// Offsets in the f16 array: dK/dV: dO, P^T and dS^T; dQ: V and dS
    /// (the first streamed tile is at 0).
    pub second_off: u32,
    pub weights_off: u32,
    pub weights2_off: u32,
    /// The f16 array, and each of the two f32 score scratches.
    pub halves: u32,
    pub floats: u32,
}

impl CoopBackwardLayout {
    pub fn new(kernel: Kernel, d: u32, dv: u32, t: Tiles) -> Self {
        let (owned, streamed) = match kernel {
            Kernel::BackwardDqCoop => (t.q_rows, t.k_rows),
            _ => (t.k_rows, t.q_rows),
        };
        let (ks, vs, ts) = (d + 8, dv + 8, streamed + 8);
        let second_off = streamed * ks;
        let weights_off = streamed * (ks + vs);
        // dK/dV keeps P^T and dS^T, dQ only dS.
        let weights2_off = weights_off + owned * ts;
        let weights_end = match kernel {
            Kernel::BackwardDqCoop => weights2_off,
            _ => weights2_off + owned * ts,
        };
        CoopBackwardLayout {
            owned,
            streamed,
            second_off,
            weights_off,
            weights2_off,
            // The owned rows' staging, before the loop, reuses the space.
            halves: weights_end.max(owned * (ks + vs)),
            floats: owned * (streamed + 4),
        }
    }

    pub fn bytes(&self) -> u64 {
        // Plus dK/dV's per-row lse, D and visible end.
        2 * self.halves as u64 + 2 * 4 * self.floats as u64 + 12 * self.streamed as u64
    }

    /// Words (pairs of halves) of each streamed tile (K and V for dQ, Q
    /// and dO for dK/dV) an invocation loads a tile ahead.
    pub fn staged_words(&self, d: u32, dv: u32, t: Tiles) -> (u32, u32) {
        let per = |width: u32| (self.streamed * width / 2).div_ceil(t.workgroup);
        (per(d), per(dv))
    }
}

/// The most words shaders/backward_*_coop.wgsl load ahead per invocation
/// and tile (MAXW).
pub const COOP_BACKWARD_MAX_STAGED_WORDS: u32 = 32;

/// Tiles of the cooperative-matrix backward (dQ, dK/dV) for head
/// dimensions d, dv (multiples of 16 up to 128), or None where none fits:
/// four subgroups (64 owned rows) where they fit, then two, then one, each
/// with 32 streamed rows where they fit, else 16. More owned rows before
/// taller streamed tiles: on the H100 at d = 128, four subgroups with 16
/// streamed rows ran the backward in 40 ms against 107 for two with 32
/// (at d = 64, 32 rows beat 16: 22 ms against 26; benchmarks/GPU_NOTES.md).
pub fn coop_backward_tiles(d: u32, dv: u32, caps: DeviceCaps) -> Option<(Tiles, Tiles)> {
    let shape_ok =
        d % 16 == 0 && dv % 16 == 0 && (16..=128).contains(&d) && (16..=128).contains(&dv);
    if !shape_ok {
        return None;
    }
    let fits = |kernel: Kernel, t: Tiles| {
        let layout = CoopBackwardLayout::new(kernel, d, dv, t);
        let (w0, w1) = layout.staged_words(d, dv, t);
        layout.bytes() <= caps.workgroup_storage_bytes as u64
            && w0.max(w1) <= COOP_BACKWARD_MAX_STAGED_WORDS
            && t.workgroup <= caps.max_invocations
            && t.workgroup <= caps.max_workgroup_size_x
    };
    let pick = |kernel: Kernel| {
        [4u32, 2, 1]
            .into_iter()
            .flat_map(|w| [(w, 32u32), (w, 16)])
            .find_map(|(w, streamed)| {
                let own = 16 * w;
                let (q_rows, k_rows) = match kernel {
                    Kernel::BackwardDqCoop => (own, streamed),
                    _ => (streamed, own),
                };
                let t = Tiles {
                    q_rows,
                    k_rows,
                    workgroup: 32 * w,
                    kv_shared: false,
                    prefetch: 0,
                };
                fits(kernel, t).then_some(t)
            })
    };
    Some((
        pick(Kernel::BackwardDqCoop)?,
        pick(Kernel::BackwardDkDvCoop)?,
    ))
}

/// Chooses the tiles of `kernel` for head dimensions `d` (q, k) and `dv`
/// (v, out) on an adapter with `caps`.
pub fn choose(kernel: Kernel, d: u32, dv: u32, caps: DeviceCaps) -> Tiles {
    let workgroup = WORKGROUP
        .min(caps.max_invocations)
        .min(caps.max_workgroup_size_x)
        .max(1);
    // Leave room for whatever the backend compiler adds to workgroup
    // memory (alignment, its own scratch).
    let budget = (caps.workgroup_storage_bytes as u64).saturating_sub(256);
    for (primary, secondary) in CANDIDATES {
        let tiles = match kernel {
            Kernel::BackwardDkDv => Tiles {
                q_rows: secondary,
                k_rows: primary,
                workgroup,
                kv_shared: false,
                prefetch: 0,
            },
            _ => Tiles {
                q_rows: primary,
                k_rows: secondary,
                workgroup,
                kv_shared: false,
                prefetch: 0,
            },
        };
        if workgroup_bytes(kernel, d, dv, tiles) <= budget {
            return tiles;
        }
    }
    Tiles {
        q_rows: 1,
        k_rows: 1,
        workgroup,
        kv_shared: false,
        prefetch: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_head_dim_fits_webgpu_default_16_kib() {
        let caps = DeviceCaps::WEBGPU_DEFAULT;
        for kernel in Kernel::ALL {
            for d in 1..=256 {
                for dv in (0..=256).step_by(7).chain([255, 256]) {
                    let t = choose(kernel, d, dv, caps);
                    let bytes = workgroup_bytes(kernel, d, dv, t);
                    assert!(
                        bytes <= 16 * 1024,
                        "{kernel:?} d={d} dv={dv} {t:?}: {bytes} B"
                    );
                }
            }
        }
    }

    #[test]
    fn larger_memory_gives_larger_tiles() {
        let small = choose(Kernel::Forward, 64, 64, DeviceCaps::WEBGPU_DEFAULT);
        let large = choose(
            Kernel::Forward,
            64,
            64,
            DeviceCaps {
                workgroup_storage_bytes: 48 * 1024,
                ..DeviceCaps::WEBGPU_DEFAULT
            },
        );
        assert!(large.q_rows * large.k_rows > small.q_rows * small.k_rows);
        let wide = choose(Kernel::BackwardDkDv, 256, 256, DeviceCaps::WEBGPU_DEFAULT);
        assert!(wide.k_rows >= 1 && wide.q_rows >= 1);
    }

    #[test]
    fn tiled_backward_shares_the_streamed_tiles_only_where_needed() {
        let caps = |kib: u32| DeviceCaps {
            workgroup_storage_bytes: kib * 1024,
            max_invocations: 1024,
            max_workgroup_size_x: 1024,
            subgroups: true,
        };
        let shape = |t: Tiles, kernel| {
            let own = if kernel == Kernel::BackwardDqTiled {
                t.q_rows
            } else {
                t.k_rows
            };
            (own, t.kv_shared)
        };
        // d = 64 on NVIDIA's 48 KiB: 56-row blocks fit only by sharing;
        // at most 32 rows, they fit side by side.
        let (tq, tkv) = backward_kernels(64, 64, caps(48)).unwrap();
        assert_eq!(shape(tq, Kernel::BackwardDqTiled), (56, true));
        assert_eq!(shape(tkv, Kernel::BackwardDkDvTiled), (56, true));
        let (tq, tkv) = backward_kernels_of_at_most(64, 64, caps(48), 32).unwrap();
        assert_eq!(shape(tq, Kernel::BackwardDqTiled), (32, false));
        assert_eq!(shape(tkv, Kernel::BackwardDkDvTiled), (32, false));
        // d = 128: side by side only 8-row blocks fit; sharing fits 24.
        let (tq, tkv) = backward_kernels(128, 128, caps(48)).unwrap();
        assert_eq!(shape(tq, Kernel::BackwardDqTiled), (24, true));
        assert_eq!(shape(tkv, Kernel::BackwardDkDvTiled), (24, true));
        // lavapipe's 32 KiB: d = 128 fits only by sharing.
        let (tq, tkv) = backward_kernels(128, 128, caps(32)).unwrap();
        assert!(tq.kv_shared && tkv.kv_shared);
        for (kernel, t) in [
            (Kernel::BackwardDqTiled, tq),
            (Kernel::BackwardDkDvTiled, tkv),
        ] {
            let mut side_by_side = t;
            side_by_side.kv_shared = false;
            assert!(16 * BackwardLayout::new(kernel, 128, 128, t).total() <= 32 * 1024);
            assert!(16 * BackwardLayout::new(kernel, 128, 128, side_by_side).total() > 32 * 1024);
        }
    }

    #[test]
    fn tiled_forward_where_it_fits_else_the_simple_kernel() {
        let nvidia = DeviceCaps {
            workgroup_storage_bytes: 48 * 1024,
            max_invocations: 1024,
            max_workgroup_size_x: 1024,
            subgroups: true,
        };
        let (k, t) = forward_kernel(64, 64, nvidia);
        assert_eq!(
            (k, t.q_rows, t.kv_shared, t.prefetch > 0),
            (Kernel::ForwardTiled, 64, false, true)
        );
        let (k, t) = forward_kernel(128, 128, nvidia);
        assert_eq!((k, t.q_rows, t.kv_shared), (Kernel::ForwardTiled, 44, true));
        assert!(
            16 * {
                let (a, b, c, d) = tiled_workgroup_vec4s(128, 128, t, true);
                a + b + c + d
            } <= 48 * 1024
        );
        // lavapipe's 32 KiB at d = 64: side by side with the prefetch.
        let lavapipe = DeviceCaps {
            workgroup_storage_bytes: 32 * 1024,
            ..nvidia
        };
        let (_, t) = forward_kernel(64, 64, lavapipe);
        assert!(!t.kv_shared && t.prefetch > 0);
        // Odd head dims, wide values: the simple kernel.
        assert_eq!(forward_kernel(62, 64, nvidia).0, Kernel::Forward);
        assert_eq!(forward_kernel(64, 256, nvidia).0, Kernel::Forward);
        // Every head dim on the 16 KiB WebGPU default fits one or the other.
        for d in (4..=256).step_by(4) {
            for dv in [4, 8, 60, 64, 128] {
                let (k, t) = forward_kernel(d, dv, DeviceCaps::WEBGPU_DEFAULT);
                let bytes = if k == Kernel::ForwardTiled {
                    let (a, b, c, e) = tiled_workgroup_vec4s(d, dv, t, false);
                    16 * (a + b + c + e)
                } else {
                    workgroup_bytes(k, d, dv, t)
                };
                assert!(bytes <= 16 * 1024, "d={d} dv={dv} {k:?} {t:?}: {bytes}");
            }
        }
    }
}
