//! How many loop iterations one subgroup of a kernel runs, for the drivers
//! that end a shader's loops after a fixed number of iterations in all
//! (`AdapterCaps::loop_limit`).
//!
//! Mesa's llvmpipe (lavapipe) before 25.0 counts the back edges of every
//! loop an invocation runs in one counter per shader function, started at
//! 65535 (gallivm's loop limiter, `LP_MAX_TGSI_LOOP_ITERATIONS`, "shared
//! between every loop"): each pass through a loop's end decrements it, the
//! final pass that leaves the loop included, and once it reaches 0 every
//! loop leaves after the pass it is in. An invocation is 8 lanes there (one
//! SIMD subgroup, which runs a loop as long as any of its lanes does), so
//! the count is per subgroup. Nothing reports the cut: the kernel goes on
//! with partial sums, and where the cut subgroup then reaches fewer
//! barriers than the others, lavapipe ends the workgroup as soon as that
//! subgroup returns (its coroutine loop stops at the first finished
//! coroutine), so the other subgroups' writes never happen. Measured on
//! Mesa 22.3.6: one loop runs 65535 iterations and no more; two loops share
//! the count; Mesa 25.0.7 has no limit.
//!
//! `iterations` is an upper bound of the count of a kernel's first subgroup
//! (lanes 0..7, which every loop of these kernels gives the most work). A
//! loop of n iterations makes n + 1 passes, and its last pass, the one that
//! finds no lane left, runs the body once more with every lane masked off
//! (llvmpipe masks rather than branches), so each loop nested in it makes
//! one pass then too; an inner loop on an iteration where none of the
//! subgroup's lanes has work also makes one. Every tile is counted as full
//! and visible (causal masks and windows only shorten loops), and the
//! variants' loops where they exist (the mask's block map, Philox's ten
//! rounds, the score gradient's zero fill). Loops with a constant trip
//! count are counted too, although the driver unrolls the short ones with
//! small bodies (up to 32 iterations, measured), so the count can be high
//! by a few percent, never low. The unit tests below hold it against the
//! cuts measured on Mesa 22.3.6, which it reproduces to the iteration where
//! no loop is unrolled (the tiled forward's: 2426 tiles of 32 keys run,
//! 2427 do not).

use super::decode::{DecodeTiles, SubgroupTiles};
use super::simple::PREPROCESS_COLUMNS;
use super::tiled::tiled_nv;
use super::{TILED_BK, TILED_CG};
use crate::gpu::kernel::{Pass, Tier};
use crate::gpu::select::PipelineKey;

/// What the count depends on beyond the pipeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoopShape {
    pub seq_q: u64,
    pub seq_k: u64,
    /// Query heads per key/value head: a dK/dV workgroup walks all of them.
    pub group: u64,
}

/// A loop of `n` iterations whose body runs `body` loop passes per
/// iteration and holds `nested` loops (at any depth): its own n + 1
/// passes, its iterations' bodies, and the final pass, which runs the body
/// once more with no lane active, where each nested loop makes one pass.
fn lp(n: u64, body: u64, nested: u64) -> u64 {
    n + 1 + n * body + nested
}

/// A loop with no loop inside.
fn flat(n: u64) -> u64 {
    lp(n, 0, 0)
}

/// Philox4x32-10: a loop of ten rounds.
const PHILOX: u64 = 11;

/// `lib/common.wgsl`'s `mask_tile_visible` over `rows` x `keys`: two
/// nested loops over the 16 x 16 blocks the span touches (one more each
/// way where it is unaligned); 0 without a mask.
fn mask_check(mask: bool, rows: u64, keys: u64) -> u64 {
    if !mask {
        return 0;
    }
    let (rb, kb) = (rows.div_ceil(16) + 1, keys.div_ceil(16) + 1);
    lp(rb, flat(kb), 1)
}

/// `next_visible_tile` (the tiled kernels, with a mask): a loop whose
/// every pass checks a tile; over a whole kernel at most two passes per
/// tile (each tile is skipped once or stepped to once, and each call
/// ends with one pass), so this is charged per tile.
fn next_visible(mask: bool, rows: u64, keys: u64) -> u64 {
    if mask {
        2 * (1 + mask_check(true, rows, keys))
    } else {
        0
    }
}

/// Lanes of a subgroup on llvmpipe (256-bit SIMD).
const SUBGROUP: u64 = 8;

/// The loop iterations the first subgroup of `key`'s kernel runs on `s`,
/// the most of any, as Mesa's llvmpipe counts them (module documentation).
pub fn iterations(key: &PipelineKey, s: LoopShape) -> u64 {
    subgroup_iterations(key, s, 0)
}

/// The loop iterations of all subgroups of a workgroup of `key`'s kernel
/// on `s` together: a measure of its time on llvmpipe, where a subgroup
/// whose lanes all skip a loop leaves it at once.
pub fn workgroup_iterations(key: &PipelineKey, s: LoopShape) -> u64 {
    let wg = key.tiles.workgroup.max(1) as u64;
    (0..wg.div_ceil(SUBGROUP))
        .map(|i| subgroup_iterations(key, s, i * SUBGROUP))
        .sum()
}

/// The loop iterations of the subgroup whose first lane is `lane`.
fn subgroup_iterations(key: &PipelineKey, s: LoopShape, lane: u64) -> u64 {
    use {Pass::*, Tier::*};
    let t = key.tiles;
    let (bq, bk, wg) = (t.q_rows as u64, t.k_rows as u64, t.workgroup.max(1) as u64);
    let (d, dv) = (key.d as u64, key.dv as u64);
    let v = key.variants;
    let group = s.group.max(1);
    // Trips of the subgroup (of its first lane, which has the most) in a
    // loop over `n` elements strided by the workgroup.
    let per = |n: u64| n.saturating_sub(lane).div_ceil(wg);
    // Rows and keys of the fullest workgroup and tile.
    let (rows, keys) = (bq.min(s.seq_q), bk.min(s.seq_k));
    let philox = |on: bool| if on { PHILOX } else { 0 };
    let (m, dmask, drop) = (v.mask, v.mask && v.dmask, v.dropout);
    let n = |on: bool| u64::from(on);
    // A strided loop over `total` scores of which the first `live` have
    // rows: each live iteration runs `work` (holding `loops` loops), the
    // others those loops' single passes.
    let scores = |total: u64, live: u64, work: u64, loops: u64| {
        let (trips, live) = (per(total), per(live).min(per(total)));
        trips + 1 + live * work + (trips - live) * loops + loops
    };
    match (key.kernel.pass(), key.kernel.tier()) {
        (BackwardPreprocess, _) => {
            // Per staged pass: the loads of the pass's columns of every
            // row, four per step, then the row's sum over them.
            let cw = PREPROCESS_COLUMNS as u64;
            let loads = (wg * cw).saturating_sub(lane).div_ceil(4 * wg);
            lp(dv.div_ceil(cw), flat(loads) + flat(cw), 2)
        }
        (Forward, Simple) => {
            let (tr, ta) = (per(bq), per(bq * dv));
            // The online-softmax step, one row per thread: the row maximum
            // over the row's keys, then the sum over the tile (a Philox
            // call, or the single pass of its loop, per key under dropout).
            let softmax = lp(tr, flat(keys) + lp(bk, philox(drop), n(drop)), 2 + n(drop));
            let tile = mask_check(m, bq, bk)
                + flat(per(bk * d))
                + flat(per(bk * dv))
                + scores(bq * bk, rows * bk, flat(d), 1)
                + softmax
                + lp(ta, flat(keys), 1);
            let tile_loops = 2 * n(m) + 2 + 2 + 3 + n(drop) + 2;
            let prologue = flat(per(bq * d)) + flat(ta) + flat(tr);
            let epilogue = flat(per(rows * dv)) + flat(per(rows));
            prologue + lp(s.seq_k.div_ceil(bk), tile, tile_loops) + epilogue
        }
        (BackwardDq, Simple) => {
            let tq = per(bq * d);
            let tile = mask_check(m, bq, bk)
                + if dmask { flat(per(bq * bk)) } else { 0 }
                + flat(per(bk * d))
                + flat(per(bk * dv))
                + scores(
                    bq * bk,
                    rows * bk,
                    flat(d) + flat(dv) + philox(drop),
                    2 + n(drop),
                )
                + lp(tq, flat(keys), 1);
            let tile_loops = 2 * n(m) + n(dmask) + 2 + 3 + n(drop) + 2;
            let prologue = flat(tq) + flat(per(bq * dv)) + flat(per(bq));
            let epilogue = if v.dmask {
                flat(per(rows * s.seq_k))
            } else {
                0
            } + flat(per(rows * d));
            prologue + lp(s.seq_k.div_ceil(bk), tile, tile_loops) + epilogue
        }
        (BackwardDkDv, Simple) => {
            // Owned keys `bk`, streamed query rows `bq`.
            let tile = mask_check(m, bq, bk)
                + flat(per(bq * d))
                + flat(per(bq * dv))
                + flat(per(bq))
                + scores(
                    bq * bk,
                    rows * bk,
                    flat(d) + flat(dv) + philox(drop),
                    2 + n(drop),
                )
                + lp(per(bk * dv), flat(rows), 1)
                + lp(per(bk * d), flat(rows), 1);
            let tile_loops = 2 * n(m) + 3 + 3 + n(drop) + 4;
            // Every query tile of every query head of the group.
            let heads = lp(
                group,
                lp(s.seq_q.div_ceil(bq), tile, tile_loops),
                1 + tile_loops,
            );
            let ends = flat(per(bk * d)) + flat(per(bk * dv));
            let last = flat(per(keys * d)) + flat(per(keys * dv));
            ends + heads + last
        }
        (Forward, Tiled) => {
            // The shader's key tile is a constant.
            let bk = TILED_BK as u64;
            let (d4, nv) = (d / 4, tiled_nv(key.dv) as u64);
            // K and V by loops where nothing is prefetched; V over K inside
            // the tile where they share memory.
            let (loads, load_loops) = match (t.prefetch, t.kv_shared) {
                (0, false) => (flat(per(bk * d4)) + flat(per(bk * 8 * nv)), 2),
                (0, true) => (flat(per(bk * d4)) + flat(per(bk * 8 * nv)), 2),
                (_, true) => (flat(per(bk * 8 * nv)), 1),
                (_, false) => (0, 0),
            };
            // Without subgroups each row reduction is a loop.
            let reduce = u64::from(!key.subgroups);
            let tile = next_visible(m, bq, bk)
                + loads
                + flat(d4)
                + reduce * flat(TILED_CG as u64 - 1)
                + 16 * philox(drop)
                + flat(8);
            let tile_loops = 3 * n(m) + load_loops + 2 + reduce + 16 * n(drop);
            let prologue = flat(per(bq * d4)) + next_visible(m, bq, bk);
            prologue
                + lp(s.seq_k.div_ceil(bk), tile, tile_loops)
                + reduce * flat(TILED_CG as u64 - 1)
        }
        (BackwardDq, Tiled) => {
            let bc = TILED_BK as u64;
            let (d4, dv4, nd) = (d / 4, dv / 4, tiled_nv(key.d) as u64);
            // V and K by loops where nothing is prefetched.
            let (loads, load_loops) = if t.prefetch == 0 {
                (flat(per(bc * dv4)) + flat(per(bc * 8 * nd)), 2)
            } else {
                (0, 0)
            };
            // The score gradient of hidden tiles zeroed, charged per tile
            // (one call may zero several).
            let tile = next_visible(m, bq, bc)
                + if dmask { flat(per(bq * bc)) + 1 } else { 0 }
                + loads
                + flat(dv4)
                + flat(d4)
                + flat(8)
                + 16 * philox(drop);
            let tile_loops = 3 * n(m) + n(dmask) + load_loops + 3 + 16 * n(drop);
            let prologue = flat(per(bq * d4)) + flat(per(bq * dv4)) + next_visible(m, bq, bc);
            let epilogue = if v.dmask {
                flat(per(rows * s.seq_k))
            } else {
                0
            };
            prologue + lp(s.seq_k.div_ceil(bc), tile, tile_loops) + epilogue
        }
        (BackwardDkDv, Tiled) => {
            let bc = TILED_BK as u64;
            let (d4, dv4) = (d / 4, dv / 4);
            let (nd, nv) = (tiled_nv(key.d) as u64, tiled_nv(key.dv) as u64);
            // dO and Q streamed by loops where nothing is prefetched; the
            // shared layout streams Q (unless prefetched) and dO again.
            let (d_out, q) = (flat(per(bc * 8 * nv)), flat(per(bc * 8 * nd)));
            let (loads, load_loops) = match (t.prefetch, t.kv_shared) {
                (0, false) => (d_out + q, 2),
                (0, true) => (2 * d_out + q, 3),
                (_, true) => (flat(per(bc * 8 * nv)), 1),
                (_, false) => (0, 0),
            };
            let products = if t.kv_shared { 2 } else { 1 };
            let tile = next_visible(m, bc, bk)
                + loads
                + flat(dv4)
                + flat(d4)
                + products * flat(8)
                + 16 * philox(drop);
            let tile_loops = 3 * n(m) + load_loops + 2 + products + 16 * n(drop);
            let prologue = flat(per(bk * d4)) + flat(per(bk * dv4)) + next_visible(m, bc, bk);
            prologue + lp(group * s.seq_q.div_ceil(bc), tile, tile_loops)
        }
        // The cooperative kernels need cooperative matrices, which no
        // adapter with a loop limit has (llvmpipe): not modelled.
        (_, Coop | Cm2) => 0,
    }
}

/// The loop passes of the first subgroup of a decode workgroup
/// (shaders/decode/decode.wgsl with layout `t`, the most of any subgroup:
/// its lanes hold the rows' softmax loops) over a split of `keys` keys,
/// every tile counted full. The kernel's other loops do not grow with the
/// keys, so the split length is what the host chooses to keep within the
/// limit (`gpu::decode::select::gpu_splits`). Measured on Mesa 22.3.6 with
/// one split: at d = 8 and one row (tiles of 256 keys, loops of 256 that
/// are not unrolled) 126 tiles run and 127 do not, where this counts 124;
/// at d = 128 and four rows (tiles of 16 keys) 16384 tiles run, where this
/// counts 922: the driver unrolls the loops over 32 lanes and 16 keys.
pub fn decode_iterations(t: &DecodeTiles, keys: u64) -> u64 {
    let wg = t.workgroup.max(1) as u64;
    let (lanes, key_groups) = (t.lanes as u64, t.key_groups() as u64);
    let (rows, tile_keys) = (t.rows as u64, t.tile_keys() as u64);
    let per = |n: u64| n.div_ceil(wg);
    // Each row of q scaled in a loop of its four elements.
    let prologue = rows * flat(4);
    // Read element by element, each key and value row is a loop of four.
    let (loads, load_loops) = match t.vec4 {
        true => (0, 0),
        false => (
            2 * t.keys_per_lane as u64 * flat(4),
            2 * t.keys_per_lane as u64,
        ),
    };
    // The scores (a strided loop over (row, key), each a sum over the
    // lanes), then the rows' maximum and sum over the tile's keys.
    let tile = loads + lp(per(rows * tile_keys), flat(lanes), 1) + 2 * flat(tile_keys);
    let tile_loops = load_loops + 2 + 2;
    // The accumulators into `part` (four elements), then each output
    // element summed over the key groups.
    let epilogue = flat(4) + lp(per(rows * lanes * 4), flat(key_groups), 1);
    prologue + lp(keys.div_ceil(tile_keys.max(1)), tile, tile_loops) + epilogue
}

/// The loop passes of a subgroup of decoding's subgroup kernel
/// (shaders/decode/subgroup.wgsl with layout `t`) over a split of `keys`
/// keys, every pass counted full: the loop over the keys, whose body has
/// no loop of its own where the caches are read four elements at a time
/// (everything else in it is unrolled), and the loops of the prologue and
/// of the walkers' merge at the end. Every subgroup runs the same passes
/// of the key loop (its bounds are the workgroup's).
pub fn subgroup_decode_iterations(t: &SubgroupTiles, keys: u64) -> u64 {
    let wg = t.workgroup.max(1) as u64;
    // vec4s of a row per lane.
    let vec4s = t.quads as u64;
    let (rows, walkers) = (t.rows as u64, t.walkers() as u64);
    let per = |n: u64| n.div_ceil(wg);
    // Each vec4 of q scaled in a loop of its four elements.
    let prologue = rows * vec4s * flat(4);
    // Read element by element, each vec4 of a key or value row is a loop
    // of four.
    let (loads, load_loops) = match t.vec4 {
        true => (0, 0),
        false => {
            let n = 2 * t.keys as u64 * vec4s;
            (n * flat(4), n)
        }
    };
    let passes = lp(
        keys.div_ceil(t.step_keys().max(1) as u64),
        loads,
        load_loops,
    );
    // The rows' largest row_max and their weights over the walkers, then
    // each output element summed over them.
    let width = 4 * t.row_vec4s() as u64;
    let epilogue = 2 * flat(walkers) + lp(per(rows * width), flat(walkers), 1);
    prologue + passes + epilogue
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::caps::AdapterCaps;
    use crate::gpu::kernel::Kernel;
    use crate::gpu::select::Variants;
    use crate::gpu::tiles::{tiled_forward_tiles, Tiles};

    const LIMIT: u64 = 65535;

    fn key(kernel: Kernel, d: u32, dv: u32, tiles: Tiles) -> PipelineKey {
        PipelineKey {
            kernel,
            f16_inputs: false,
            d,
            dv,
            tiles,
            subgroups: true,
            variants: Variants::default(),
            passthrough: false,
            exact_tiles: false,
        }
    }

    fn simple(q_rows: u32, k_rows: u32) -> Tiles {
        Tiles {
            q_rows,
            k_rows,
            workgroup: 64,
            kv_shared: false,
            prefetch: 0,
        }
    }

    fn shape(seq_q: u64, seq_k: u64, group: u64) -> LoopShape {
        LoopShape {
            seq_q,
            seq_k,
            group,
        }
    }

    /// Where lavapipe (Mesa 22.3.6) was measured to start cutting each
    /// kernel short, on the usual tiles: the count must be over the limit
    /// for the first shape that came out wrong, and is within it for the
    /// last right one where the count is exact (every tile full, and no
    /// loop the driver unrolls: it unrolls some with a constant trip count
    /// of at most 32, such as the forward's sum over a tile's keys, which
    /// are counted here all the same).
    #[test]
    fn counts_match_the_measured_cuts() {
        let lavapipe = AdapterCaps {
            workgroup_storage_bytes: 32 * 1024,
            max_invocations: 1024,
            max_workgroup_size_x: 1024,
            subgroups: true,
            ..AdapterCaps::WEBGPU_DEFAULT
        };
        let tiled = tiled_forward_tiles(64, 64, lavapipe).unwrap();
        // (kernel, d, dv, tiles, (seq_q, seq_k, group) right, wrong, exact)
        let cases = [
            (
                Kernel::forward(Tier::Simple),
                1024,
                1024,
                simple(2, 1),
                (56, 56, 1),
                (57, 57, 1),
                false,
            ),
            (
                Kernel::forward(Tier::Simple),
                46,
                122,
                simple(16, 16),
                (16, 1275, 1),
                (16, 1276, 1),
                false,
            ),
            (
                Kernel::dq(Tier::Simple),
                46,
                122,
                simple(16, 16),
                (16, 1091, 1),
                (16, 1092, 1),
                false,
            ),
            (
                Kernel::dq(Tier::Simple),
                40,
                122,
                simple(16, 16),
                (16, 1168, 1),
                (16, 1169, 1),
                true,
            ),
            (
                Kernel::dkdv(Tier::Simple),
                46,
                122,
                simple(8, 16),
                (160, 64, 4),
                (161, 64, 4),
                true,
            ),
            (
                Kernel::forward(Tier::Tiled),
                64,
                64,
                tiled,
                (16, 77626, 1),
                (16, 77643, 1),
                true,
            ),
        ];
        for (kernel, d, dv, t, right, wrong, exact) in cases {
            let k = key(kernel, d, dv, t);
            let at = |(q, kk, g)| iterations(&k, shape(q, kk, g));
            eprintln!(
                "{kernel:?} d={d} dv={dv} {t:?}: right {} wrong {}",
                at(right),
                at(wrong)
            );
            assert!(at(wrong) > LIMIT, "{kernel:?} {wrong:?}: {}", at(wrong));
            if exact {
                assert!(at(right) <= LIMIT, "{kernel:?} {right:?}: {}", at(right));
            }
        }
    }

    /// Where lavapipe (Mesa 22.3.6) was measured to cut the decode kernel
    /// short with one split: the count must be over the limit there.
    #[test]
    fn decode_counts_cover_the_measured_cuts() {
        use crate::gpu::decode::select::{decode_tiles, AdapterKind, DecodeCaps};
        let lavapipe = DecodeCaps {
            kind: AdapterKind::Software,
            workgroup_storage_bytes: 32 * 1024,
            max_invocations: 1024,
            loop_limit: Some(LIMIT as u32),
            subgroup_size: None,
            coop: false,
        };
        // (d, rows, keys that came out right, keys that did not)
        for (d, rows, right, wrong) in [(8, 1, 32256, 32257), (128, 4, 262143, 262144)] {
            let t = decode_tiles(d, d, rows, lavapipe).unwrap();
            let at = |keys| decode_iterations(&t, keys);
            eprintln!(
                "decode d={d} rows={rows} {t:?}: right {} wrong {}",
                at(right),
                at(wrong)
            );
            assert!(at(wrong) > LIMIT, "d={d}: {}", at(wrong));
        }
    }
}
