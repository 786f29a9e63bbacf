//! Decoding's kernel layouts (shaders/decode/decode.wgsl's and
//! subgroup.wgsl's tiles) fitted to the adapter's workgroup memory and
//! subgroups, beside the other tiers' tiles: pure functions of the shape
//! and of what the adapter is (`DecodeCaps`), tested in
//! `gpu::decode::select` on a table of adapters without a GPU.

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
    /// The overrides of shaders/decode/decode.wgsl for this layout and a
    /// paged cache or not (the variants' are
    /// `shaders::score_variant_overrides`).
    pub fn overrides(&self, paged: bool) -> Vec<(&'static str, f64)> {
        let flag = |x: bool| if x { 1.0 } else { 0.0 };
        vec![
            ("WG", self.workgroup as f64),
            ("LANES", self.lanes as f64),
            ("KPL", self.keys_per_lane as f64),
            ("RB", self.rows as f64),
            ("PART_ELEMS", self.part_elems() as f64),
            ("SCORE_ELEMS", self.score_elems() as f64),
            ("PAGED", flag(paged)),
        ]
    }

    /// Row blocks per (sequence, key/value head).
    pub fn row_blocks(&self, group_rows: usize) -> usize {
        group_rows.div_ceil(self.rows as usize).max(1)
    }
}

/// Bytes of workgroup memory left for whatever the compiler adds.
pub(crate) const SPARE_BYTES: u64 = 256;

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
    /// Every quad the lanes hold of a key row lies within d (d = 4 ×
    /// lanes × quads, read four at a time), so its loads need no test of
    /// their quad; likewise d_v for a value row.
    pub whole_k: bool,
    pub whole_v: bool,
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
    /// The overrides of shaders/decode/subgroup.wgsl for this layout and a
    /// paged cache or not (the variants' are
    /// `shaders::score_variant_overrides`).
    pub fn overrides(&self, paged: bool) -> Vec<(&'static str, f64)> {
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
            ("PREFETCH", flag(self.prefetch)),
            ("WHOLE_K", flag(self.whole_k)),
            ("WHOLE_V", flag(self.whole_v)),
        ]
    }
}

/// The most registers per lane one pass's loads of keys and values may
/// take where the subgroup kernel keeps float16 quads as halves (two words
/// a quad): such a walker takes 8 keys a pass and prefetches the next
/// pass's loads while they fit, 4 keys otherwise. Every other layout
/// (float32, rows read element by element) takes 4 keys and no prefetch.
/// Measured on an H200 with the whole-pass fetch (session 25, decode
/// kernel timestamps; BENCHMARKS.md, "The subgroup decode kernel,
/// reduce-scatter", and docs/gpu.md): for float16 the fastest of four
/// layouts or close to it across head counts and head dimensions up to
/// 256 (64 words a pass); float32 lost with 8 keys a pass.
pub const HALVES_PASS_WORDS: u32 = 64;

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

/// The subgroup kernel's layout for head dimensions `d`, `d_v` and
/// `group_rows` query rows per (sequence, key/value head), float16 caches
/// or not, on an adapter whose subgroups have a known size: best first,
/// the most rows per workgroup (as [`decode_tiles`]); walkers of as many
/// lanes as the wider head dimension has quads (a power of two, at least
/// the rows and 4, at most the subgroup, [`SUBGROUP_MAX_LANES`] and
/// `knobs.lanes`), each lane holding the rest of a row in up to
/// [`SUBGROUP_MAX_QUADS`] quads; keys per pass and the prefetch as
/// [`HALVES_PASS_WORDS`] says; the largest workgroup of whole subgroups up to 128 invocations whose
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
    if knobs.keys.is_some_and(|k| k != 4 && k != 8) {
        return None;
    }
    // float16 quads kept as halves, as loaded (`pass_load_words`).
    let halves = vec4 && f16;
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
                keys: 8,
                rows,
                vec4,
                f16,
                prefetch: false,
                whole_k: vec4 && d == 4 * (lanes * quads) as usize,
                whole_v: vec4 && dv == 4 * (lanes * quads) as usize,
            };
            if !(halves && t.pass_load_words() <= HALVES_PASS_WORDS) {
                t.keys = 4;
            }
            t.keys = knobs.keys.unwrap_or(t.keys);
            t.prefetch = knobs
                .prefetch
                .unwrap_or(halves && t.pass_load_words() <= HALVES_PASS_WORDS);
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
