//! What the decode kernel runs with: its layout and tiles fitted to the
//! adapter's workgroup memory, and the number of key splits, each a pure
//! function of the problem's shape and what the adapter is, tested below
//! on a table of adapters without a GPU. Nothing here reads the
//! environment or measures anything.

use crate::decode::split_keys;
use crate::gpu::tiles::decode_iterations;
use crate::problem::MAX_SPLITS;
use crate::{Error, KvCacheProblem, Result};

/// What the choice depends on from the adapter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeCaps {
    pub kind: AdapterKind,
    pub workgroup_storage_bytes: u32,
    pub max_invocations: u32,
    /// The loop passes the driver lets one subgroup run
    /// (`AdapterCaps::loop_limit`: Mesa's llvmpipe before 25.0).
    pub loop_limit: Option<u32>,
}

/// The adapter's kind, as wgpu reports it: how many workgroups it needs in
/// flight (wgpu does not say how many compute units an adapter has).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdapterKind {
    Discrete,
    Integrated,
    /// A software rasteriser (lavapipe): a few CPU threads.
    Software,
    Other,
}

impl AdapterKind {
    /// From `AdapterInfo::device_type` ("discrete", "integrated",
    /// "software", "virtual", "other").
    pub fn from_name(name: &str) -> AdapterKind {
        match name {
            "discrete" => AdapterKind::Discrete,
            "integrated" => AdapterKind::Integrated,
            "software" => AdapterKind::Software,
            _ => AdapterKind::Other,
        }
    }

    /// Workgroups a call should spread over: a discrete GPU has ~100
    /// compute units each holding several workgroups (an H100: 132 SMs),
    /// an integrated one fewer.
    pub fn target_workgroups(self) -> usize {
        match self {
            AdapterKind::Discrete => 1024,
            AdapterKind::Integrated | AdapterKind::Other => 256,
            AdapterKind::Software => 8,
        }
    }
}

/// The decode kernel's layout (overrides of shaders/decode/decode.wgsl).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DecodeTiles {
    /// Invocations per workgroup.
    pub workgroup: u32,
    /// Lanes per key row, each owning 4 elements of d and of d_v.
    pub lanes: u32,
    /// Keys per lane per tile.
    pub keys_per_lane: u32,
    /// Query rows per workgroup (of the group's heads × seq_q).
    pub rows: u32,
    /// The caches are read four elements at a time (d and d_v multiples
    /// of 4), else element by element.
    pub vec4: bool,
}

/// The widest head dimension the kernel takes: one lane per 4 elements, at
/// most 128 lanes per key row.
pub const MAX_HEAD_DIM: usize = 512;

impl DecodeTiles {
    pub fn key_groups(&self) -> u32 {
        self.workgroup / self.lanes
    }
    /// Keys per tile.
    pub fn tile_keys(&self) -> u32 {
        self.key_groups() * self.keys_per_lane
    }
    /// Elements of the kernel's `part` array: the partial dot products of
    /// a tile, or the key groups' accumulators at the end.
    pub fn part_elems(&self) -> u32 {
        let partials = self.rows * self.tile_keys() * (self.lanes + 1);
        let accumulators = self.rows * self.key_groups() * self.lanes * 4;
        partials.max(accumulators)
    }
    /// Elements of the kernel's `scores` array.
    pub fn score_elems(&self) -> u32 {
        self.rows * self.tile_keys()
    }
    /// The workgroup memory the kernel declares (`part`, `scores`, `stat`,
    /// and the flags of the tile's non-finite values, `vbad`).
    pub fn workgroup_bytes(&self) -> u64 {
        4 * (self.part_elems() + self.score_elems() + 24 + self.tile_keys() + 1) as u64
    }
    /// The overrides of shaders/decode/decode.wgsl for this layout, a
    /// paged cache or not, and the variants the kernel computes (the
    /// window is a uniform; sinks join in the combine pass).
    pub fn overrides(&self, paged: bool, softcap: bool, alibi: bool) -> Vec<(&'static str, f64)> {
        let flag = |x: bool| if x { 1.0 } else { 0.0 };
        vec![
            ("WG", self.workgroup as f64),
            ("LANES", self.lanes as f64),
            ("KPL", self.keys_per_lane as f64),
            ("RB", self.rows as f64),
            ("PART_ELEMS", self.part_elems() as f64),
            ("SCORE_ELEMS", self.score_elems() as f64),
            ("PAGED", flag(paged)),
            ("SOFTCAP", flag(softcap)),
            ("ALIBI", flag(alibi)),
        ]
    }

    /// Row blocks per (sequence, key/value head).
    pub fn row_blocks(&self, group_rows: usize) -> usize {
        group_rows.div_ceil(self.rows as usize).max(1)
    }
}

/// Bytes of workgroup memory left for whatever the compiler adds.
const SPARE_BYTES: u64 = 256;

/// The layout for head dimensions `d`, `d_v` and `group_rows` query rows
/// per (sequence, key/value head): lanes enough for the wider head
/// dimension; then, best first, the most rows per workgroup (the next
/// power of two up to 8: all of a decoding GQA group's rows in one
/// workgroup, so each key is read once per group), the larger workgroup
/// (128 invocations, else 64) and the most keys per lane (4, 2, 1) whose
/// workgroup memory fits. `None` past [`MAX_HEAD_DIM`] or when nothing
/// fits.
pub fn decode_tiles(
    d: usize,
    dv: usize,
    group_rows: usize,
    caps: DecodeCaps,
) -> Option<DecodeTiles> {
    let widest = d.max(dv).max(1);
    if widest > MAX_HEAD_DIM {
        return None;
    }
    let lanes = widest.div_ceil(4).next_power_of_two() as u32;
    let most_rows = group_rows.clamp(1, 8).next_power_of_two() as u32;
    let vec4 = d % 4 == 0 && dv % 4 == 0;
    let rows = [8u32, 4, 2, 1].into_iter().filter(|&r| r <= most_rows);
    for rows in rows {
        for workgroup in [128u32, 64] {
            if workgroup < lanes || workgroup > caps.max_invocations {
                continue;
            }
            for keys_per_lane in [4, 2, 1] {
                let t = DecodeTiles {
                    workgroup,
                    lanes,
                    keys_per_lane,
                    rows,
                    vec4,
                };
                if t.workgroup_bytes() + SPARE_BYTES <= caps.workgroup_storage_bytes as u64 {
                    return Some(t);
                }
            }
        }
    }
    None
}

/// The most splits the default gives a sequence, and the fewest keys it
/// gives a split: past those, the partial states to merge cost more than
/// the parallelism brings.
pub const GPU_MAX_SPLITS: usize = 128;
pub const GPU_MIN_SPLIT_KEYS: usize = 128;

/// The GPU's key splits per sequence: the caller's, else enough for the
/// adapter kind's target workgroups over (sequence, key/value head, row
/// block), with no split under [`GPU_MIN_SPLIT_KEYS`] keys of the longest
/// sequence and at most [`GPU_MAX_SPLITS`]; then, where the driver limits
/// a subgroup's loop passes, the fewest splits from there whose longest
/// split stays within the limit. The caller's count past the limit, or a
/// sequence that no count keeps within it, is `Error::TooLarge`: the
/// driver would cut the kernel's loops short without a word.
pub fn gpu_splits(p: &KvCacheProblem, tiles: DecodeTiles, caps: DecodeCaps) -> Result<usize> {
    let longest = (0..p.batch())
        .map(|b| p.keys_read(b).len())
        .max()
        .unwrap_or(0);
    let fits = |splits: usize| {
        caps.loop_limit
            .is_none_or(|limit| loop_passes(tiles, longest, splits) <= limit as u64)
    };
    let chosen = match p.num_splits {
        Some(n) => n,
        None => {
            let workgroups = (p.batch() * p.heads_kv() * tiles.row_blocks(p.group_rows())).max(1);
            let by_target = caps.kind.target_workgroups().div_ceil(workgroups);
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
    let passes = loop_passes(tiles, longest, chosen);
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
fn loop_passes(tiles: DecodeTiles, longest: usize, splits: usize) -> u64 {
    let keys = split_keys(0..longest, splits, 0).len();
    decode_iterations(&tiles, keys as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::select::LLVMPIPE_LOOP_LIMIT;
    use crate::problem::{validate_kvcache, IntArray, KvCacheOptions};
    use crate::ArrayInfo;

    const H100: DecodeCaps = DecodeCaps {
        kind: AdapterKind::Discrete,
        workgroup_storage_bytes: 48 * 1024,
        max_invocations: 1024,
        loop_limit: None,
    };
    /// Mesa 25 or newer: no loop limit.
    const LAVAPIPE: DecodeCaps = DecodeCaps {
        kind: AdapterKind::Software,
        workgroup_storage_bytes: 32 * 1024,
        max_invocations: 1024,
        loop_limit: None,
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
        gpu_splits(p, tiles, caps).unwrap()
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
        let e = gpu_splits(&p, tiles, LAVAPIPE_22).unwrap_err();
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
        assert_eq!(gpu_splits(&p, tiles, LAVAPIPE).unwrap(), 1);
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
}
