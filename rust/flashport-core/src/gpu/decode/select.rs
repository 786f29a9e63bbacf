//! What the decode kernel runs with: its layout and tiles fitted to the
//! adapter's workgroup memory, and the number of key splits, each a pure
//! function of the problem's shape and what the adapter is, tested below
//! on a table of adapters without a GPU. Nothing here reads the
//! environment or measures anything.

use crate::decode::split_keys;
use crate::gpu::tiles::{decode_iterations, subgroup_decode_iterations};
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
    /// The lanes of every subgroup, where the device has subgroup
    /// operations and subgroups of one size only (wgpu's minimum and
    /// maximum subgroup sizes agree): the subgroup kernel's walkers must
    /// each lie within one subgroup.
    pub subgroup_size: Option<u32>,
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

/// The layout of decoding's subgroup kernel (overrides of
/// shaders/decode/subgroup.wgsl): walkers of `lanes` lanes within one
/// subgroup, each streaming its own keys with its own online softmax, the
/// dot products of a pass summed and spread over a walker's lanes by a
/// reduce-scatter of subgroup shuffles; each lane holds quads (four
/// elements) of d and of d_v.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SubgroupTiles {
    /// Invocations per workgroup: whole subgroups.
    pub workgroup: u32,
    /// Lanes of a walker, which read one cache row together: a power of
    /// two from 4 to [`SUBGROUP_MAX_LANES`], at least `rows` and at most
    /// the subgroup.
    pub lanes: u32,
    /// Quads of d and of d_v per lane, 1 to [`SUBGROUP_MAX_QUADS`].
    pub quads: u32,
    /// Keys a walker loads per pass, 4 or 8.
    pub keys: u32,
    /// Query rows per workgroup (of the group's heads × seq_q).
    pub rows: u32,
    /// The caches are read four elements at a time (d and d_v multiples
    /// of 4), else element by element.
    pub vec4: bool,
    /// The caches are float16 (a quad of halves is two words as loaded).
    pub f16: bool,
    /// Each pass issues the next pass's loads before its own arithmetic
    /// (registers for one more pass of loads, for bytes in flight).
    pub prefetch: bool,
}

/// The widest walker the kernel's butterfly spans (offsets up to 16).
pub const SUBGROUP_MAX_LANES: u32 = 32;
/// The most quads a lane holds of each row (named registers).
pub const SUBGROUP_MAX_QUADS: u32 = 4;

impl SubgroupTiles {
    pub fn walkers(&self) -> u32 {
        self.workgroup / self.lanes
    }
    /// Keys a workgroup takes per pass.
    pub fn step_keys(&self) -> u32 {
        self.walkers() * self.keys
    }
    /// The (row, key) pairs of a walker's pass.
    pub fn pairs(&self) -> u32 {
        self.rows * self.keys
    }
    /// The reduce-scatter's steps: log2 of the lanes the pairs spread
    /// over.
    pub fn scatter_bits(&self) -> u32 {
        self.pairs().min(self.lanes).ilog2()
    }
    /// Pairs each lane holds after the reduce-scatter.
    pub fn pairs_per_lane(&self) -> u32 {
        self.pairs() >> self.scatter_bits()
    }
    /// Registers (32-bit words) per lane of one pass's loads of keys and
    /// values: a quad of halves read four at a time is two words as
    /// loaded, any other quad four floats.
    pub fn pass_load_words(&self) -> u32 {
        let per_quad = if self.vec4 && self.f16 { 2 } else { 4 };
        2 * self.keys * self.quads * per_quad
    }
    /// vec4 columns of a row in the kernel's registers.
    pub fn row_vec4s(&self) -> u32 {
        self.lanes * self.quads
    }
    /// vec4s of the kernel's `part` array: the walkers' accumulators.
    pub fn part_vec4s(&self) -> u32 {
        self.walkers() * self.rows * self.row_vec4s()
    }
    /// Elements of the kernel's `stat` array: the walkers' row_max and
    /// row_sum, the merged row_sum, and the walkers' non-finite codes.
    pub fn stat_elems(&self) -> u32 {
        (3 * self.walkers() + 1) * self.rows
    }
    /// The workgroup memory the kernel declares (`part`, `stat`).
    pub fn workgroup_bytes(&self) -> u64 {
        16 * self.part_vec4s() as u64 + 4 * self.stat_elems() as u64
    }
    /// The overrides of shaders/decode/subgroup.wgsl for this layout, a
    /// paged cache or not, and the variants.
    pub fn overrides(&self, paged: bool, softcap: bool, alibi: bool) -> Vec<(&'static str, f64)> {
        let flag = |x: bool| if x { 1.0 } else { 0.0 };
        vec![
            ("WG", self.workgroup as f64),
            ("LPK", self.lanes as f64),
            ("NO", self.quads as f64),
            ("KPI", self.keys as f64),
            ("RB", self.rows as f64),
            ("SB", self.scatter_bits() as f64),
            ("EPL", self.pairs_per_lane() as f64),
            ("PART_VEC4S", self.part_vec4s() as f64),
            ("STAT_ELEMS", self.stat_elems() as f64),
            ("PAGED", flag(paged)),
            ("SOFTCAP", flag(softcap)),
            ("ALIBI", flag(alibi)),
            ("PREFETCH", flag(self.prefetch)),
        ]
    }
}

/// The most registers per lane the next pass's loads may take for the
/// subgroup kernel to prefetch them. Measured on an H200 (32 query / 8 KV
/// heads, d = 128, paged block 16, decode kernel timestamps): float16
/// quads (16 words) prefetched took 0.343 ms against 0.384 at 1 x 131072,
/// 0.665 against 0.750 at 8 x 32768; float32 quads (32 words) 0.623
/// against 0.401 and 1.217 against 0.783 (148 registers a lane against
/// fewer: half the workgroups an SM holds).
pub const PREFETCH_WORDS: u32 = 16;

/// Choices the subgroup kernel's layout otherwise makes itself (the test
/// and benchmark overrides `decode_workgroup`, `decode_keys`,
/// `decode_lanes`, `decode_prefetch`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SubgroupKnobs {
    /// Invocations per workgroup.
    pub workgroup: Option<u32>,
    /// Keys per walker and pass.
    pub keys: Option<u32>,
    /// The most lanes per walker.
    pub lanes: Option<u32>,
    /// Prefetch the next pass's loads, or not.
    pub prefetch: Option<bool>,
}

/// Keys a walker loads per pass by default.
pub const SUBGROUP_KEYS: u32 = 4;

/// The subgroup kernel's layout for head dimensions `d`, `d_v` and
/// `group_rows` query rows per (sequence, key/value head), float16 caches
/// or not, on an adapter whose subgroups have a known size: best first,
/// the most rows per workgroup (as [`decode_tiles`]); walkers of as many
/// lanes as the wider head dimension has quads (a power of two, at least
/// the rows and 4, at most the subgroup, [`SUBGROUP_MAX_LANES`] and
/// `knobs.lanes`), each lane holding the rest of a row in up to
/// [`SUBGROUP_MAX_QUADS`] quads; [`SUBGROUP_KEYS`] keys per pass, the next
/// pass's loads prefetched where they take at most [`PREFETCH_WORDS`]
/// registers; the
/// largest workgroup of whole subgroups up to 128 invocations whose
/// walkers' states fit the workgroup memory. `None` without subgroups of
/// a known size (of 4 lanes or more), past the widest row the named
/// registers hold, or when nothing fits (with the knobs given): the host
/// runs [`decode_tiles`]'s kernel then.
pub fn subgroup_tiles(
    d: usize,
    dv: usize,
    group_rows: usize,
    f16: bool,
    caps: DecodeCaps,
    knobs: SubgroupKnobs,
) -> Option<SubgroupTiles> {
    let subgroup = caps
        .subgroup_size
        .filter(|s| s.is_power_of_two() && *s >= 4)?;
    let vec4 = d % 4 == 0 && dv % 4 == 0;
    let quads_of_row = d.max(dv).max(1).div_ceil(4);
    let widest = subgroup
        .min(SUBGROUP_MAX_LANES)
        .min(knobs.lanes.map_or(u32::MAX, |l| 1 << l.max(1).ilog2()));
    let keys = knobs.keys.unwrap_or(SUBGROUP_KEYS);
    if keys != 4 && keys != 8 {
        return None;
    }
    let most_rows = group_rows.clamp(1, 8).next_power_of_two() as u32;
    let (workgroup, largest) = (knobs.workgroup, knobs.workgroup.unwrap_or(128));
    for rows in [8u32, 4, 2, 1].into_iter().filter(|&r| r <= most_rows) {
        let least = rows.max(4);
        if widest < least {
            continue;
        }
        let lanes = (quads_of_row.next_power_of_two() as u32).clamp(least, widest);
        let quads = quads_of_row.div_ceil(lanes as usize) as u32;
        if quads > SUBGROUP_MAX_QUADS {
            continue;
        }
        let mut wg = largest;
        while wg >= lanes.max(subgroup) {
            let mut t = SubgroupTiles {
                workgroup: wg,
                lanes,
                quads,
                keys,
                rows,
                vec4,
                f16,
                prefetch: false,
            };
            t.prefetch = knobs
                .prefetch
                .unwrap_or(t.pass_load_words() <= PREFETCH_WORDS);
            if wg % subgroup == 0
                && wg <= caps.max_invocations
                && t.workgroup_bytes() + SPARE_BYTES <= caps.workgroup_storage_bytes as u64
            {
                return Some(t);
            }
            if workgroup.is_some() {
                break;
            }
            wg /= 2;
        }
    }
    None
}

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
    pub fn overrides(&self, paged: bool, softcap: bool, alibi: bool) -> Vec<(&'static str, f64)> {
        match self {
            DecodeKernel::Workgroup(t) => t.overrides(paged, softcap, alibi),
            DecodeKernel::Subgroup(t) => t.overrides(paged, softcap, alibi),
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
    use crate::problem::{validate_kvcache, IntArray, KvCacheOptions};
    use crate::ArrayInfo;

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
        // float16: the same layout, quads of halves (16 words a lane), the
        // next pass's loads in flight during this one.
        let half = subgroup_tiles(128, 128, 4, true, H100, SubgroupKnobs::default()).unwrap();
        assert_eq!(
            half,
            SubgroupTiles {
                f16: true,
                prefetch: true,
                ..t
            }
        );
        assert_eq!(half.pass_load_words(), 16);
        // Rows of a multiple of 4 elements, read element by element
        // otherwise: widened as they load, four words a quad.
        let odd = subgroup_tiles(66, 66, 4, true, H100, SubgroupKnobs::default()).unwrap();
        assert_eq!(
            (odd.vec4, odd.pass_load_words(), odd.prefetch),
            (false, 32, false)
        );
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
