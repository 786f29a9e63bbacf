//! How a decode call is cut into dispatches and what each binds: runs
//! of sequences as long as the bindings and the grid allow, the cache
//! windows (whole blocks, at aligned offsets, uploaded alone from the
//! host), a pool's buffers or a large cache's windows run one by one
//! (`Bind::Runs`), and each dispatch's `seq_data` words (lengths, block
//! table, slopes, sinks). Pure planning but for the windows, which
//! upload or keep the buffers they bind.

use std::sync::Arc;

use super::select::DecodeKernel;
use super::{MIN_WINDOW, NONE};
use crate::error::{Error, Result};
use crate::gpu::device_array::DeviceArray;
use crate::gpu::inputs::Source;
use crate::gpu::pool::Pooled;
use crate::gpu::transfer::Submission;
use crate::problem::{CacheLayout, KvCacheProblem};
use crate::variants::VariantArrays;

/// A run of sequences decoded by one dispatch, and the cache blocks it
/// binds (bound as one window: `Bind::Blocks`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Dispatch {
    pub(super) sequences: std::ops::Range<usize>,
    pub(super) blocks: std::ops::Range<usize>,
    /// Cache rows before the dispatch's block 0: 0, but for a contiguous
    /// cache read per key/value head (`HeadRows`), where each sequence's
    /// blocks are counted from its own first row.
    pub(super) origin: usize,
}

/// The limits one dispatch must keep.
pub(super) struct Limits {
    pub(super) binding: u64,
    pub(super) grid: u64,
    pub(super) align: u64,
}

/// How a dispatch binds the caches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Bind {
    /// One window of the blocks its sequences read.
    Blocks,
    /// One run per window of `per` whole blocks its sequences read, each
    /// bound alone (a pool's buffers, windows of paged arrays); with
    /// `heads`, one sequence per dispatch (`HeadRows`: the blocks of
    /// different sequences are not counted from one origin, and each
    /// sequence has its own sinks).
    Runs { per: usize, heads: Option<Heads> },
}

/// `HeadRows`' original contiguous cache: its sequence `b` is key/value
/// head `b % heads_kv` of sequence `b / heads_kv`, at row `b * capacity`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Heads {
    pub(super) heads_kv: usize,
    pub(super) capacity: usize,
}

/// Whole blocks of a paged cache that one binding of a window holds (with
/// the slack `window` adds for the offset's alignment), or `None` when
/// not one does.
pub(super) fn window_blocks(p: &KvCacheProblem, eb: u64, limits: &Limits) -> Option<usize> {
    let blocks = window_room(limits) / block_bytes(p, eb).max(1);
    (blocks > 0).then_some(blocks as usize)
}

/// Bytes of one block of the wider cache (a contiguous cache's block is a
/// sequence).
pub(super) fn block_bytes(p: &KvCacheProblem, eb: u64) -> u64 {
    let a = &p.attention;
    let row = a.head_dim.max(a.value_dim).max(1) as u64;
    (p.heads_kv() * p.block_size()) as u64 * row * eb
}

/// Bytes of a binding a window's blocks may fill: `window` starts a window
/// up to an alignment early and rounds its end up to 16 bytes.
pub(super) fn window_room(limits: &Limits) -> u64 {
    limits.binding.saturating_sub(limits.align + 16)
}

/// A contiguous cache one of whose sequences' rows exceed a binding, read
/// as a paged problem over the same memory: `(batch, heads_kv, capacity,
/// d)` is `(batch * heads_kv, 1, capacity, d)`, and q, o and lse, laid out
/// `(batch, heads_q, ...)`, are the same arrays with `batch * heads_kv`
/// sequences of the GQA group's `heads_q / heads_kv` heads. Each such
/// sequence's rows are cut into blocks of as many rows as a window holds
/// (the last one short), counted from the sequence's own first row
/// (`Dispatch::origin`) through an identity table, so each dispatch
/// decodes one sequence of one key/value head and binds its rows window
/// by window: one run each, merged by the combine pass like a pool's.
pub(super) struct HeadRows {
    pub(super) problem: KvCacheProblem,
    /// The ALiBi slopes per (sequence, key/value head, group head): the
    /// problem's per-sequence layout.
    pub(super) slopes: Option<Vec<f64>>,
}

impl HeadRows {
    /// `None` when not one cache row fits a window.
    pub(super) fn new(
        p: &KvCacheProblem,
        variants: &VariantArrays<'_>,
        eb: u64,
        limits: &Limits,
    ) -> Option<HeadRows> {
        let CacheLayout::Contiguous { capacity } = p.layout else {
            return None;
        };
        let a = &p.attention;
        let row = a.head_dim.max(a.value_dim).max(1) as u64;
        let rows = (window_room(limits) / (row * eb)).min(capacity.max(1) as u64) as usize;
        if rows == 0 {
            return None;
        }
        let (hkv, group) = (p.heads_kv(), p.group_size());
        let sequences = p.batch() * hkv;
        let max_blocks = capacity.div_ceil(rows).max(1);
        let mut problem = p.clone();
        problem.attention.batch = sequences;
        problem.attention.heads_q = group;
        problem.attention.heads_kv = 1;
        problem.attention.alibi_per_batch = a.alibi_per_batch.map(|_| true);
        problem.seqlens = p.seqlens.iter().flat_map(|&n| [n].repeat(hkv)).collect();
        problem.layout = CacheLayout::Paged {
            num_blocks: max_blocks,
            block_size: rows,
            max_blocks,
            table: (0..sequences).flat_map(|_| 0..max_blocks).collect(),
        };
        let slopes = variants.alibi_slopes.map(|s| match a.alibi_per_batch {
            // (batch, heads_q) is already (batch * heads_kv, group).
            Some(true) => s.to_vec(),
            _ => s.repeat(p.batch()),
        });
        Some(HeadRows { problem, slopes })
    }

    /// The variants of dispatch `d` (one sequence, key/value head
    /// `b % heads_kv` of the original problem): its slopes, and the sinks
    /// of its group's heads, which the combine pass reads per head.
    pub(super) fn variants<'a>(
        &'a self,
        d: &Dispatch,
        variants: &VariantArrays<'a>,
        heads_kv: usize,
    ) -> VariantArrays<'a> {
        let group = self.problem.heads_q();
        let h = d.sequences.start % heads_kv;
        VariantArrays {
            alibi_slopes: self.slopes.as_deref(),
            sinks: variants.sinks.map(|s| &s[h * group..(h + 1) * group]),
            ..*variants
        }
    }
}

/// The blocks sequence `b` reads: its own when contiguous, else the range
/// of the table entries its length reaches (empty for an empty sequence).
pub(super) fn blocks_of(p: &KvCacheProblem, b: usize) -> Option<std::ops::Range<usize>> {
    match &p.layout {
        CacheLayout::Contiguous { .. } => Some(b..b + 1),
        CacheLayout::Paged { .. } => {
            let used = used_blocks(p, b);
            // One pass that vectorises (min() and max() over an iterator
            // took 0.4 ms for a table of 256k entries on the 2-core VM).
            let (lo, hi) = used
                .iter()
                .fold((usize::MAX, 0), |(lo, hi), &x| (lo.min(x), hi.max(x)));
            (!used.is_empty()).then_some(lo..hi + 1)
        }
    }
}

/// The table entries of a paged cache's sequence `b` that its length
/// reaches (none when contiguous).
pub(super) fn used_blocks(p: &KvCacheProblem, b: usize) -> &[usize] {
    match &p.layout {
        CacheLayout::Contiguous { .. } => &[],
        CacheLayout::Paged {
            block_size,
            max_blocks,
            table,
            ..
        } => &table[b * max_blocks..][..p.seqlens[b].div_ceil(*block_size)],
    }
}

/// Bytes of a dispatch's bindings, the widest first: the cache windows
/// (with an alignment's slack), the partial states, q, the outputs.
pub(super) fn dispatch_bytes(
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
pub(super) fn seq_data_words(p: &KvCacheProblem, sequences: usize) -> usize {
    let table = match &p.layout {
        CacheLayout::Paged { max_blocks, .. } => *max_blocks,
        CacheLayout::Contiguous { .. } => 0,
    };
    sequences * (1 + table + p.heads_q()) + p.heads_q()
}

/// Runs of sequences, each as long as its bindings and grid allow; an
/// error naming what does not fit when one sequence alone does not.
/// With `Bind::Runs` a dispatch has `splits` splits per window it reads.
pub(super) fn plan(
    p: &KvCacheProblem,
    kernel: DecodeKernel,
    splits: usize,
    eb: u64,
    limits: &Limits,
    bind: Bind,
) -> Result<Vec<Dispatch>> {
    let row_blocks = kernel.row_blocks(p.group_rows()) as u64;
    let fits = |d: &Dispatch, runs: usize| {
        dispatch_bytes(p, splits * runs, d, eb, limits.align)
            .iter()
            .all(|&bytes| bytes <= limits.binding)
            && d.sequences.len() as u64 * p.heads_kv() as u64 * row_blocks <= limits.grid
            && (d.blocks.len() * p.heads_kv() * p.block_size()) as u64 <= u32::MAX as u64
    };
    let origin = |b: usize| match bind {
        Bind::Runs { heads: Some(h), .. } => b * h.capacity,
        _ => 0,
    };
    // The windows the current dispatch reads (`Bind::Runs`), one run each
    // (one at least: the outputs come from a run).
    let mut windows = std::collections::BTreeSet::new();
    let mut plan: Vec<Dispatch> = Vec::new();
    let mut current: Option<Dispatch> = None;
    for b in 0..p.batch() {
        let (own, own_windows) = match bind {
            Bind::Blocks => (blocks_of(p, b), Vec::new()),
            Bind::Runs { per, .. } => {
                let mut w: Vec<usize> = used_blocks(p, b).iter().map(|&x| x / per).collect();
                w.sort_unstable();
                w.dedup();
                (None, w)
            }
        };
        let grown = current.as_ref().and_then(|c| {
            if matches!(bind, Bind::Runs { heads: Some(_), .. }) {
                return None;
            }
            let g = Dispatch {
                sequences: c.sequences.start..b + 1,
                blocks: match &own {
                    None => c.blocks.clone(),
                    Some(r) if c.blocks.is_empty() => r.clone(),
                    Some(r) => c.blocks.start.min(r.start)..c.blocks.end.max(r.end),
                },
                origin: c.origin,
            };
            let runs = windows.len() + own_windows.iter().filter(|w| !windows.contains(*w)).count();
            fits(&g, runs.max(1)).then_some(g)
        });
        match grown {
            Some(g) => {
                current = Some(g);
                windows.extend(own_windows);
            }
            None => {
                let alone = Dispatch {
                    sequences: b..b + 1,
                    blocks: own.unwrap_or(0..0),
                    origin: origin(b),
                };
                windows.clear();
                windows.extend(own_windows);
                let runs = windows.len().max(1);
                if !fits(&alone, runs) {
                    let heads = match bind {
                        Bind::Runs { heads, .. } => heads,
                        Bind::Blocks => None,
                    };
                    return Err(too_large(p, splits, (runs, heads), &alone, eb, limits));
                }
                plan.extend(current.replace(alone));
            }
        }
    }
    plan.extend(current);
    Ok(plan)
}

pub(super) fn too_large(
    p: &KvCacheProblem,
    splits: usize,
    (runs, heads): (usize, Option<Heads>),
    d: &Dispatch,
    eb: u64,
    limits: &Limits,
) -> Error {
    let b = d.sequences.start;
    let (b, head) = match heads {
        Some(Heads { heads_kv: h, .. }) => (b / h, format!(" (key/value head {})", b % h)),
        None => (b, String::new()),
    };
    let bytes = dispatch_bytes(p, splits * runs, d, eb, limits.align);
    let what = match bytes.iter().position(|&x| x > limits.binding) {
        Some(0) | Some(1) => format!(
            "the cache blocks sequence {b} reads span {} bytes of k_cache / v_cache",
            bytes[0].max(bytes[1])
        ),
        Some(2) if runs > 1 => format!(
            "its {splits} split state(s) for each of the {runs} cache windows it reads \
             take {} bytes",
            bytes[2]
        ),
        Some(2) => format!("its {splits} split states take {} bytes", bytes[2]),
        Some(_) => format!(
            "its queries and lengths take {} bytes",
            bytes[3].max(bytes[4])
        ),
        None => "its workgroups exceed the grid".to_string(),
    };
    Error::TooLarge(format!(
        "decoding sequence {b}{head} on the GPU needs more than one storage binding of this \
         adapter ({} bytes): {what}; use fewer splits, blocks closer together, or \
         device=\"cpu\"",
        limits.binding
    ))
}

/// Not one block (a contiguous cache: not one row) of the caches fits a
/// window of a binding.
pub(super) fn block_too_large(p: &KvCacheProblem, eb: u64, limits: &Limits) -> Error {
    let a = &p.attention;
    let row = a.head_dim.max(a.value_dim).max(1);
    let what = match p.layout {
        CacheLayout::Paged { block_size, .. } => format!(
            "one block of k_cache / v_cache ({} key/value heads x {block_size} keys x {row} \
             elements x {eb} bytes = {} bytes)",
            p.heads_kv(),
            block_bytes(p, eb)
        ),
        CacheLayout::Contiguous { .. } => format!(
            "one row of k_cache / v_cache ({row} elements x {eb} bytes = {} bytes)",
            row as u64 * eb
        ),
    };
    Error::TooLarge(format!(
        "decoding on the GPU binds the caches a whole block at a time, and {what} does not fit \
         one storage binding of this adapter ({} bytes, less {} for the window's alignment); \
         use smaller blocks or device=\"cpu\"",
        limits.binding,
        limits.align + 16
    ))
}

/// One cache's window: the buffer, its bound range and the elements from
/// the range's start to the dispatch's first block.
pub(super) struct CacheWindow {
    pub(super) buffer: Arc<Pooled>,
    pub(super) offset: u64,
    pub(super) size: u64,
    pub(super) delta: u32,
}

impl CacheWindow {
    pub(super) fn binding(&self) -> wgpu::BindingResource<'_> {
        wgpu::BindingResource::Buffer(wgpu::BufferBinding {
            buffer: self.buffer.buffer(),
            offset: self.offset,
            size: wgpu::BufferSize::new(self.size),
        })
    }
}

/// Blocks `blocks` of a cache (`row` elements of `eb` bytes per cache
/// row) counted from cache row `origin`: uploaded alone from the host, or
/// a window of the device array's buffer at an aligned offset. The range
/// ends at the cache's end (a `HeadRows` sequence's last block is short).
#[allow(clippy::too_many_arguments)]
pub(super) fn window(
    sub: &mut Submission<'_>,
    name: &str,
    cache: Source<'_>,
    p: &KvCacheProblem,
    (origin, blocks): (usize, &std::ops::Range<usize>),
    row: usize,
    eb: u64,
    align: u64,
) -> Result<CacheWindow> {
    let block_bytes = (p.heads_kv() * p.block_size() * row) as u64 * eb;
    let cache_bytes = match cache {
        Source::Host(bytes) => bytes.len() as u64,
        Source::Device(t) => t.len() as u64 * eb,
    };
    let base = (origin * row) as u64 * eb;
    let (start, end) = (
        (base + blocks.start as u64 * block_bytes).min(cache_bytes),
        (base + blocks.end as u64 * block_bytes).min(cache_bytes),
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

/// The runs of a dispatch over windows of `per` blocks (a pool's buffers
/// or `Caches::Windows`): for each window its sequences read, in order,
/// its index and the blocks bound, all of the window's with `whole` (a
/// pool buffer, bound whole), else those from the first to the last one
/// read (uploaded alone from the host). One run of no blocks when they
/// read none: a run is still needed for the outputs.
pub(super) fn runs_of(
    p: &KvCacheProblem,
    d: &Dispatch,
    per: usize,
    whole: bool,
) -> Vec<(usize, std::ops::Range<usize>)> {
    let mut read = std::collections::BTreeMap::<usize, (usize, usize)>::new();
    for b in d.sequences.clone() {
        for &x in used_blocks(p, b) {
            let e = read.entry(x / per).or_insert((x, x));
            *e = (e.0.min(x), e.1.max(x));
        }
    }
    if read.is_empty() {
        return vec![(0, if whole { 0..per } else { 0..0 })];
    }
    read.into_iter()
        .map(|(i, (lo, hi))| {
            (
                i,
                if whole {
                    i * per..(i + 1) * per
                } else {
                    lo..hi + 1
                },
            )
        })
        .collect()
}

/// The words of a dispatch's `seq_data` and the uniform's offsets into it.
/// `run`: the blocks bound (a run over windows), which the table counts
/// from their first, the others' marked NONE; else the dispatch's blocks.
pub(super) fn seq_data_of(
    p: &KvCacheProblem,
    d: &Dispatch,
    variants: &VariantArrays<'_>,
    run: Option<&std::ops::Range<usize>>,
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
            match run {
                None => words.extend(row.map(|&x| x.saturating_sub(d.blocks.start) as u32)),
                Some(r) => words.extend(row.map(|&x| {
                    if r.contains(&x) {
                        (x - r.start) as u32
                    } else {
                        NONE
                    }
                })),
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
pub(super) fn whole(array: &DeviceArray, sub: &mut Submission<'_>) -> CacheWindow {
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
