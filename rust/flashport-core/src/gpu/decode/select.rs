//! What the decode kernel runs with: its layout and tiles fitted to the
//! adapter's workgroup memory, and the number of key splits, each a pure
//! function of the problem's shape and what the adapter is, tested below
//! on a table of adapters without a GPU. Nothing here reads the
//! environment or measures anything.

use crate::error::{Error, Result};
use crate::gpu::tiles::{decode_iterations, subgroup_decode_iterations};
use crate::problem::{KvCacheProblem, MAX_SPLITS};
use crate::splits::split_keys;

// The layouts live with the other tiers' tiles; the choice is here.
pub use crate::gpu::tiles::decode::{
    decode_tiles, subgroup_tiles, AdapterKind, DecodeCaps, DecodeTiles, SubgroupKnobs,
    SubgroupTiles, HALVES_PASS_WORDS, MAX_HEAD_DIM, SUBGROUP_MAX_LANES, SUBGROUP_MAX_QUADS,
};

/// Which decode kernel runs, with its layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DecodeKernel {
    /// shaders/decode/decode.wgsl: key groups that meet in workgroup
    /// memory at every tile; any adapter.
    Workgroup(DecodeTiles),
    /// shaders/decode/subgroup.wgsl: walkers of one subgroup each, no
    /// barrier while the keys stream.
    Subgroup(SubgroupTiles),
}

impl DecodeKernel {
    /// Query rows per workgroup.
    pub fn rows(&self) -> u32 {
        match self {
            DecodeKernel::Workgroup(t) => t.rows,
            DecodeKernel::Subgroup(t) => t.rows,
        }
    }
    /// Whether the caches are read four elements at a time.
    pub fn vec4(&self) -> bool {
        match self {
            DecodeKernel::Workgroup(t) => t.vec4,
            DecodeKernel::Subgroup(t) => t.vec4,
        }
    }
    /// Row blocks per (sequence, key/value head).
    pub fn row_blocks(&self, group_rows: usize) -> usize {
        group_rows.div_ceil(self.rows() as usize).max(1)
    }
    /// The kernel's overrides (see the tiles' own).
    pub fn overrides(&self, paged: bool) -> Vec<(&'static str, f64)> {
        match self {
            DecodeKernel::Workgroup(t) => t.overrides(paged),
            DecodeKernel::Subgroup(t) => t.overrides(paged),
        }
    }
    /// Workgroups a call should spread over (the default split count's
    /// aim): the adapter kind's for the workgroup kernel, half as many for
    /// the subgroup kernel, whose workgroups stream their keys faster, so
    /// that fewer and longer splits leave the combine pass less to merge.
    /// Measured on an H100 (d = 128, 32 query / 8 KV heads, kernel
    /// timestamps): at (batch, context) = (1, 131072), (8, 32768) and
    /// (32, 4096), half the splits (64, 8, 2) took 0.444 / 0.794 / 0.410 ms
    /// of decode and combine in float32 and 0.407 / 0.710 / 0.375 ms in
    /// float16, against 0.534 / 0.831 / 0.428 and 0.488 / 0.726 / 0.385 ms
    /// with the kind's count (128, 16, 4); twice (256, 32, 8) was slower.
    pub fn target_workgroups(&self, kind: AdapterKind) -> usize {
        match self {
            DecodeKernel::Workgroup(_) => kind.target_workgroups(),
            DecodeKernel::Subgroup(_) => kind.target_workgroups().div_ceil(2),
        }
    }
    /// The loop passes of a workgroup's first subgroup over a split of
    /// `keys` keys (src/gpu/tiles/loops.rs).
    pub fn loop_passes(&self, keys: u64) -> u64 {
        match self {
            DecodeKernel::Workgroup(t) => decode_iterations(t, keys),
            DecodeKernel::Subgroup(t) => subgroup_decode_iterations(t, keys),
        }
    }
}

/// The decode kernel for the shape: the subgroup kernel where
/// [`subgroup_tiles`] fits one, else the workgroup kernel of
/// [`decode_tiles`]; `None` when neither fits.
pub fn decode_kernel(
    d: usize,
    dv: usize,
    group_rows: usize,
    f16: bool,
    caps: DecodeCaps,
    knobs: SubgroupKnobs,
) -> Option<DecodeKernel> {
    subgroup_tiles(d, dv, group_rows, f16, caps, knobs)
        .map(DecodeKernel::Subgroup)
        .or_else(|| decode_tiles(d, dv, group_rows, caps).map(DecodeKernel::Workgroup))
}

/// The most splits the default gives a sequence, and the fewest keys it
/// gives a split: past those, the partial states to merge cost more than
/// the parallelism brings.
pub const GPU_MAX_SPLITS: usize = 128;
pub const GPU_MIN_SPLIT_KEYS: usize = 128;

/// The GPU's key splits per sequence: the caller's, else enough for the
/// kernel's target workgroups on the adapter's kind
/// ([`DecodeKernel::target_workgroups`]) over (sequence, key/value head,
/// row block), with no split under [`GPU_MIN_SPLIT_KEYS`] keys of the longest
/// sequence and at most [`GPU_MAX_SPLITS`]; then, where the driver limits
/// a subgroup's loop passes, the fewest splits from there whose longest
/// split stays within the limit. The caller's count past the limit, or a
/// sequence that no count keeps within it, is `Error::TooLarge`: the
/// driver would cut the kernel's loops short without a word.
pub fn gpu_splits(p: &KvCacheProblem, kernel: DecodeKernel, caps: DecodeCaps) -> Result<usize> {
    let longest = (0..p.batch())
        .map(|b| p.keys_read(b).len())
        .max()
        .unwrap_or(0);
    let fits = |splits: usize| {
        caps.loop_limit
            .is_none_or(|limit| loop_passes(kernel, longest, splits) <= limit as u64)
    };
    let chosen = match p.num_splits {
        Some(n) => n,
        None => {
            let workgroups = (p.batch() * p.heads_kv() * kernel.row_blocks(p.group_rows())).max(1);
            let by_target = kernel.target_workgroups(caps.kind).div_ceil(workgroups);
            let by_keys = (longest / GPU_MIN_SPLIT_KEYS).max(1);
            let default = by_target.min(by_keys).clamp(1, GPU_MAX_SPLITS);
            match (default..=MAX_SPLITS).find(|&s| fits(s)) {
                Some(s) => return Ok(s),
                None => default,
            }
        }
    };
    if fits(chosen) {
        return Ok(chosen);
    }
    let limit = caps.loop_limit.unwrap_or(u32::MAX);
    let passes = loop_passes(kernel, longest, chosen);
    let advice = match (chosen..=MAX_SPLITS).find(|&s| fits(s)) {
        Some(s) => format!("num_splits={s} or more, or device=\"cpu\""),
        None => "device=\"cpu\"".to_string(),
    };
    Err(Error::TooLarge(format!(
        "decoding a sequence of {longest} keys in {chosen} split(s) would run {passes} loop \
         iterations in one GPU invocation, and this adapter's driver (Mesa's llvmpipe before \
         25.0) silently ends a shader's loops after {limit}; use {advice} (or Mesa 25 or newer)"
    )))
}

/// The loop passes of the decode kernel over the longest of `splits`
/// splits of `longest` keys (the first: [`split_keys`]).
fn loop_passes(kernel: DecodeKernel, longest: usize, splits: usize) -> u64 {
    let keys = split_keys(0..longest, splits, 0).len();
    kernel.loop_passes(keys as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::select::LLVMPIPE_LOOP_LIMIT;
    use crate::gpu::tiles::decode::SPARE_BYTES;
    use crate::problem::{validate_kvcache, ArrayInfo, IntArray, KvCacheOptions};

    const H100: DecodeCaps = DecodeCaps {
        kind: AdapterKind::Discrete,
        workgroup_storage_bytes: 48 * 1024,
        max_invocations: 1024,
        loop_limit: None,
        subgroup_size: Some(32),
    };
    /// Mesa 25 or newer: no loop limit.
    const LAVAPIPE: DecodeCaps = DecodeCaps {
        kind: AdapterKind::Software,
        workgroup_storage_bytes: 32 * 1024,
        max_invocations: 1024,
        loop_limit: None,
        subgroup_size: Some(8),
    };
    /// Mesa 22.3 (CI's lavapipe).
    const LAVAPIPE_22: DecodeCaps = DecodeCaps {
        loop_limit: Some(LLVMPIPE_LOOP_LIMIT),
        ..LAVAPIPE
    };
    const WEBGPU: DecodeCaps = DecodeCaps {
        kind: AdapterKind::Other,
        workgroup_storage_bytes: 16 * 1024,
        max_invocations: 256,
        loop_limit: None,
        subgroup_size: None,
    };

    #[test]
    fn tiles_fit_every_adapter_for_every_head_dimension() {
        for caps in [H100, LAVAPIPE, WEBGPU] {
            for d in [1, 3, 4, 16, 62, 64, 80, 96, 128, 192, 256, 300, 512] {
                for group_rows in [1, 2, 3, 4, 8, 32, 200] {
                    let t = decode_tiles(d, d, group_rows, caps)
                        .unwrap_or_else(|| panic!("{caps:?} d={d} rows={group_rows}"));
                    assert!(
                        t.workgroup_bytes() + SPARE_BYTES <= caps.workgroup_storage_bytes as u64
                    );
                    assert!(t.workgroup <= caps.max_invocations && t.lanes <= t.workgroup);
                    assert!(4 * t.lanes as usize >= d, "{t:?}");
                    assert!(t.rows.is_power_of_two() && t.rows <= 8);
                    assert_eq!(t.vec4, d % 4 == 0);
                }
            }
        }
        assert_eq!(decode_tiles(513, 64, 4, H100), None);
        assert_eq!(decode_tiles(64, 600, 4, H100), None);
    }

    #[test]
    fn a_decoding_group_is_one_workgroup_of_whole_rows() {
        // Llama-style GQA decode at d = 128: 4 rows, 32 lanes per key row,
        // 4 key groups, 16 keys per tile.
        let t = decode_tiles(128, 128, 4, H100).unwrap();
        assert_eq!(
            (t.workgroup, t.lanes, t.keys_per_lane, t.rows),
            (128, 32, 4, 4)
        );
        assert_eq!((t.key_groups(), t.tile_keys(), t.row_blocks(4)), (4, 16, 1));
        // 8 rows of d = 128 fit lavapipe with 4 keys per lane, and the
        // WebGPU default only with a smaller workgroup.
        assert_eq!(
            decode_tiles(128, 128, 8, LAVAPIPE).unwrap().keys_per_lane,
            4
        );
        let small = decode_tiles(128, 128, 8, WEBGPU).unwrap();
        assert_eq!(small.workgroup, 64);
        // Chunked prefill: 4 heads × 16 rows in blocks of 8.
        assert_eq!(decode_tiles(128, 128, 64, H100).unwrap().row_blocks(64), 8);
    }

    fn problem(
        batch: usize,
        heads_kv: usize,
        seq_q: usize,
        len: i64,
        splits: Option<i128>,
    ) -> KvCacheProblem {
        let q = [batch, 4 * heads_kv, seq_q, 128];
        let cache = [batch, heads_kv, 1 << 18, 128];
        let lens = vec![len; batch];
        validate_kvcache(
            ArrayInfo::new(&q, "float16"),
            ArrayInfo::new(&cache, "float16"),
            ArrayInfo::new(&cache, "float16"),
            IntArray {
                shape: &[batch],
                dtype: "int64",
                values: &lens,
            },
            None,
            &KvCacheOptions {
                num_splits: splits,
                ..KvCacheOptions::default()
            },
        )
        .unwrap()
    }

    fn splits(p: &KvCacheProblem, caps: DecodeCaps) -> usize {
        let tiles = decode_tiles(128, 128, p.group_rows(), caps).unwrap();
        gpu_splits(p, DecodeKernel::Workgroup(tiles), caps).unwrap()
    }

    #[test]
    fn splits_fill_the_adapter_from_the_shape() {
        // One sequence, 8 key/value heads: 128 splits of a long cache make
        // 1024 workgroups on a discrete GPU; a short one splits less.
        assert_eq!(splits(&problem(1, 8, 1, 131072, None), H100), 128);
        assert_eq!(splits(&problem(1, 8, 1, 4096, None), H100), 32);
        assert_eq!(splits(&problem(1, 8, 1, 100, None), H100), 1);
        // 32 sequences: 4 splits.
        assert_eq!(splits(&problem(32, 8, 1, 32768, None), H100), 4);
        // Chunked prefill (8 row blocks) needs fewer.
        assert_eq!(splits(&problem(1, 8, 16, 32768, None), H100), 16);
        // lavapipe: a few threads.
        assert_eq!(splits(&problem(1, 8, 1, 131072, None), LAVAPIPE), 1);
        assert_eq!(splits(&problem(1, 1, 1, 131072, None), LAVAPIPE), 8);
        // The caller's count, whatever the adapter.
        assert_eq!(splits(&problem(1, 8, 1, 64, Some(700)), LAVAPIPE), 700);
    }

    #[test]
    fn splits_keep_a_loop_limit() {
        let tiles = decode_tiles(128, 128, 4, LAVAPIPE_22).unwrap();
        let limit = LLVMPIPE_LOOP_LIMIT as u64;
        // The longest split that keeps the limit, in granules of 16 keys.
        let most = (0..)
            .map(|g| 16 * g)
            .take_while(|&k| decode_iterations(&tiles, k) <= limit)
            .last()
            .unwrap();
        assert!(most > 8192 && most < 65536, "{most}");
        for (len, want_default) in [
            (100, 1),
            (most as i64, 1),
            (most as i64 + 1, 2),
            (131072, 0),
        ] {
            let p = problem(1, 8, 1, len, None);
            let s = splits(&p, LAVAPIPE_22);
            // The fewest splits from Mesa 25's count up that keep it.
            let unlimited = splits(&p, LAVAPIPE);
            assert!(s >= unlimited);
            let longest = split_keys(0..len as usize, s, 0).len() as u64;
            assert!(decode_iterations(&tiles, longest) <= limit, "{len}: {s}");
            if s > unlimited {
                let fewer = split_keys(0..len as usize, s - 1, 0).len() as u64;
                assert!(decode_iterations(&tiles, fewer) > limit, "{len}: {s}");
            }
            if want_default > 0 {
                assert_eq!(s, want_default, "{len}");
            }
            // Other adapters are not held to it.
            assert_eq!(
                splits(&p, H100),
                splits(
                    &p,
                    DecodeCaps {
                        loop_limit: None,
                        ..H100
                    }
                )
            );
        }
        // The caller's count within the limit is honoured; past it, the
        // call is refused with the count that would do.
        let p = problem(1, 8, 1, 131072, Some(64));
        assert_eq!(splits(&p, LAVAPIPE_22), 64);
        let p = problem(1, 8, 1, 131072, Some(1));
        let e = gpu_splits(&p, DecodeKernel::Workgroup(tiles), LAVAPIPE_22).unwrap_err();
        let Error::TooLarge(message) = e else {
            panic!("{e:?}")
        };
        let least = (1..).find(|&s| {
            decode_iterations(&tiles, split_keys(0..131072, s, 0).len() as u64) <= limit
        });
        let least = least.unwrap();
        assert!(
            message.contains(&format!("num_splits={least} or more")),
            "{message}"
        );
        assert!(message.contains("llvmpipe"), "{message}");
        assert_eq!(
            gpu_splits(&p, DecodeKernel::Workgroup(tiles), LAVAPIPE).unwrap(),
            1
        );
    }

    /// The count grows with the split's tiles and never undercounts a
    /// tile: one more tile of keys costs at least the passes of its loops.
    #[test]
    fn decode_loop_passes_grow_by_tile() {
        for caps in [LAVAPIPE_22, WEBGPU] {
            for (d, rows) in [(128, 4), (7, 3), (512, 8), (16, 1)] {
                let t = decode_tiles(d, d, rows, caps).unwrap();
                let bk = t.tile_keys() as u64;
                let at = |k| decode_iterations(&t, k);
                assert_eq!(at(1), at(bk), "{t:?}");
                let step = at(2 * bk) - at(bk);
                assert!(step > 2 * bk, "{t:?}: {step}");
                assert_eq!(at(3 * bk) - at(2 * bk), step);
            }
        }
    }

    fn subgroup(d: usize, dv: usize, rows: usize, caps: DecodeCaps) -> Option<SubgroupTiles> {
        subgroup_tiles(d, dv, rows, false, caps, SubgroupKnobs::default())
    }

    /// Subgroups of 64 lanes (AMD's wave64) on a large adapter.
    const WAVE64: DecodeCaps = DecodeCaps {
        kind: AdapterKind::Discrete,
        workgroup_storage_bytes: 64 * 1024,
        max_invocations: 1024,
        loop_limit: None,
        subgroup_size: Some(64),
    };

    #[test]
    fn the_subgroup_kernel_runs_where_subgroups_have_a_known_size() {
        // Llama-style GQA decode at d = 128 on an H100: walkers of one
        // warp, a quad per lane, 4 keys per pass, four walkers; the 16
        // pairs (row, key) of a pass one per lane after the reduce-scatter
        // (the upper 16 lanes hold copies); no prefetch (the next pass's
        // loads would take 32 words of floats a lane).
        let t = subgroup(128, 128, 4, H100).unwrap();
        assert_eq!(
            (t.workgroup, t.lanes, t.quads, t.keys, t.rows),
            (128, 32, 1, 4, 4)
        );
        assert_eq!((t.walkers(), t.step_keys()), (4, 16));
        assert_eq!((t.scatter_bits(), t.pairs_per_lane()), (4, 1));
        assert_eq!((t.vec4, t.pass_load_words(), t.prefetch), (true, 32, false));
        // Every lane's quad lies within d and d_v: no load tests its quad.
        assert_eq!((t.whole_k, t.whole_v), (true, true));
        // float16: the same walkers, quads of halves, 8 keys a pass (32
        // words a lane), the next pass's loads in flight during this one.
        let half = subgroup_tiles(128, 128, 4, true, H100, SubgroupKnobs::default()).unwrap();
        assert_eq!(
            half,
            SubgroupTiles {
                f16: true,
                keys: 8,
                prefetch: true,
                ..t
            }
        );
        assert_eq!(half.pass_load_words(), 32);
        // Two quads a lane: 8 keys are 64 words, as many as a pass of
        // halves takes; four quads: 4 keys. float32 stays at 4 keys
        // without the prefetch.
        let wide = |d: usize, f16: bool| {
            let t = subgroup_tiles(d, d, 4, f16, H100, SubgroupKnobs::default()).unwrap();
            (t.quads, t.keys, t.pass_load_words(), t.prefetch)
        };
        assert_eq!(wide(256, true), (2, 8, HALVES_PASS_WORDS, true));
        assert_eq!(wide(512, true), (4, 4, HALVES_PASS_WORDS, true));
        assert_eq!(wide(256, false), (2, 4, 64, false));
        // Rows of a multiple of 4 elements, read element by element
        // otherwise: widened as they load, four words a quad.
        let odd = subgroup_tiles(66, 66, 4, true, H100, SubgroupKnobs::default()).unwrap();
        assert_eq!(
            (odd.vec4, odd.pass_load_words(), odd.prefetch),
            (false, 32, false)
        );
        assert_eq!((odd.whole_k, odd.whole_v), (false, false));
        // Rows shorter than the lanes' quads: the loads past d (96 of the
        // 128 elements 32 lanes hold) or d_v (64) test their quad.
        let short = subgroup_tiles(96, 128, 4, true, H100, SubgroupKnobs::default()).unwrap();
        assert_eq!(
            (short.lanes, short.whole_k, short.whole_v),
            (32, false, true)
        );
        let narrow_v = subgroup_tiles(128, 64, 4, true, H100, SubgroupKnobs::default()).unwrap();
        assert_eq!((narrow_v.whole_k, narrow_v.whole_v), (true, false));
        // Prefetching, or not, where forced.
        let on = SubgroupKnobs {
            prefetch: Some(true),
            ..SubgroupKnobs::default()
        };
        assert!(
            subgroup_tiles(128, 128, 4, false, H100, on)
                .unwrap()
                .prefetch
        );
        let off = SubgroupKnobs {
            prefetch: Some(false),
            ..SubgroupKnobs::default()
        };
        assert!(
            !subgroup_tiles(128, 128, 4, true, H100, off)
                .unwrap()
                .prefetch
        );
        assert!(!subgroup(512, 512, 1, H100).unwrap().prefetch);
        // lavapipe's 8-lane subgroups: four quads per lane, 4 keys per
        // pass, and the workgroup halved until the walkers' states fit.
        let t = subgroup(128, 128, 4, LAVAPIPE).unwrap();
        assert_eq!(
            (t.workgroup, t.lanes, t.quads, t.keys, t.rows),
            (64, 8, 4, 4, 4)
        );
        assert_eq!((t.scatter_bits(), t.pairs_per_lane()), (3, 2));
        assert_eq!(subgroup(128, 128, 8, LAVAPIPE).unwrap().workgroup, 32);
        // Narrow heads: walkers narrower than a subgroup, of 4 lanes at
        // least, and of a lane per row at least.
        assert_eq!(subgroup(16, 16, 1, H100).unwrap().lanes, 4);
        assert_eq!(subgroup(3, 1, 1, LAVAPIPE).unwrap().lanes, 4);
        let t = subgroup(16, 16, 8, H100).unwrap();
        assert_eq!((t.lanes, t.rows, t.pairs_per_lane()), (8, 8, 4));
        // The widest rows: four quads per lane of a 32-lane walker, none in
        // 8 lanes (sixteen would be needed).
        assert_eq!(subgroup(512, 512, 1, H100).unwrap().quads, 4);
        assert_eq!(subgroup(512, 64, 4, LAVAPIPE), None);
        // Walkers stop at 32 lanes on wider subgroups; the workgroup is
        // whole subgroups.
        let t = subgroup(256, 256, 4, WAVE64).unwrap();
        assert_eq!((t.lanes, t.quads, t.workgroup % 64), (32, 2, 0));
        // No subgroups, no known size, or subgroups of fewer than 4 lanes:
        // the workgroup kernel.
        assert_eq!(subgroup(128, 128, 4, WEBGPU), None);
        let two = DecodeCaps {
            subgroup_size: Some(2),
            ..LAVAPIPE
        };
        assert_eq!(subgroup(8, 8, 1, two), None);
        let kernel = decode_kernel(128, 128, 4, false, WEBGPU, SubgroupKnobs::default()).unwrap();
        assert_eq!(
            kernel,
            DecodeKernel::Workgroup(decode_tiles(128, 128, 4, WEBGPU).unwrap())
        );
        let kernel = decode_kernel(512, 64, 4, false, LAVAPIPE, SubgroupKnobs::default()).unwrap();
        assert!(matches!(kernel, DecodeKernel::Workgroup(_)), "{kernel:?}");
        let kernel = decode_kernel(128, 128, 4, false, H100, SubgroupKnobs::default()).unwrap();
        assert!(matches!(kernel, DecodeKernel::Subgroup(_)), "{kernel:?}");
        assert_eq!(kernel.row_blocks(4), 1);
        assert_eq!(kernel.rows(), 4);
    }

    /// The subgroup kernel aims at half the workgroups: the split counts
    /// measured best on the H100.
    #[test]
    fn the_subgroup_kernel_splits_half_as_much() {
        let kernel = decode_kernel(128, 128, 4, true, H100, SubgroupKnobs::default()).unwrap();
        let at = |b, n| gpu_splits(&problem(b, 8, 1, n, None), kernel, H100).unwrap();
        assert_eq!((at(1, 131072), at(8, 32768), at(32, 4096)), (64, 8, 2));
        assert_eq!(at(1, 100), 1);
        // The workgroup kernel keeps its counts.
        assert_eq!(splits(&problem(1, 8, 1, 131072, None), H100), 128);
    }

    #[test]
    fn the_subgroup_kernel_takes_its_knobs() {
        let knobs = |workgroup, keys, lanes| SubgroupKnobs {
            workgroup,
            keys,
            lanes,
            ..SubgroupKnobs::default()
        };
        let with = |k| subgroup_tiles(128, 128, 4, true, H100, k);
        let t = with(knobs(Some(256), Some(8), None)).unwrap();
        assert_eq!((t.workgroup, t.keys), (256, 8));
        let t = with(knobs(Some(32), None, None)).unwrap();
        assert_eq!((t.workgroup, t.walkers()), (32, 1));
        // Narrower walkers hold more of a row per lane.
        let t = with(knobs(None, None, Some(16))).unwrap();
        assert_eq!((t.lanes, t.quads, t.walkers()), (16, 2, 8));
        let t = with(knobs(None, None, Some(8))).unwrap();
        assert_eq!((t.lanes, t.quads, t.walkers()), (8, 4, 16));
        assert_eq!(with(knobs(None, None, Some(4))), None);
        // A workgroup smaller than a subgroup, or a key count the kernel
        // has no registers for: the workgroup kernel.
        assert_eq!(with(knobs(Some(16), None, None)), None);
        assert_eq!(with(knobs(None, Some(5), None)), None);
        let kernel = decode_kernel(128, 128, 4, true, H100, knobs(None, Some(2), None)).unwrap();
        assert!(matches!(kernel, DecodeKernel::Workgroup(_)), "{kernel:?}");
    }

    #[test]
    fn subgroup_tiles_fit_every_adapter_they_are_given_on() {
        for caps in [H100, LAVAPIPE, WAVE64, WEBGPU] {
            for d in [1, 3, 4, 16, 62, 64, 80, 96, 128, 192, 256, 300, 512] {
                for dv in [d, 8] {
                    for group_rows in [1, 2, 3, 4, 8, 32, 200] {
                        let Some(t) = subgroup(d, dv, group_rows, caps) else {
                            continue;
                        };
                        let sg = caps.subgroup_size.unwrap();
                        assert!(
                            t.workgroup_bytes() + SPARE_BYTES
                                <= caps.workgroup_storage_bytes as u64
                        );
                        assert!(t.workgroup <= caps.max_invocations && t.workgroup % sg == 0);
                        assert!(t.lanes.is_power_of_two() && t.lanes <= sg.min(32));
                        assert!(t.lanes >= 4 && t.lanes >= t.rows, "{t:?}");
                        assert!(4 * (t.lanes * t.quads) as usize >= d.max(dv), "{t:?}");
                        assert!(t.quads <= SUBGROUP_MAX_QUADS && t.walkers() >= 1);
                        assert!(t.rows.is_power_of_two() && t.rows <= 8);
                        assert_eq!(t.vec4, d % 4 == 0 && dv % 4 == 0);
                        // Every lane's pairs lie in one row.
                        assert!(t.pairs_per_lane() <= t.keys, "{t:?}");
                        assert_eq!(t.pairs_per_lane() << t.scatter_bits(), t.pairs());
                        let w = t.workgroup / t.lanes;
                        assert_eq!(t.part_vec4s(), w * t.rows * t.lanes * t.quads);
                    }
                }
            }
        }
    }

    /// The subgroup kernel's loop passes are one per workgroup pass over
    /// the keys (and the element loads' loops), so lavapipe 22 decodes a
    /// long sequence in one split where the workgroup kernel needs many.
    #[test]
    fn the_subgroup_kernel_needs_fewer_splits_under_a_loop_limit() {
        let p = problem(1, 1, 1, 131072, None);
        let sub = decode_kernel(128, 128, 4, false, LAVAPIPE_22, SubgroupKnobs::default()).unwrap();
        let DecodeKernel::Subgroup(t) = sub else {
            panic!("{sub:?}")
        };
        assert_eq!(gpu_splits(&p, sub, LAVAPIPE_22).unwrap(), 4);
        let one = problem(1, 1, 1, 131072, Some(1));
        assert_eq!(gpu_splits(&one, sub, LAVAPIPE_22).unwrap(), 1);
        let passes = sub.loop_passes(131072);
        assert!(
            passes >= 131072 / t.step_keys() as u64 && passes < 5000,
            "{passes}"
        );
        let old = DecodeKernel::Workgroup(decode_tiles(128, 128, 4, LAVAPIPE_22).unwrap());
        assert!(gpu_splits(&one, old, LAVAPIPE_22).is_err());
        // Read element by element, each pass counts its loads' loops.
        let t = subgroup(7, 7, 1, LAVAPIPE).unwrap();
        let k = DecodeKernel::Subgroup(t);
        let step = t.step_keys() as u64;
        let per_pass = k.loop_passes(2 * step) - k.loop_passes(step);
        assert_eq!(per_pass, 1 + 2 * t.keys as u64 * t.quads as u64 * 5);
        assert_eq!(k.loop_passes(1), k.loop_passes(step));
    }
}
