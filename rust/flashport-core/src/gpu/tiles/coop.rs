//! Tiles of the cooperative-matrix float16 kernels (shaders/coop/): 16
//! rows per subgroup of 32 lanes, float16 tiles staged through registers
//! into workgroup memory, products on 16x16x16 cooperative matrices.

use super::Tiles;
use crate::gpu::caps::AdapterCaps;
use crate::gpu::kernel::{Kernel, Pass, Tier};

/// Workgroup bytes of a cooperative kernel, mirroring its arrays.
pub(super) fn workgroup_bytes(kernel: Kernel, d: u32, dv: u32, t: Tiles) -> u64 {
    match kernel.pass() {
        Pass::Forward => coop_workgroup_bytes(d, dv, t),
        _ => CoopBackwardLayout::new(kernel, d, dv, t).bytes(),
    }
}

/// Array sizes of the cooperative-matrix forward in elements, mirroring
/// shaders/coop/forward.wgsl: [K, V, Q/P (f16), scratch (f32)]. Rows are
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

/// The most words shaders/coop/forward.wgsl stages per invocation (MAXW).
pub const COOP_MAX_STAGED_WORDS: u32 = 64;

pub fn coop_workgroup_bytes(d: u32, dv: u32, t: Tiles) -> u64 {
    let [k, v, qp, f] = coop_elems(d, dv, t);
    // Plus the per-row l and m and the rescale flag (a vec4).
    2 * (k + v + qp) + 4 * f + 8 * t.q_rows as u64 + 16
}

/// The cooperative forward's tiles for head dimensions d, dv (multiples of
/// 16 up to 128) that fit `caps`, best first. Longer key tiles first (fewer
/// barriers per key), then taller row blocks (each staged K/V tile serves
/// more rows): on the H100 at d = 64, 4 subgroups x 64 keys beat 8 x 32 by
/// 1-2% non-causal and 4-6% causal from 4096 tokens up, and lost 5% at
/// (4,16,1024,64) non-causal; 4 x 32 and 2 x 32 ran 0.75x, and 2 x 64
/// spills (docs/gpu.md#cooperative-kernels-when-and-with-which-tiles).
pub fn coop_forward_candidates(d: u32, dv: u32, caps: AdapterCaps) -> impl Iterator<Item = Tiles> {
    let shape_ok =
        d % 16 == 0 && dv % 16 == 0 && (16..=128).contains(&d) && (16..=128).contains(&dv);
    // (subgroups, key rows)
    const CANDIDATES: [(u32, u32); 7] = [
        (4, 64),
        (8, 32),
        (4, 32),
        (2, 64),
        (2, 32),
        (1, 32),
        (1, 16),
    ];
    CANDIDATES
        .into_iter()
        .filter(move |_| shape_ok)
        .map(|(w, bk)| Tiles {
            q_rows: 16 * w,
            k_rows: bk,
            workgroup: 32 * w,
            kv_shared: false,
            prefetch: 0,
        })
        .filter(move |&t| {
            let (kw, vw) = coop_staged_words(d, dv, t);
            coop_workgroup_bytes(d, dv, t) <= caps.workgroup_storage_bytes as u64
                && t.workgroup <= caps.max_invocations
                && t.workgroup <= caps.max_workgroup_size_x
                && kw.max(vw) <= COOP_MAX_STAGED_WORDS
        })
}

/// The cooperative forward's tiles for head dimensions d, dv, or None
/// where no tile fits (`coop_forward_candidates`' first).
pub fn coop_forward_tiles(d: u32, dv: u32, caps: AdapterCaps) -> Option<Tiles> {
    coop_forward_candidates(d, dv, caps).next()
}

/// Workgroup arrays of a cooperative-matrix backward kernel, mirroring
/// shaders/coop/backward_*.wgsl. Owned rows (16 per subgroup) are `q_rows`
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
        let (owned, streamed) = match kernel.pass() {
            Pass::BackwardDq => (t.q_rows, t.k_rows),
            _ => (t.k_rows, t.q_rows),
        };
        let (ks, vs, ts) = (d + 8, dv + 8, streamed + 8);
        let second_off = streamed * ks;
        let weights_off = streamed * (ks + vs);
        // dK/dV keeps P^T and dS^T, dQ only dS.
        let weights2_off = weights_off + owned * ts;
        let weights_end = match kernel.pass() {
            Pass::BackwardDq => weights2_off,
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

/// The most words shaders/coop/backward_*.wgsl load ahead per invocation
/// and tile (MAXW).
pub const COOP_BACKWARD_MAX_STAGED_WORDS: u32 = 32;

/// Tiles of the cooperative-matrix backward (dQ, dK/dV) for head
/// dimensions d, dv (multiples of 16 up to 128), or None where none fits:
/// four subgroups (64 owned rows) where they fit, then two, then one, each
/// with 32 streamed rows where they fit, else 16. More owned rows before
/// taller streamed tiles: on the H100 at d = 128, four subgroups with 16
/// streamed rows ran the backward in 40 ms against 107 for two with 32
/// (at d = 64, 32 rows beat 16: 22 ms against 26;
/// docs/gpu.md#cooperative-kernels-when-and-with-which-tiles).
pub fn coop_backward_tiles(d: u32, dv: u32, caps: AdapterCaps) -> Option<(Tiles, Tiles)> {
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
                let (q_rows, k_rows) = match kernel.pass() {
                    Pass::BackwardDq => (own, streamed),
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
        pick(Kernel::dq(Tier::Coop))?,
        pick(Kernel::dkdv(Tier::Coop))?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::gpu::tiles::test_caps as caps;

    fn layout(t: Tiles) -> (u32, u32) {
        (t.workgroup / 32, t.k_rows)
    }

    #[test]
    fn coop_forward_prefers_long_key_tiles_then_tall_row_blocks() {
        // NVIDIA's 48 KiB: d = 64 fits 4 x 64 and 8 x 32; d = 128 neither.
        let d64: Vec<_> = coop_forward_candidates(64, 64, caps(48))
            .map(layout)
            .collect();
        assert_eq!(d64[..3], [(4, 64), (8, 32), (4, 32)]);
        assert_eq!(
            coop_forward_tiles(128, 128, caps(48)).map(layout),
            Some((4, 32))
        );
        // Every candidate fits, and a smaller adapter gets smaller ones.
        for kib in [16, 32, 48] {
            for (d, dv) in [(64, 64), (128, 128), (16, 128), (32, 96)] {
                for t in coop_forward_candidates(d, dv, caps(kib)) {
                    assert!(coop_workgroup_bytes(d, dv, t) <= kib as u64 * 1024, "{t:?}");
                }
            }
        }
        assert_eq!(
            coop_forward_tiles(128, 128, caps(16)).map(layout),
            Some((1, 16))
        );
        // Head dimensions it does not take.
        assert_eq!(coop_forward_tiles(72, 64, caps(48)), None);
        assert_eq!(coop_forward_tiles(64, 256, caps(48)), None);
    }
}
