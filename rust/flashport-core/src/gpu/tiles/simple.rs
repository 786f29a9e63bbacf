//! Tiles of the simple kernels, which run every shape: the largest pair of
//! tile heights whose arrays fit the adapter's workgroup memory.

use super::{Tiles, COMPILER_SLACK};
use crate::gpu::caps::AdapterCaps;
use crate::gpu::kernel::{Kernel, Pass};

/// Threads per workgroup: enough to keep a GPU's SIMD lanes busy on the
/// per-element loops, few enough that a software rasteriser's barriers
/// stay cheap.
const WORKGROUP: u32 = 64;

/// Columns of dO and o the backward pre-pass stages per pass (`CW` in
/// shaders/simple/backward_preprocess.wgsl).
pub const PREPROCESS_COLUMNS: u32 = 16;

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

/// The tiles of simple `kernel` for head dimensions `d` (q, k) and `dv`
/// (v, out) on an adapter with `caps`.
pub fn simple_tiles(kernel: Kernel, d: u32, dv: u32, caps: AdapterCaps) -> Tiles {
    let workgroup = WORKGROUP
        .min(caps.max_invocations)
        .min(caps.max_workgroup_size_x)
        .max(1);
    let budget = (caps.workgroup_storage_bytes as u64).saturating_sub(COMPILER_SLACK);
    let tiles = |(primary, secondary): (u32, u32)| {
        let (q_rows, k_rows) = match kernel.pass() {
            Pass::BackwardDkDv => (secondary, primary),
            _ => (primary, secondary),
        };
        Tiles {
            q_rows,
            k_rows,
            workgroup,
            kv_shared: false,
            prefetch: 0,
        }
    };
    CANDIDATES
        .into_iter()
        .map(tiles)
        .find(|&t| workgroup_bytes(kernel, d, dv, t) <= budget)
        .unwrap_or_else(|| tiles((1, 1)))
}

/// Tile heights and workgroup sizes tried where the adapter's driver ends
/// loops early (`AdapterCaps::loop_limit`). A thread's loops shorten with
/// a small tile of owned rows (a score's dot product is one thread's loop,
/// and the owned rows multiply the streamed ones' work), a tall streamed
/// tile (fewer tiles, each loop's cost spread over more rows) and more
/// threads (strided loops split finer).
const LEAN_SIDES: [u32; 7] = [1, 2, 4, 8, 16, 32, 64];
const LEAN_WORKGROUPS: [u32; 2] = [64, 256];

/// The tiles of simple `kernel` on an adapter whose driver lets a subgroup
/// run at most `limit` loop iterations, `iterations(tiles)` giving the
/// count of the busiest subgroup and that of a whole workgroup: the usual
/// tiles (`simple_tiles`) where they stay within the limit, so that short
/// problems run as everywhere else; otherwise, of every pair of tile
/// heights in `LEAN_SIDES` that fits workgroup memory, with 64 or 256
/// threads, the one within the limit whose workgroup runs the fewest
/// iterations per owned row (llvmpipe's time); and where none is within
/// it, the one whose busiest subgroup runs the fewest, which the caller
/// then refuses (`select::check_loop_limit`). Each output element is
/// summed in the same order whatever the thread count.
pub fn simple_tiles_within(
    kernel: Kernel,
    d: u32,
    dv: u32,
    caps: AdapterCaps,
    limit: u64,
    iterations: impl Fn(Tiles) -> (u64, u64),
) -> Tiles {
    let usual = simple_tiles(kernel, d, dv, caps);
    if iterations(usual).0 <= limit {
        return usual;
    }
    let budget = (caps.workgroup_storage_bytes as u64).saturating_sub(COMPILER_SLACK);
    let most = caps.max_invocations.min(caps.max_workgroup_size_x).max(1);
    let owned = |t: Tiles| match kernel.pass() {
        Pass::BackwardDkDv => t.k_rows,
        _ => t.q_rows,
    } as u64;
    let mut candidates = vec![(iterations(usual), usual)];
    for workgroup in LEAN_WORKGROUPS.map(|w| w.min(most)) {
        for q_rows in LEAN_SIDES {
            for k_rows in LEAN_SIDES {
                let t = Tiles {
                    q_rows,
                    k_rows,
                    workgroup,
                    ..usual
                };
                if workgroup_bytes(kernel, d, dv, t) <= budget {
                    candidates.push((iterations(t), t));
                }
            }
        }
    }
    // Scaled to keep the division's precision; larger tiles first on a tie.
    let time = |&((_, all), t): &((u64, u64), Tiles)| {
        (
            all * 4096 / owned(t),
            u64::MAX - (t.q_rows * t.k_rows) as u64,
        )
    };
    candidates
        .iter()
        .filter(|((most, _), _)| *most <= limit)
        .min_by_key(|c| time(c))
        .or_else(|| candidates.iter().min_by_key(|c| (c.0 .0, time(c))))
        .map_or(usual, |&(_, t)| t)
}

/// Workgroup bytes of a simple kernel, mirroring its arrays.
pub(super) fn workgroup_bytes(kernel: Kernel, d: u32, dv: u32, t: Tiles) -> u64 {
    let (bq, bk) = (t.q_rows as u64, t.k_rows as u64);
    let (d, dv) = (d as u64, dv as u64);
    let e = |n: u64| n.max(1);
    // K and V tiles have rows padded by one word (see KS/VS in the shaders).
    let (kt, vt) = (e(bk * (d + 1)), e(bk * (dv + 1)));
    let words = match kernel.pass() {
        // And the rows' codes and the keys' flags of non-finite values, and
        // the screen's flag (lib/screened.wgsl), here and in dQ and dK/dV.
        Pass::Forward => e(bq * d) + kt + vt + e(bq * bk) + e(bq * dv) + 4 * e(bq) + bk + 1,
        // The dK/dV accumulators are sized like the K/V tiles.
        Pass::BackwardDkDv => {
            2 * kt + 2 * vt + e(bq * d) + e(bq * dv) + 2 * e(bq * bk) + 3 * e(bq) + 1
        }
        // And the flags of the K tile's non-finite values.
        Pass::BackwardDq => 2 * e(bq * d) + e(bq * dv) + kt + vt + e(bq * bk) + 3 * e(bq) + bk + 1,
        // dO and o, a few columns of the workgroup's rows at a time.
        Pass::BackwardPreprocess => 2 * t.workgroup as u64 * (PREPROCESS_COLUMNS as u64 + 1),
    };
    4 * words
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::kernel::Tier;

    #[test]
    fn every_head_dim_fits_webgpu_default_16_kib() {
        let caps = AdapterCaps::WEBGPU_DEFAULT;
        for kernel in Kernel::SIMPLE {
            for d in 1..=256 {
                for dv in (0..=256).step_by(7).chain([255, 256]) {
                    let t = simple_tiles(kernel, d, dv, caps);
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
        let small = simple_tiles(
            Kernel::forward(Tier::Simple),
            64,
            64,
            AdapterCaps::WEBGPU_DEFAULT,
        );
        let large = simple_tiles(
            Kernel::forward(Tier::Simple),
            64,
            64,
            AdapterCaps {
                workgroup_storage_bytes: 48 * 1024,
                ..AdapterCaps::WEBGPU_DEFAULT
            },
        );
        assert!(large.q_rows * large.k_rows > small.q_rows * small.k_rows);
        let wide = simple_tiles(
            Kernel::dkdv(Tier::Simple),
            256,
            256,
            AdapterCaps::WEBGPU_DEFAULT,
        );
        assert!(wide.k_rows >= 1 && wide.q_rows >= 1);
    }
}
