//! `attention_with_kvcache` on the GPU (see [`crate::decode`] for what is
//! computed): shaders/decode/decode.wgsl writes each key split's state,
//! (o, lse) in float32, one workgroup per (sequence, key/value head,
//! split, block of query rows); shaders/decode/combine.wgsl merges the
//! splits in order. The layout and the split count come from `select`.
//!
//! The caches are bound as windows of their buffers: a dispatch covers a
//! run of sequences and binds the blocks they use (the sequences' own
//! rows when contiguous), so a cache larger than one storage binding is
//! still decoded as long as one sequence's blocks fit one. Host caches
//! upload just those windows; device arrays are bound where they are.
//! Everything is checked on the host before any dispatch (lengths and
//! table entries by validation, windows here), and naga's bounds checks
//! stay on in the kernel, so no read leaves its binding.
//!
//! A KV cache's pools (`super::kv_pool`) are bound where they are, whole:
//! a pool larger than one binding is several buffers of whole blocks, and
//! then each dispatch runs once per buffer its sequences read, the table
//! entries of the other buffers' blocks marked as not bound (`SKIPS`):
//! each run's splits see only the keys of its buffer, and the combine
//! pass merges every run's splits as one set. Attention over a set of
//! keys is the merge of attention over its parts, so a sequence's blocks
//! may lie anywhere in the pool. A paged cache given as two arrays whose
//! blocks one sequence reads span more than a binding is decoded the same
//! way, its arrays bound as consecutive windows of whole blocks.

pub mod select;

use std::sync::Arc;
use std::time::Instant;

use bytemuck::{Pod, Zeroable};

use super::assemble::{check_device_outputs, empty_output, Sink};
use super::bfloat16::{narrow, Widened};
use super::chunks::binding_limit;
use super::context::Context;
use super::inputs::{chunk_input, float16_error, float64_error, source, Source};
use super::merge;
use super::pool::Pooled;
use super::run::with_inputs;
use super::shaders::{decode_source, decode_subgroup_source, DECODE_COMBINE};
use super::timing;
use super::transfer::Submission;
use crate::overrides::{self, Overrides};
use crate::problem::CacheLayout;
use crate::{
    Array, DType, DeviceArray, Error, ForwardOutput, Input, KvCacheProblem, Placement, Result,
    VariantArrays,
};
use select::{decode_kernel, gpu_splits, AdapterKind, DecodeCaps, DecodeKernel, SubgroupKnobs};

/// The kernel's `struct Decode`, word for word (`uniform_matches_the_shader`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Pod, Zeroable)]
pub(crate) struct Uniform {
    pub heads_q: u32,
    pub heads_kv: u32,
    pub group: u32,
    pub seq_q: u32,
    pub rows: u32,
    pub row_blocks: u32,
    pub d: u32,
    pub dv: u32,
    pub block_size: u32,
    pub max_blocks: u32,
    pub splits: u32,
    pub causal: u32,
    pub left: u32,
    pub right: u32,
    pub scale: f32,
    pub softcap: f32,
    pub seqlens_off: u32,
    pub table_off: u32,
    pub slopes_off: u32,
    pub split_base: u32,
    pub k_delta: u32,
    pub v_delta: u32,
    pub out_rows: u32,
    pub pad1: u32,
}

/// The combine pass's `struct Combine`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Pod, Zeroable)]
pub(crate) struct CombineUniform {
    pub rows: u32,
    pub dv: u32,
    pub splits: u32,
    pub heads_q: u32,
    pub seq_q: u32,
    pub sinks: u32,
    pub sinks_off: u32,
    pub pad0: u32,
}

/// A window side the kernel treats as unbounded.
const NONE: u32 = u32::MAX;

/// Positions are i32 in the kernel: lengths, seq_q and the block size stay
/// below this, and window sides are capped at it (past every position).
const POSITION_LIMIT: usize = 1 << 30;

/// The smallest cache binding: one vec4<f32>, the widest element the
/// kernel's cache arrays have.
const MIN_WINDOW: u64 = 16;

/// Where the caches are: two arrays (host or device), or a KV cache's
/// pools split over buffers of `per_buffer` blocks (more than one).
#[derive(Clone, Copy)]
enum Caches<'a> {
    Arrays(Source<'a>, Source<'a>),
    Pools {
        keys: &'a [DeviceArray],
        values: &'a [DeviceArray],
        per_buffer: usize,
    },
    /// Two paged arrays read as a pool of windows of `per_window` blocks,
    /// each bound alone.
    Windows(Source<'a>, Source<'a>, usize),
}

/// Decodes on the GPU over a KV cache's pools of one layer, `keys` and
/// `values` each a list of buffers of `per_buffer` whole blocks, bound
/// where they are (the problem's table counts blocks over the whole pool).
pub(crate) fn attention_with_kvcache_pools(
    problem: &KvCacheProblem,
    q: Input<'_>,
    (keys, values, per_buffer): (&[DeviceArray], &[DeviceArray], usize),
    variants: &VariantArrays<'_>,
    outputs: Placement,
) -> Result<ForwardOutput<Array>> {
    if problem.dtype() == DType::F64 {
        return Err(float64_error("q"));
    }
    crate::check_len("q", &q, problem.q_len(), problem.dtype())?;
    crate::decode::check_variants(problem, variants)?;
    check_positions(problem)?;
    let (Some(k0), Some(v0)) = (keys.first(), values.first()) else {
        return Err(Error::Shape("a KV cache without blocks".to_string()));
    };
    let q = source("q", q)?;
    let caches = if keys.len() == 1 && values.len() == 1 {
        Caches::Arrays(Source::Device(k0), Source::Device(v0))
    } else {
        Caches::Pools {
            keys,
            values,
            per_buffer,
        }
    };
    let named = [
        ("q", q),
        ("k_cache", Source::Device(k0)),
        ("v_cache", Source::Device(v0)),
    ];
    let overrides = overrides::current();
    with_inputs("decoding over a KV cache", &named, |ctx| {
        decode_on(ctx, problem, q, caches, variants, outputs, &overrides)
    })
}

/// Decodes on the GPU, leaving the outputs where `outputs` says.
pub fn attention_with_kvcache(
    problem: &KvCacheProblem,
    [q, k_cache, v_cache]: [Input<'_>; 3],
    variants: &VariantArrays<'_>,
    outputs: Placement,
) -> Result<ForwardOutput<Array>> {
    if problem.dtype() == DType::BF16 {
        let named = [("q", q), ("k_cache", k_cache), ("v_cache", v_cache)];
        let wide = Widened::new(&named, outputs)?;
        let mut wide_problem = problem.clone();
        wide_problem.attention.dtype = DType::F32;
        let inputs = wide.inputs([q, k_cache, v_cache]);
        let r = attention_with_kvcache(&wide_problem, inputs, variants, outputs)?;
        return Ok(ForwardOutput {
            out: narrow(r.out)?,
            lse: r.lse,
        });
    }
    if problem.dtype() == DType::F64 {
        return Err(float64_error("q"));
    }
    check_positions(problem)?;
    let sources = [
        source("q", q)?,
        source("k_cache", k_cache)?,
        source("v_cache", v_cache)?,
    ];
    let named = [
        ("q", sources[0]),
        ("k_cache", sources[1]),
        ("v_cache", sources[2]),
    ];
    let overrides = overrides::current();
    let [q, k, v] = sources;
    with_inputs("decoding over a KV cache", &named, |ctx| {
        decode_on(
            ctx,
            problem,
            q,
            Caches::Arrays(k, v),
            variants,
            outputs,
            &overrides,
        )
    })
}

fn check_positions(p: &KvCacheProblem) -> Result<()> {
    let longest = p.seqlens.iter().copied().max().unwrap_or(0);
    let widest = longest.max(p.seq_q()).max(p.block_size());
    if widest >= POSITION_LIMIT {
        return Err(Error::TooLarge(format!(
            "the GPU decodes sequences, query chunks and blocks of fewer than {POSITION_LIMIT} \
             keys (here {widest}); use device=\"cpu\""
        )));
    }
    Ok(())
}

/// What the adapter is, as the layout and the split count see it.
fn caps_of(ctx: &Context, overrides: &Overrides) -> DecodeCaps {
    let caps = overrides.apply(ctx.caps);
    DecodeCaps {
        kind: AdapterKind::from_name(&ctx.adapter.device_type),
        workgroup_storage_bytes: caps.workgroup_storage_bytes,
        max_invocations: caps.max_invocations,
        loop_limit: caps.loop_limit,
        subgroup_size: ctx.subgroup_size.filter(|_| caps.subgroups),
    }
}

/// The kernel that decodes `p` on `ctx`, and its split count.
pub(crate) fn choose(
    ctx: &Context,
    p: &KvCacheProblem,
    overrides: &Overrides,
) -> Result<(DecodeKernel, usize)> {
    let (d, dv) = (p.attention.head_dim, p.attention.value_dim);
    let caps = caps_of(ctx, overrides);
    let knobs = SubgroupKnobs {
        workgroup: overrides.decode_workgroup,
        keys: overrides.decode_keys,
        lanes: overrides.decode_lanes,
        prefetch: overrides.decode_prefetch,
    };
    let f16 = p.dtype() == DType::F16;
    let kernel = decode_kernel(d, dv, p.group_rows(), f16, caps, knobs).ok_or_else(|| {
        Error::BackendUnavailable(format!(
            "the GPU decodes head dimensions up to {} (here d={d}, d_v={dv}) with this \
             adapter's workgroup memory; use device=\"cpu\"",
            select::MAX_HEAD_DIM
        ))
    })?;
    let splits = gpu_splits(p, kernel, caps)?;
    Ok((kernel, splits))
}

/// A run of sequences decoded by one dispatch, and the cache blocks it
/// binds.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Dispatch {
    sequences: std::ops::Range<usize>,
    blocks: std::ops::Range<usize>,
}

/// The limits one dispatch must keep.
struct Limits {
    binding: u64,
    grid: u64,
    align: u64,
}

/// Whole blocks of a paged cache that one binding of a window holds (with
/// the slack `window` adds for the offset's alignment), or `None` when
/// not one does.
fn window_blocks(p: &KvCacheProblem, eb: u64, limits: &Limits) -> Option<usize> {
    let a = &p.attention;
    let row = a.head_dim.max(a.value_dim).max(1) as u64;
    let block_bytes = (p.heads_kv() * p.block_size()) as u64 * row * eb;
    let room = limits.binding.checked_sub(limits.align + 16)?;
    let blocks = room / block_bytes.max(1);
    (blocks > 0).then_some(blocks as usize)
}

/// The blocks sequence `b` reads: its own when contiguous, else the range
/// of the table entries its length reaches (empty for an empty sequence).
fn blocks_of(p: &KvCacheProblem, b: usize) -> Option<std::ops::Range<usize>> {
    match &p.layout {
        CacheLayout::Contiguous { .. } => Some(b..b + 1),
        CacheLayout::Paged {
            block_size,
            max_blocks,
            table,
            ..
        } => {
            let used = &table[b * max_blocks..][..p.seqlens[b].div_ceil(*block_size)];
            // One pass that vectorises (min() and max() over an iterator
            // took 0.4 ms for a table of 256k entries on the 2-core VM).
            let (lo, hi) = used
                .iter()
                .fold((usize::MAX, 0), |(lo, hi), &x| (lo.min(x), hi.max(x)));
            (!used.is_empty()).then_some(lo..hi + 1)
        }
    }
}

/// Bytes of a dispatch's bindings, the widest first: the cache windows
/// (with an alignment's slack), the partial states, q, the outputs.
fn dispatch_bytes(
    p: &KvCacheProblem,
    splits: usize,
    d: &Dispatch,
    eb: u64,
    align: u64,
) -> [u64; 5] {
    let a = &p.attention;
    let n = d.sequences.len() as u64;
    let block_rows = (d.blocks.len() * p.heads_kv() * p.block_size()) as u64;
    let out_rows = n * (a.heads_q * a.seq_q) as u64;
    [
        block_rows * (a.head_dim as u64) * eb + align + 16,
        block_rows * (a.value_dim as u64) * eb + align + 16,
        splits as u64 * out_rows * (a.value_dim.max(1) as u64) * 4,
        out_rows * a.head_dim as u64 * eb,
        4 * seq_data_words(p, n as usize) as u64,
    ]
}

/// Words of a dispatch's `seq_data`: lengths, table rows, slopes per
/// (sequence, query head), sinks.
fn seq_data_words(p: &KvCacheProblem, sequences: usize) -> usize {
    let table = match &p.layout {
        CacheLayout::Paged { max_blocks, .. } => *max_blocks,
        CacheLayout::Contiguous { .. } => 0,
    };
    sequences * (1 + table + p.heads_q()) + p.heads_q()
}

/// Runs of sequences, each as long as its bindings and grid allow; an
/// error naming what does not fit when one sequence alone does not.
/// `windows`: the caches are bound as windows of the dispatch's blocks
/// (else as whole pool buffers, each within a binding already).
fn plan(
    p: &KvCacheProblem,
    kernel: DecodeKernel,
    splits: usize,
    eb: u64,
    limits: &Limits,
    windows: bool,
) -> Result<Vec<Dispatch>> {
    let row_blocks = kernel.row_blocks(p.group_rows()) as u64;
    let fits = |d: &Dispatch| {
        dispatch_bytes(p, splits, d, eb, limits.align)
            .iter()
            .all(|&bytes| bytes <= limits.binding)
            && d.sequences.len() as u64 * p.heads_kv() as u64 * row_blocks <= limits.grid
            && (d.blocks.len() * p.heads_kv() * p.block_size()) as u64 <= u32::MAX as u64
    };
    let mut plan: Vec<Dispatch> = Vec::new();
    let mut current: Option<Dispatch> = None;
    for b in 0..p.batch() {
        let own = if windows { blocks_of(p, b) } else { None };
        let grown = current.as_ref().map(|c| Dispatch {
            sequences: c.sequences.start..b + 1,
            blocks: match &own {
                None => c.blocks.clone(),
                Some(r) if c.blocks.is_empty() => r.clone(),
                Some(r) => c.blocks.start.min(r.start)..c.blocks.end.max(r.end),
            },
        });
        match grown {
            Some(g) if fits(&g) => current = Some(g),
            _ => {
                let alone = Dispatch {
                    sequences: b..b + 1,
                    blocks: own.unwrap_or(0..0),
                };
                if !fits(&alone) {
                    return Err(too_large(p, splits, &alone, eb, limits));
                }
                plan.extend(current.replace(alone));
            }
        }
    }
    plan.extend(current);
    Ok(plan)
}

fn too_large(p: &KvCacheProblem, splits: usize, d: &Dispatch, eb: u64, limits: &Limits) -> Error {
    let b = d.sequences.start;
    let bytes = dispatch_bytes(p, splits, d, eb, limits.align);
    let what = match bytes.iter().position(|&x| x > limits.binding) {
        Some(0) | Some(1) => format!(
            "the cache blocks sequence {b} reads span {} bytes of k_cache / v_cache",
            bytes[0].max(bytes[1])
        ),
        Some(2) => format!("its {splits} split states take {} bytes", bytes[2]),
        Some(_) => format!(
            "its queries and lengths take {} bytes",
            bytes[3].max(bytes[4])
        ),
        None => "its workgroups exceed the grid".to_string(),
    };
    Error::TooLarge(format!(
        "decoding sequence {b} on the GPU needs more than one storage binding of this \
         adapter ({} bytes): {what}; use fewer splits, blocks closer together, or \
         device=\"cpu\"",
        limits.binding
    ))
}

/// One cache's window: the buffer, its bound range and the elements from
/// the range's start to the dispatch's first block.
struct CacheWindow {
    buffer: Arc<Pooled>,
    offset: u64,
    size: u64,
    delta: u32,
}

impl CacheWindow {
    fn binding(&self) -> wgpu::BindingResource<'_> {
        wgpu::BindingResource::Buffer(wgpu::BufferBinding {
            buffer: self.buffer.buffer(),
            offset: self.offset,
            size: wgpu::BufferSize::new(self.size),
        })
    }
}

/// Blocks `blocks` of a cache (`row` elements of `eb` bytes per cache
/// row): uploaded alone from the host, or a window of the device array's
/// buffer at an aligned offset.
#[allow(clippy::too_many_arguments)]
fn window(
    sub: &mut Submission<'_>,
    name: &str,
    cache: Source<'_>,
    p: &KvCacheProblem,
    blocks: &std::ops::Range<usize>,
    row: usize,
    eb: u64,
    align: u64,
) -> Result<CacheWindow> {
    let block_bytes = (p.heads_kv() * p.block_size() * row) as u64 * eb;
    let (start, end) = (
        blocks.start as u64 * block_bytes,
        blocks.end as u64 * block_bytes,
    );
    if end == start {
        // No row at all: a zeroed stand-in of the smallest binding the
        // kernel takes, never read. (A row read four elements at a time
        // is one In4 or more, so a window with rows is large enough.)
        let buffer = sub.upload(name, &[0; MIN_WINDOW as usize])?;
        return Ok(CacheWindow {
            buffer,
            offset: 0,
            size: MIN_WINDOW,
            delta: 0,
        });
    }
    match cache {
        Source::Host(bytes) => {
            let buffer = sub.upload(name, &bytes[start as usize..end as usize])?;
            let size = buffer.bytes();
            Ok(CacheWindow {
                buffer,
                offset: 0,
                size,
                delta: 0,
            })
        }
        Source::Device(t) => {
            let buffer = t.buffer().clone();
            sub.keep(&buffer);
            let offset = start / align * align;
            let size = (end - offset).next_multiple_of(16).max(16);
            let size = size.min(buffer.bytes() - offset);
            Ok(CacheWindow {
                buffer,
                offset,
                size,
                delta: ((start - offset) / eb) as u32,
            })
        }
    }
}

/// The pool buffers a dispatch's sequences read, in order (buffer 0 when
/// they read none: a run is still needed for the outputs).
fn buffers_read(p: &KvCacheProblem, d: &Dispatch, per_buffer: usize) -> Vec<usize> {
    let mut read = std::collections::BTreeSet::new();
    if let CacheLayout::Paged {
        block_size,
        max_blocks,
        table,
        ..
    } = &p.layout
    {
        for b in d.sequences.clone() {
            let used = &table[b * max_blocks..][..p.seqlens[b].div_ceil(*block_size)];
            read.extend(used.iter().map(|&x| x / per_buffer));
        }
    }
    if read.is_empty() {
        read.insert(0);
    }
    read.into_iter().collect()
}

/// The words of a dispatch's `seq_data` and the uniform's offsets into it.
/// `buffer`: the pool buffer bound (index, blocks per buffer), whose
/// blocks the table counts from its first, the others' marked NONE.
fn seq_data_of(
    p: &KvCacheProblem,
    d: &Dispatch,
    variants: &VariantArrays<'_>,
    buffer: Option<(usize, usize)>,
) -> (Vec<u32>, [u32; 4]) {
    let mut words: Vec<u32> = d.sequences.clone().map(|b| p.seqlens[b] as u32).collect();
    let table_off = words.len() as u32;
    if let CacheLayout::Paged {
        max_blocks, table, ..
    } = &p.layout
    {
        for b in d.sequences.clone() {
            // Blocks counted from the first one bound; entries past the
            // length are 0 (never read).
            let row = table[b * max_blocks..(b + 1) * max_blocks].iter();
            match buffer {
                None => words.extend(row.map(|&x| x.saturating_sub(d.blocks.start) as u32)),
                Some((i, per)) => {
                    words.extend(row.map(|&x| if x / per == i { (x % per) as u32 } else { NONE }))
                }
            }
        }
    }
    let slopes_off = words.len() as u32;
    if let Some(slopes) = variants.alibi_slopes {
        let hq = p.heads_q();
        for b in d.sequences.clone() {
            let row = match p.attention.alibi_per_batch {
                Some(true) => &slopes[b * hq..(b + 1) * hq],
                _ => slopes,
            };
            words.extend(row.iter().map(|&s| (s as f32).to_bits()));
        }
    }
    let sinks_off = words.len() as u32;
    if let Some(sinks) = variants.sinks {
        words.extend(sinks.iter().map(|&s| (s as f32).to_bits()));
    }
    if words.is_empty() {
        words.push(0);
    }
    (words, [0, table_off, slopes_off, sinks_off])
}

/// A whole pool buffer as a cache binding.
fn whole(array: &DeviceArray, sub: &mut Submission<'_>) -> CacheWindow {
    let buffer = array.buffer().clone();
    sub.keep(&buffer);
    let size = buffer.bytes();
    CacheWindow {
        buffer,
        offset: 0,
        size,
        delta: 0,
    }
}

fn decode_on(
    ctx: &Arc<Context>,
    p: &KvCacheProblem,
    q: Source<'_>,
    caches: Caches<'_>,
    variants: &VariantArrays<'_>,
    outputs: Placement,
    overrides: &Overrides,
) -> Result<ForwardOutput<Array>> {
    let a = &p.attention;
    if a.dtype == DType::F16 && !ctx.f16_inputs {
        return Err(float16_error(ctx, "q"));
    }
    timing::start_call();
    let prepared = Instant::now();
    if p.lse_len() == 0 {
        return ctx.scoped("making the outputs", || {
            let mut sub = Submission::new(ctx);
            let out = empty_output(ctx, &mut sub, outputs, a.dtype, p.out_shape(), 0.0)?;
            let lse = empty_output(
                ctx,
                &mut sub,
                outputs,
                DType::F32,
                p.lse_shape(),
                f32::NEG_INFINITY,
            )?;
            sub.submit(&[])?;
            Ok(ForwardOutput { out, lse })
        });
    }
    check_device_outputs(ctx, outputs, &[("o", p.out_len()), ("lse", p.lse_len())])?;
    let (d, dv) = (a.head_dim, a.value_dim);
    let (kernel, splits) = choose(ctx, p, overrides)?;
    let f16 = a.dtype == DType::F16;
    let eb = if f16 { 2 } else { 4 };
    let limits = Limits {
        binding: binding_limit(ctx, overrides),
        grid: ctx.limits.max_compute_workgroups_per_dimension as u64,
        align: ctx.limits.min_storage_buffer_offset_alignment.max(16) as u64,
    };
    // A dispatch over pools runs once per buffer, each run's splits apart.
    let paged = matches!(p.layout, CacheLayout::Paged { .. });
    let (caches, dispatches) = match caches {
        Caches::Arrays(k, v) => match plan(p, kernel, splits, eb, &limits, true) {
            Ok(dispatches) => (caches, dispatches),
            Err(e) => {
                // A sequence's blocks span more than a binding (or something
                // else does not fit, which more runs do not mend).
                let per = window_blocks(p, eb, &limits)
                    .filter(|_| paged)
                    .ok_or(e.clone())?;
                let runs = p.cache_blocks().div_ceil(per);
                let dispatches =
                    plan(p, kernel, splits * runs, eb, &limits, false).map_err(|_| e)?;
                (Caches::Windows(k, v, per), dispatches)
            }
        },
        Caches::Pools { keys, .. } => (
            caches,
            plan(p, kernel, splits * keys.len(), eb, &limits, false)?,
        ),
        Caches::Windows(..) => unreachable!("made here"),
    };
    let skips = !matches!(caches, Caches::Arrays(..));
    let mut constants = kernel.overrides(paged, a.softcap.is_some(), a.alibi_per_batch.is_some());
    constants.push(("SKIPS", if skips { 1.0 } else { 0.0 }));
    let vec4 = kernel.vec4();
    let pipeline = match kernel {
        DecodeKernel::Workgroup(_) => {
            let label = match (f16, vec4) {
                (false, true) => "decode_f32_vec4",
                (false, false) => "decode_f32_elements",
                (true, true) => "decode_f16_vec4",
                (true, false) => "decode_f16_elements",
            };
            ctx.specialised_pipeline(label, || decode_source(f16, vec4), &constants)?
        }
        DecodeKernel::Subgroup(_) => {
            let label = match (f16, vec4) {
                (false, true) => "decode_subgroup_f32_vec4",
                (false, false) => "decode_subgroup_f32_elements",
                (true, true) => "decode_subgroup_f16_vec4",
                (true, false) => "decode_subgroup_f16_elements",
            };
            ctx.specialised_pipeline(label, || decode_subgroup_source(f16, vec4), &constants)?
        }
    };
    let combine = ctx.array_pipeline("decode_combine", DECODE_COMBINE)?;
    let row_blocks = kernel.row_blocks(p.group_rows());
    let per_sequence = a.heads_q * a.seq_q;
    let side = |x: Option<usize>| x.map_or(NONE, |x| x.min(POSITION_LIMIT) as u32);
    let mut out = Sink::new(outputs, p.out_len(), 0.0);
    let mut lse = Sink::new(outputs, p.lse_len(), f32::NEG_INFINITY);
    for (i, dispatch) in dispatches.iter().enumerate() {
        let (b0, n) = (dispatch.sequences.start, dispatch.sequences.len());
        let out_rows = n * per_sequence;
        let last = i + 1 == dispatches.len();
        let reads = ctx.scoped("decoding over a KV cache", || {
            let mut sub = Submission::new(ctx);
            let buffers: Vec<Option<(usize, usize)>> = match caches {
                Caches::Arrays(..) => vec![None],
                Caches::Pools {
                    per_buffer: per, ..
                }
                | Caches::Windows(_, _, per) => buffers_read(p, dispatch, per)
                    .into_iter()
                    .map(|i| Some((i, per)))
                    .collect(),
            };
            let all_splits = splits * buffers.len();
            let part_o = sub.output(all_splits * out_rows * dv);
            let part_lse = sub.output(all_splits * out_rows);
            let qb = chunk_input(&mut sub, "q", q, (per_sequence * d, eb as usize), (b0, n))?;
            let mut seq_data = None;
            let mut sinks_offset = 0;
            for (run, &buffer) in buffers.iter().enumerate() {
                let (words, [seqlens_off, table_off, slopes_off, sinks_off]) =
                    seq_data_of(p, dispatch, variants, buffer);
                let data = sub.data(&words)?;
                let blocks = &dispatch.blocks;
                let (kw, vw) = match caches {
                    Caches::Pools { keys, values, .. } => {
                        let i = buffer.map_or(0, |(i, _)| i);
                        (whole(&keys[i], &mut sub), whole(&values[i], &mut sub))
                    }
                    Caches::Windows(k_cache, v_cache, per) => {
                        let i = buffer.map_or(0, |(i, _)| i);
                        let blocks = i * per..((i + 1) * per).min(p.cache_blocks());
                        let (k, v) = ("k_cache", "v_cache");
                        (
                            window(&mut sub, k, k_cache, p, &blocks, d, eb, limits.align)?,
                            window(&mut sub, v, v_cache, p, &blocks, dv, eb, limits.align)?,
                        )
                    }
                    Caches::Arrays(k_cache, v_cache) => (
                        window(&mut sub, "k_cache", k_cache, p, blocks, d, eb, limits.align)?,
                        window(
                            &mut sub,
                            "v_cache",
                            v_cache,
                            p,
                            blocks,
                            dv,
                            eb,
                            limits.align,
                        )?,
                    ),
                };
                let uniform = sub.uniform(&Uniform {
                    heads_q: a.heads_q as u32,
                    heads_kv: a.heads_kv as u32,
                    group: a.group_size() as u32,
                    seq_q: a.seq_q as u32,
                    rows: p.group_rows() as u32,
                    row_blocks: row_blocks as u32,
                    d: d as u32,
                    dv: dv as u32,
                    block_size: p.block_size() as u32,
                    max_blocks: match &p.layout {
                        CacheLayout::Paged { max_blocks, .. } => *max_blocks as u32,
                        CacheLayout::Contiguous { .. } => 1,
                    },
                    splits: splits as u32,
                    causal: u32::from(a.causal),
                    left: side(a.window.left),
                    right: side(a.window.right),
                    scale: a.scale as f32,
                    softcap: a.softcap.map_or(1.0, |c| c as f32),
                    seqlens_off,
                    table_off,
                    slopes_off,
                    split_base: (run * splits) as u32,
                    k_delta: kw.delta,
                    v_delta: vw.delta,
                    out_rows: out_rows as u32,
                    pad1: 0,
                })?;
                let group = ctx.device.create_bind_group(&wgpu::BindGroupDescriptor {
                    label: Some("decode"),
                    layout: &pipeline.get_bind_group_layout(0),
                    entries: &[
                        entry(0, uniform.binding()),
                        entry(1, qb.binding()),
                        entry(2, kw.binding()),
                        entry(3, vw.binding()),
                        entry(4, data.binding()),
                        entry(5, part_o.binding()),
                        entry(6, part_lse.binding()),
                    ],
                });
                let y = (n * a.heads_kv * row_blocks) as u32;
                let name = match kernel {
                    DecodeKernel::Workgroup(_) => "decode",
                    DecodeKernel::Subgroup(_) => "decode_subgroup",
                };
                sub.dispatch(&pipeline, &group, (splits as u32, y), name);
                // Every run's words agree on the sinks the combine reads.
                sinks_offset = sinks_off;
                seq_data = Some(data);
            }
            let seq_data = seq_data.expect("at least one run");
            let combine_uniform = sub.uniform(&CombineUniform {
                rows: out_rows as u32,
                dv: dv as u32,
                splits: all_splits as u32,
                heads_q: a.heads_q as u32,
                seq_q: a.seq_q as u32,
                sinks: u32::from(a.sinks),
                sinks_off: sinks_offset,
                pad0: 0,
            })?;
            let ob = sub.output(out_rows * dv);
            let lb = sub.output(out_rows);
            let group = ctx.device.create_bind_group(&wgpu::BindGroupDescriptor {
                label: Some("decode_combine"),
                layout: &combine.get_bind_group_layout(0),
                entries: &[
                    entry(0, combine_uniform.binding()),
                    entry(1, part_o.binding()),
                    entry(2, part_lse.binding()),
                    entry(3, seq_data.binding()),
                    entry(4, ob.binding()),
                    entry(5, lb.binding()),
                ],
            });
            let count = out_rows * dv.max(1);
            merge::run(ctx, &mut sub, (&combine, "decode_combine"), &group, count)?;
            let mut reads = Vec::new();
            let first_row = b0 * per_sequence;
            out.collect(
                ctx,
                &mut sub,
                &ob,
                first_row * dv,
                out_rows * dv,
                false,
                &mut reads,
            )?;
            lse.collect(ctx, &mut sub, &lb, first_row, out_rows, false, &mut reads)?;
            if last {
                out.finish_on_device(ctx, &mut sub, a.dtype, p.out_shape())?;
                lse.finish_on_device(ctx, &mut sub, DType::F32, p.lse_shape())?;
            }
            if i == 0 {
                timing::record_host("prepare", prepared);
            }
            let reads: Vec<(&Pooled, usize)> = reads.iter().map(|(b, n)| (&**b, *n)).collect();
            sub.submit(&reads)
        })?;
        let mut reads = reads.into_iter();
        let first_row = b0 * per_sequence;
        out.place(first_row * dv, false, &mut reads);
        lse.place(first_row, false, &mut reads);
    }
    Ok(ForwardOutput {
        out: out.into_array(a.dtype)?,
        lse: lse.into_array(DType::F32)?,
    })
}

fn entry(binding: u32, resource: wgpu::BindingResource<'_>) -> wgpu::BindGroupEntry<'_> {
    wgpu::BindGroupEntry { binding, resource }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};
    use wgpu::naga;

    /// Every member of the shader's uniform, in order, at the offset of
    /// the member of the same name here (see gpu/params.rs for why).
    fn check_struct(source: &str, name: &str, rust: &[(&str, usize)], size: usize) {
        let module = naga::front::wgsl::parse_str(source).expect("the shader parses");
        let (span, members) = module
            .types
            .iter()
            .find_map(|(_, ty)| match (&ty.name, &ty.inner) {
                (Some(n), naga::TypeInner::Struct { members, span }) if n == name => {
                    Some((*span, members.clone()))
                }
                _ => None,
            })
            .unwrap_or_else(|| panic!("struct {name} in the shader"));
        let shader: Vec<(String, usize)> = members
            .iter()
            .map(|m| (m.name.clone().unwrap_or_default(), m.offset as usize))
            .collect();
        let rust: Vec<(String, usize)> = rust.iter().map(|(n, o)| (n.to_string(), *o)).collect();
        assert_eq!(shader, rust);
        assert_eq!(span as usize, size);
        assert_eq!(4 * rust.len(), size);
    }

    macro_rules! offsets {
        ($ty:ty: $($field:ident),* $(,)?) => {
            [$((stringify!($field), offset_of!($ty, $field))),*]
        };
    }

    #[test]
    fn uniforms_match_the_shaders() {
        let rust = offsets!(Uniform: heads_q, heads_kv, group, seq_q, rows, row_blocks, d, dv,
            block_size, max_blocks, splits, causal, left, right, scale, softcap, seqlens_off,
            table_off, slopes_off, split_base, k_delta, v_delta, out_rows, pad1);
        check_struct(
            &decode_source(false, true),
            "Decode",
            &rust,
            size_of::<Uniform>(),
        );
        let rust =
            offsets!(CombineUniform: rows, dv, splits, heads_q, seq_q, sinks, sinks_off, pad0);
        check_struct(
            DECODE_COMBINE,
            "Combine",
            &rust,
            size_of::<CombineUniform>(),
        );
    }
}
