//! Tiles of the register-tiled kernels (shaders/tiled/): row groups of
//! `TILED_CG` invocations own 4 rows each, and the streamed side moves
//! `TILED_BK` rows a tile, through named registers where they fit.

use super::{Tiles, COMPILER_SLACK};
use crate::gpu::caps::AdapterCaps;
use crate::gpu::kernel::{Kernel, Pass, Tier};

/// Key rows per tile and invocations per row group of the tiled forward;
/// fixed by its hand-unrolled 4x4 register tile (shaders/tiled/forward.wgsl).
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

/// Workgroup arrays of a tiled backward kernel in vec4s, mirroring
/// shaders/tiled/backward_*.wgsl. Owned rows are `q_rows` for dQ and
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
        let (br, b1, w_arrays) = match kernel.pass() {
            Pass::BackwardDq => (t.q_rows as u64, bc * (dv4 + 1), 1),
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

/// Workgroup bytes of a tiled kernel, mirroring its arrays (the forward's
/// with the reduction scratch of the variant without subgroups).
pub(super) fn workgroup_bytes(kernel: Kernel, d: u32, dv: u32, t: Tiles) -> u64 {
    match kernel.pass() {
        Pass::Forward => {
            let (q, kv, p, red) = tiled_workgroup_vec4s(d, dv, t, false);
            16 * (q + kv + p + red)
        }
        _ => 16 * BackwardLayout::new(kernel, d, dv, t).total(),
    }
}

/// The tiles of the tiled dQ and dK/dV kernels, or None where the simple
/// backward kernels must run (head dims not multiples of 4 or above 128,
/// or tiles that do not fit the workgroup memory). float32 and float16
/// inputs take the same tiles: float16 is widened as it is loaded.
pub fn tiled_backward_tiles(d: u32, dv: u32, caps: AdapterCaps) -> Option<(Tiles, Tiles)> {
    let budget = (caps.workgroup_storage_bytes as u64).saturating_sub(COMPILER_SLACK);
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
            .flat_map(|rg| [(rg, false), (rg, true)]);
        candidates.into_iter().find_map(|(rg, kv_shared)| {
            let (own, streamed) = (4 * rg, TILED_BK);
            let wg = TILED_CG * rg;
            // vec4s of the streamed tiles per invocation: prefetched into
            // the named registers pa0..pa7 / pb0..pb7 where they fit.
            let (w0, w1) = match kernel.pass() {
                Pass::BackwardDq => (8 * tiled_nv(d), dv / 4),
                _ => (8 * tiled_nv(d), 8 * tiled_nv(dv)),
            };
            let per = (streamed * w0.max(w1)).div_ceil(wg);
            // At most 8, as in the forward: with up to 16 (16 KiB tiles of 16
            // or 32 invocations) the Rust GPU tests did not finish in 100 s on
            // the H100 (docs/gpu.md#registers-bound-occupancy); suspected register pressure or compile
            // time there, not verified.
            let prefetch = if per <= 8 { per } else { 0 };
            let (q_rows, k_rows) = match kernel.pass() {
                Pass::BackwardDq => (own, streamed),
                _ => (streamed, own),
            };
            let t = Tiles {
                q_rows,
                k_rows,
                workgroup: wg,
                kv_shared,
                prefetch,
            };
            let bytes = 16 * BackwardLayout::new(kernel, d, dv, t).total();
            (bytes <= budget
                && t.workgroup <= caps.max_invocations
                && t.workgroup <= caps.max_workgroup_size_x)
                .then_some(t)
        })
    };
    Some((
        pick(Kernel::dq(Tier::Tiled))?,
        pick(Kernel::dkdv(Tier::Tiled))?,
    ))
}

/// The tiles of the tiled forward for head dimensions `d`, `dv`, or None
/// where the simple forward must run: the tiled kernel needs head
/// dimensions multiples of 4 up to 128 for the output and 256 for q/k,
/// and tiles within workgroup memory (float32 or float16 inputs alike).
pub fn tiled_forward_tiles(d: u32, dv: u32, caps: AdapterCaps) -> Option<Tiles> {
    let budget = (caps.workgroup_storage_bytes as u64).saturating_sub(COMPILER_SLACK);
    let shape_ok = d % 4 == 0 && dv % 4 == 0 && (4..=256).contains(&d) && (4..=128).contains(&dv);
    if !shape_ok {
        return None;
    }
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
    const HEIGHTS: [u32; 6] = [16, 12, 11, 10, 8, 4];
    // First K and V side by side with the register prefetch, tallest
    // first; else the tallest block at all (V over K where needed). On
    // the H100 at d = 64 (4,16,4096,64), 64 rows with the prefetch ran
    // 13.1 ms, 96 and 80 rows with V over K (no prefetch) 15.2 and 18.1
    // (docs/gpu.md#what-limits-each-tier); d = 128 fits 44 rows only with V over K.
    let prefetching = HEIGHTS
        .into_iter()
        .map(|rg| tiles(rg, false))
        .find(|t| t.prefetch > 0 && fits(t));
    prefetching.or_else(|| {
        HEIGHTS
            .into_iter()
            .flat_map(|rg| [tiles(rg, false), tiles(rg, true)])
            .find(fits)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::gpu::tiles::test_caps as caps;

    #[test]
    fn tiled_backward_shares_the_streamed_tiles_only_where_needed() {
        let shape = |t: Tiles, kernel| {
            let own = if kernel == Kernel::dq(Tier::Tiled) {
                t.q_rows
            } else {
                t.k_rows
            };
            (own, t.kv_shared)
        };
        // d = 64 on NVIDIA's 48 KiB: 56-row blocks fit only by sharing.
        let (tq, tkv) = tiled_backward_tiles(64, 64, caps(48)).unwrap();
        assert_eq!(shape(tq, Kernel::dq(Tier::Tiled)), (56, true));
        assert_eq!(shape(tkv, Kernel::dkdv(Tier::Tiled)), (56, true));
        // d = 128: side by side only 8-row blocks fit; sharing fits 24.
        let (tq, tkv) = tiled_backward_tiles(128, 128, caps(48)).unwrap();
        assert_eq!(shape(tq, Kernel::dq(Tier::Tiled)), (24, true));
        assert_eq!(shape(tkv, Kernel::dkdv(Tier::Tiled)), (24, true));
        // lavapipe's 32 KiB: d = 128 fits only by sharing.
        let (tq, tkv) = tiled_backward_tiles(128, 128, caps(32)).unwrap();
        assert!(tq.kv_shared && tkv.kv_shared);
        for (kernel, t) in [
            (Kernel::dq(Tier::Tiled), tq),
            (Kernel::dkdv(Tier::Tiled), tkv),
        ] {
            let mut side_by_side = t;
            side_by_side.kv_shared = false;
            assert!(16 * BackwardLayout::new(kernel, 128, 128, t).total() <= 32 * 1024);
            assert!(16 * BackwardLayout::new(kernel, 128, 128, side_by_side).total() > 32 * 1024);
        }
    }

    #[test]
    fn tiled_forward_where_it_fits() {
        let t = tiled_forward_tiles(64, 64, caps(48)).unwrap();
        assert_eq!((t.q_rows, t.kv_shared, t.prefetch > 0), (64, false, true));
        let t = tiled_forward_tiles(128, 128, caps(48)).unwrap();
        assert_eq!((t.q_rows, t.kv_shared), (44, true));
        let (a, b, c, d) = tiled_workgroup_vec4s(128, 128, t, true);
        assert!(16 * (a + b + c + d) <= 48 * 1024);
        // lavapipe's 32 KiB at d = 64: side by side with the prefetch.
        let t = tiled_forward_tiles(64, 64, caps(32)).unwrap();
        assert!(!t.kv_shared && t.prefetch > 0);
        // Odd head dims, wide values: none.
        assert_eq!(tiled_forward_tiles(62, 64, caps(48)), None);
        assert_eq!(tiled_forward_tiles(64, 256, caps(48)), None);
        // Whatever fits the 16 KiB WebGPU default is within it.
        for d in (4..=256).step_by(4) {
            for dv in [4, 8, 60, 64, 128] {
                if let Some(t) = tiled_forward_tiles(d, dv, AdapterCaps::WEBGPU_DEFAULT) {
                    let (a, b, c, e) = tiled_workgroup_vec4s(d, dv, t, false);
                    assert!(16 * (a + b + c + e) <= 16 * 1024, "d={d} dv={dv} {t:?}");
                }
            }
        }
    }
}
