//! The CPU backend: FlashAttention-2's tiled forward and recomputing
//! backward, parallel over (batch·head, tile) on the calling thread and
//! helper threads (`parallel.rs`).
//!
//! Every output element is produced by exactly one task, in an order that
//! depends neither on scheduling nor on the thread count (only the query
//! tile height follows the thread count, and no sum runs across query
//! rows in a way that depends on it), so results are bitwise reproducible.

pub(crate) mod buffers;
pub mod decode;
pub mod element;
mod kernels;
pub mod merge;
pub(crate) mod parallel;
pub mod scores;
#[cfg(target_arch = "x86_64")]
mod simd;
pub mod softmax;
pub mod tiles;

use std::any::Any;
use std::cell::RefCell;
use std::ops::Range;
use std::sync::Arc;

use crate::fork::ForkLocal;
use crate::{
    BackendGradients, Buffer, DType, Error, ForwardOutput, Problem, Result, Slice, VariantArrays,
};
use buffers::{spare, zero_init};
use element::{Element, PackInput, Packing};
use scores::{ScoreRules, TileVisibility};
use softmax::RowState;
use tiles::TileSizes;

/// Environment variable that sets the number of CPU threads.
pub const NUM_THREADS_ENV: &str = "FLASHPORT_NUM_THREADS";

/// The most threads `FLASHPORT_NUM_THREADS` may ask for, unless the
/// machine has more cores.
///
/// This compute-bound work gains nothing from more threads than cores,
/// but the bound is not a multiple of this machine's cores: a setting
/// written for a large server should still work on a 2-core runner
/// (slower, oversubscribed), not fail there. 1024 is above the hardware
/// threads of today's largest two-socket servers (768) and far below what
/// exhausts a process (each helper holds a stack and a kernel task), while
/// a typo such as `4294967297` would otherwise spawn threads until the
/// machine gives out.
pub const MAX_THREADS: usize = 1024;

/// The thread count of the next call: `FLASHPORT_NUM_THREADS` when set,
/// otherwise every available core. Read on every call so that it can be
/// changed at run time.
pub fn num_threads() -> Result<usize> {
    parse_num_threads(
        std::env::var_os(NUM_THREADS_ENV).as_deref(),
        available_cores(),
    )
}

fn available_cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// `FLASHPORT_NUM_THREADS`'s value (`None`: unset) on a machine of `cores`.
/// Every value set is checked, including an empty one or one that is not
/// text: a setting that is silently ignored looks like one that works.
fn parse_num_threads(value: Option<&std::ffi::OsStr>, cores: usize) -> Result<usize> {
    let Some(value) = value else {
        return Ok(cores);
    };
    let max = MAX_THREADS.max(cores);
    match value.to_str().map(|text| text.trim().parse::<usize>()) {
        Some(Ok(n)) if (1..=max).contains(&n) => Ok(n),
        _ => Err(Error::Value {
            argument: NUM_THREADS_ENV.to_string(),
            value: format!("{:?}", value.to_string_lossy()),
            reason: format!(
                "expected a whole number of threads from 1 to {max} (this machine has {cores} \
                 cores), or unset for all of them"
            ),
        }),
    }
}

/// Whether float32 runs the AVX2+FMA kernels on this CPU.
pub fn simd_kernels() -> bool {
    #[cfg(target_arch = "x86_64")]
    return simd::available();
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// `threads` helper threads: those of the one pool, grown first if it has
/// fewer. A call that asks for fewer leaves the rest idle.
///
/// One pool, not one per thread count: a program that tries counts one
/// after another (a benchmark over 1..64) kept every pool and 2,018
/// threads. Growing replaces the pool; the old one's threads exit once the
/// calls still using it are done, so the threads never exceed the largest
/// count asked for, plus those of pools on their way out. A forked child
/// starts a pool of its own (`fork.rs`).
fn helper_threads(threads: usize) -> Result<parallel::Helpers> {
    static POOL: ForkLocal<Option<Arc<rayon::ThreadPool>>> = ForkLocal::new();
    let mut pool = POOL.lock();
    let pool = match pool.as_ref() {
        Some(p) if p.current_num_threads() >= threads => p.clone(),
        _ => {
            let grown = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .thread_name(|i| format!("flashport-{i}"))
                .build()
                .map_err(|e| Error::Value {
                    argument: NUM_THREADS_ENV.to_string(),
                    value: (threads + 1).to_string(),
                    reason: format!("could not start the thread pool: {e}"),
                })?;
            pool.insert(Arc::new(grown)).clone()
        }
    };
    Ok(parallel::Helpers {
        pool,
        count: threads,
    })
}

/// Runs `f` on this thread with the configured number of threads in all
/// (see `parallel.rs`), with tiles chosen for them.
fn run_on_pool<R: Send>(
    problem: &Problem,
    element_bytes: usize,
    f: impl FnOnce(TileSizes) -> R + Send,
) -> Result<R> {
    let threads = num_threads()?;
    let tiles = tiles::choose(problem, threads, element_bytes);
    run_with(threads, || f(tiles))
}

/// Runs `f` on this thread with `threads` threads in all serving its
/// `parallel::for_each` calls.
fn run_with<R: Send>(threads: usize, f: impl FnOnce() -> R + Send) -> Result<R> {
    let helpers = match threads {
        1 => None,
        _ => Some(helper_threads(threads - 1)?),
    };
    Ok(parallel::with_helpers(helpers, f))
}

/// Forward pass on the CPU.
pub fn forward(
    problem: &Problem,
    q: Slice<'_>,
    k: Slice<'_>,
    v: Slice<'_>,
    variants: &VariantArrays<'_>,
) -> Result<ForwardOutput> {
    match problem.dtype {
        DType::F64 => forward_as::<f64>(problem, q, k, v, variants),
        DType::F32 => forward_as::<f32>(problem, q, k, v, variants),
        DType::F16 | DType::BF16 => {
            let result = forward_as::<f32>(problem, q, k, v, variants)?;
            Ok(ForwardOutput {
                out: narrow(result.out, problem.dtype),
                lse: result.lse,
            })
        }
    }
}

/// Backward pass on the CPU, from `[do, q, k, v, o, lse]`.
pub fn backward(
    problem: &Problem,
    inputs: [Slice<'_>; 6],
    variants: &VariantArrays<'_>,
) -> Result<BackendGradients> {
    match problem.dtype {
        DType::F64 => backward_as::<f64>(problem, inputs, variants),
        DType::F32 => backward_as::<f32>(problem, inputs, variants),
        DType::F16 | DType::BF16 => {
            let g = backward_as::<f32>(problem, inputs, variants)?;
            let dtype = problem.dtype;
            Ok(BackendGradients {
                dq: narrow(g.dq, dtype),
                dk: narrow(g.dk, dtype),
                dv: narrow(g.dv, dtype),
                d_scores: g.d_scores,
            })
        }
    }
}

/// A float32 result rounded (to nearest, ties to even) to the float16 or
/// bfloat16 `dtype` it was computed for; any other buffer as it is.
pub(crate) fn narrow(buffer: Buffer, dtype: DType) -> Buffer {
    match (buffer, dtype) {
        (Buffer::F32(v), DType::F16) => {
            Buffer::F16(v.into_iter().map(half::f16::from_f32).collect())
        }
        (Buffer::F32(v), DType::BF16) => {
            Buffer::BF16(v.into_iter().map(half::bf16::from_f32).collect())
        }
        (other, _) => other,
    }
}

fn forward_as<T: Element>(
    problem: &Problem,
    q: Slice<'_>,
    k: Slice<'_>,
    v: Slice<'_>,
    variants: &VariantArrays<'_>,
) -> Result<ForwardOutput> {
    if problem.out_len() == 0 && problem.lse_len() == 0 {
        // Nothing to compute, and an empty array's other dimensions may
        // be any size: no tile arithmetic on them.
        return Ok(ForwardOutput {
            out: T::into_buffer(Vec::new()),
            lse: T::into_buffer(Vec::new()),
        });
    }
    let (q, k, v) = (T::view(q), T::view(k), T::view(v));
    let (out, lse) = run_on_pool(problem, std::mem::size_of::<T>(), |tiles| {
        let rules = ScoreRules::<T>::new(problem, variants);
        forward_typed(problem, &rules, tiles, &q, &k, &v)
    })??;
    Ok(ForwardOutput {
        out: T::into_buffer(out),
        lse: T::into_buffer(lse),
    })
}

fn backward_as<T: Element>(
    problem: &Problem,
    arrays: [Slice<'_>; 6],
    variants: &VariantArrays<'_>,
) -> Result<BackendGradients> {
    if problem.batch == 0 || problem.seq_q == 0 || problem.seq_k == 0 {
        // No (query, key) pair: every gradient is zero. An empty array's
        // other dimensions may be any size, so no tile arithmetic on them.
        return Ok(BackendGradients {
            dq: T::into_buffer(buffers::try_zeros(problem.q_len(), "dq")?),
            dk: T::into_buffer(buffers::try_zeros(problem.k_len(), "dk")?),
            dv: T::into_buffer(buffers::try_zeros(problem.v_len(), "dv")?),
            d_scores: problem.return_dmask.then(|| T::into_buffer(Vec::new())),
        });
    }
    let [d_out, q, k, v, out, lse] = arrays.map(T::view);
    let (dq, dk, dv, d_scores) = run_on_pool(problem, std::mem::size_of::<T>(), |tiles| {
        let rules = ScoreRules::<T>::new(problem, variants);
        let kv_heads = problem.batch * problem.heads_kv;
        let (seq_k, d, dv) = (problem.seq_k, problem.head_dim, problem.value_dim);
        let input = |x, cols, packing| PackInput {
            x,
            heads: kv_heads,
            rows: seq_k,
            cols,
            packing,
        };
        let [k_packed, v_packed, k_row_panels] = T::pack_inputs([
            input(&k, d, Packing::Transposed),
            input(&v, dv, Packing::Transposed),
            input(&k, d, Packing::Rows),
        ])?;
        let inputs = BackwardInputs {
            d_out: &d_out,
            q: &q,
            k: &k,
            k_packed: k_packed.as_deref(),
            v_packed: v_packed.as_deref(),
            k_row_panels: k_row_panels.as_deref(),
            v: &v,
            out: &out,
            lse: &lse,
        };
        backward_typed(problem, &rules, tiles, &inputs)
    })??;
    Ok(BackendGradients {
        dq: T::into_buffer(dq),
        dk: T::into_buffer(dk),
        dv: T::into_buffer(dv),
        d_scores: d_scores.map(T::into_buffer),
    })
}

/// One unit of parallel work: a tile of rows of one (batch, head) and the
/// disjoint output rows it owns.
struct RowTile<'a, T> {
    /// Flat (batch, head) index: `batch * heads + head`.
    head: usize,
    rows: Range<usize>,
    outputs: [&'a mut [T]; 2],
}

/// Cuts two outputs of `heads × seq × widths[i]` elements into row tiles,
/// none across the runs of rows `runs` (consecutive, covering `0..seq`).
fn row_tiles<'a, T>(
    heads: usize,
    runs: &[Range<usize>],
    tile_rows: usize,
    outputs: [&'a mut [T]; 2],
    widths: [usize; 2],
) -> Vec<RowTile<'a, T>> {
    let mut rest = outputs;
    let seq = runs.last().map_or(0, |r| r.end);
    let mut tiles = Vec::with_capacity(heads * (seq.div_ceil(tile_rows) + runs.len()));
    for head in 0..heads {
        for rows in runs
            .iter()
            .flat_map(|run| key_tiles(run.clone(), tile_rows))
        {
            let outputs = [0, 1].map(|i| {
                let (tile, tail) =
                    std::mem::take(&mut rest[i]).split_at_mut(rows.len() * widths[i]);
                rest[i] = tail;
                tile
            });
            tiles.push(RowTile {
                head,
                rows,
                outputs,
            });
        }
    }
    tiles
}

/// Per-thread working memory, reused across tasks.
struct Scratch<T> {
    q_scaled: Vec<T>,
    /// Transposed key or value tile for the SIMD products.
    pack: Vec<T>,
    scores: Vec<T>,
    d_scores: Vec<T>,
    /// `tanh(u / softcap)` of the tile, for the softcap gradient.
    tanh: Vec<T>,
    acc: Vec<T>,
    /// A block of (scaled) query rows and of output-gradient rows, packed
    /// for the backward's `dK += dSᵀ Q` and `dV += Pᵀ dO`.
    q_panels: Vec<T>,
    d_out_panels: Vec<T>,
    /// `rowsum(dO ∘ O)` of a block of query rows.
    delta: Vec<T>,
    states: Vec<RowState<T>>,
    /// Each row's largest score of a tile, and 8 lanes a row to find it.
    maxes: Vec<T>,
    lanes: Vec<T>,
    /// The key tiles of the current query tile.
    key_tiles: Vec<Range<usize>>,
}

impl<T: Element> Scratch<T> {
    fn new() -> Self {
        Scratch {
            q_scaled: Vec::new(),
            pack: Vec::new(),
            scores: Vec::new(),
            d_scores: Vec::new(),
            tanh: Vec::new(),
            acc: Vec::new(),
            q_panels: Vec::new(),
            d_out_panels: Vec::new(),
            delta: Vec::new(),
            states: Vec::new(),
            maxes: Vec::new(),
            lanes: Vec::new(),
            key_tiles: Vec::new(),
        }
    }

    /// Grows the buffers to what `problem` needs (they never shrink: the
    /// tile sizes bound them), or says how much could not be allocated.
    fn fit(&mut self, problem: &Problem, tiles: TileSizes) -> Result<()> {
        let (d, dv) = (problem.head_dim, problem.value_dim);
        let (bq, bk) = (tiles.q_rows.max(tiles.q_block), tiles.k_rows);
        let score_rows = bq * tiles::score_stride(bk, std::mem::size_of::<T>());
        let widest = d.max(dv);
        fn grow<E: Copy>(v: &mut Vec<E>, len: usize, fill: E) -> Result<()> {
            if v.len() < len {
                v.try_reserve_exact(len - v.len()).map_err(|_| {
                    Error::TooLarge(format!(
                        "a thread's working memory for this problem ({} bytes) could not \
                         be allocated",
                        len as u128 * std::mem::size_of::<E>() as u128
                    ))
                })?;
                v.resize(len, fill);
            }
            Ok(())
        }
        let zero = T::ZERO;
        grow(&mut self.q_scaled, bq * d, zero)?;
        grow(&mut self.pack, widest * bk.next_multiple_of(16), zero)?;
        grow(&mut self.scores, score_rows, zero)?;
        grow(&mut self.d_scores, score_rows, zero)?;
        if problem.softcap.is_some() {
            grow(&mut self.tanh, score_rows, zero)?;
        }
        grow(&mut self.acc, bq * dv, zero)?;
        grow(&mut self.q_panels, bq * d.next_multiple_of(16), zero)?;
        grow(&mut self.d_out_panels, bq * dv.next_multiple_of(16), zero)?;
        grow(&mut self.maxes, bq, zero)?;
        grow(&mut self.delta, bq, zero)?;
        grow(&mut self.lanes, 8 * bq, zero)?;
        grow(&mut self.states, bq, RowState::EMPTY)
    }
}

thread_local! {
    /// Each computing thread's [`Scratch`], kept between tasks and calls (see
    /// `buffers.rs` for why); boxed as `Any` to serve both element types.
    static SCRATCH: RefCell<Option<Box<dyn Any>>> = const { RefCell::new(None) };
}

/// Sizes the calling thread's scratch for `problem` before any task runs,
/// so that a problem whose working memory cannot be had is an error here
/// rather than an allocation failure inside a task (the other threads'
/// scratch is the same size).
fn reserve_scratch<T: Element>(problem: &Problem, tiles: TileSizes) -> Result<()> {
    let kept = SCRATCH.with(|cell| cell.borrow_mut().take());
    let mut scratch = kept
        .and_then(|b| b.downcast::<Scratch<T>>().ok())
        .unwrap_or_else(|| Box::new(Scratch::new()));
    let fitted = scratch.fit(problem, tiles);
    SCRATCH.with(|cell| *cell.borrow_mut() = Some(scratch));
    fitted
}

/// Runs `f` with this thread's scratch, sized for `problem`.
fn with_scratch<T: Element, R>(
    problem: &Problem,
    tiles: TileSizes,
    f: impl FnOnce(&mut Scratch<T>) -> R,
) -> R {
    // Taken out of the cell while `f` runs, so that a nested call (none
    // today) would get fresh memory instead of a borrow panic.
    let kept = SCRATCH.with(|cell| cell.borrow_mut().take());
    let mut scratch = kept
        .and_then(|b| b.downcast::<Scratch<T>>().ok())
        .unwrap_or_else(|| Box::new(Scratch::new()));
    // reserve_scratch found this size allocatable on the calling thread.
    if let Err(e) = scratch.fit(problem, tiles) {
        panic!("{e}");
    }
    let result = f(&mut scratch);
    SCRATCH.with(|cell| *cell.borrow_mut() = Some(scratch));
    result
}

/// Index helpers of one problem in canonical layout.
struct Layout<'p> {
    p: &'p Problem,
}

impl Layout<'_> {
    /// The key/value head a flat (batch, query head) index reads.
    fn kv_head(&self, head: usize) -> usize {
        let (batch, h) = (head / self.p.heads_q, head % self.p.heads_q);
        batch * self.p.heads_kv + h / self.p.group_size()
    }
    fn q_rows<'a, T>(&self, q: &'a [T], head: usize, rows: &Range<usize>) -> &'a [T] {
        let d = self.p.head_dim;
        &q[(head * self.p.seq_q + rows.start) * d..(head * self.p.seq_q + rows.end) * d]
    }
    fn o_rows<'a, T>(&self, o: &'a [T], head: usize, rows: &Range<usize>) -> &'a [T] {
        let dv = self.p.value_dim;
        &o[(head * self.p.seq_q + rows.start) * dv..(head * self.p.seq_q + rows.end) * dv]
    }
    fn k_rows<'a, T>(&self, k: &'a [T], kv_head: usize, keys: &Range<usize>) -> &'a [T] {
        let d = self.p.head_dim;
        &k[(kv_head * self.p.seq_k + keys.start) * d..(kv_head * self.p.seq_k + keys.end) * d]
    }
    fn v_rows<'a, T>(&self, v: &'a [T], kv_head: usize, keys: &Range<usize>) -> &'a [T] {
        let dv = self.p.value_dim;
        &v[(kv_head * self.p.seq_k + keys.start) * dv..(kv_head * self.p.seq_k + keys.end) * dv]
    }
    /// The tile `keys` of one head of a `Packing::Transposed` result.
    fn packed_tile<'a, T: Element>(
        &self,
        packed: Option<&'a [T]>,
        kv_head: usize,
        width: usize,
        keys: &Range<usize>,
    ) -> Option<&'a [T]> {
        let head_len = T::packed_head_len(self.p.seq_k, width);
        let base = kv_head * head_len;
        packed.map(|p| &p[base + keys.start * width..base + head_len])
    }
    /// The tile `keys` of one head of a `Packing::Rows` result, with its
    /// panel stride.
    fn row_panels<'a, T: Element>(
        &self,
        packed: Option<&'a [T]>,
        kv_head: usize,
        width: usize,
        keys: &Range<usize>,
    ) -> Option<(&'a [T], usize)> {
        let seq = self.p.seq_k;
        let head_len = T::rows_head_len(seq, width);
        let base = kv_head * head_len;
        // No panel at all when width is 0 (values of dimension 0).
        let start = (base + keys.start * 16).min(base + head_len);
        packed.map(|p| (&p[start..base + head_len], seq * 16))
    }
    fn kv_tile<'a, T: Element>(
        &self,
        x: &BackwardInputs<'a, T>,
        kv_head: usize,
        keys: &Range<usize>,
    ) -> KvTile<'a, T> {
        let (d, dv) = (self.p.head_dim, self.p.value_dim);
        KvTile {
            k_rows: self.k_rows(x.k, kv_head, keys),
            v_rows: self.v_rows(x.v, kv_head, keys),
            k_t: self.packed_tile(x.k_packed, kv_head, d, keys),
            v_t: self.packed_tile(x.v_packed, kv_head, dv, keys),
            k_panels: self.row_panels(x.k_row_panels, kv_head, d, keys),
        }
    }
    fn row_scalars<'a, T>(&self, x: &'a [T], head: usize, rows: &Range<usize>) -> &'a [T] {
        &x[head * self.p.seq_q + rows.start..head * self.p.seq_q + rows.end]
    }
}

fn scale_into<T: Element>(src: &[T], scale: T, dst: &mut [T]) {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = s * scale;
    }
}

/// Consecutive tiles of `tile` rows covering `rows` (the last may be short).
fn key_tiles(rows: Range<usize>, tile: usize) -> impl Iterator<Item = Range<usize>> {
    let end = rows.end;
    rows.step_by(tile).map(move |s| s..(s + tile).min(end))
}

fn forward_typed<T: Element>(
    problem: &Problem,
    rules: &ScoreRules<'_, T>,
    tiles: TileSizes,
    q: &[T],
    k: &[T],
    v: &[T],
) -> Result<(Vec<T>, Vec<T>)> {
    let (d, dv) = (problem.head_dim, problem.value_dim);
    let (out_len, lse_len) = (problem.out_len(), problem.lse_len());
    let mut out = buffers::try_with_capacity(out_len, "the output o")?;
    reserve_scratch::<T>(problem, tiles)?;
    let mut lse = buffers::try_with_capacity(lse_len, "the output lse")?;
    let heads = problem.batch * problem.heads_q;
    let mut tasks = row_tiles(
        heads,
        &rules.row_runs(),
        tiles.q_rows,
        [spare(&mut out, out_len), spare(&mut lse, lse_len)],
        [dv, 1],
    );
    // Threads take tasks in order: head by head, so that they share the
    // head's keys and values in cache (one head each, at (1,4,8192,128)
    // causal, ran 7% slower), and in a head the longest first (causal rows
    // late in the sequence see more keys), so that the threads finish
    // together.
    tasks.sort_by_key(|t| {
        let work = t.rows.len() * rules.key_range(&t.rows).len();
        (t.head, std::cmp::Reverse(work))
    });
    let kv_heads = problem.batch * problem.heads_kv;
    let input = |x, cols, packing| PackInput {
        x,
        heads: kv_heads,
        rows: problem.seq_k,
        cols,
        packing,
    };
    let [k_packed, v_packed] = T::pack_inputs([
        input(k, d, Packing::Transposed),
        input(v, dv, Packing::Rows),
    ])?;
    let scale = T::from_f64(problem.scale);
    let pass = ForwardPass {
        problem,
        rules,
        tiles,
        layout: Layout { p: problem },
        k,
        k_packed: k_packed.as_deref(),
    };

    parallel::for_each(
        tasks,
        |RowTile {
             head,
             rows,
             outputs: [out, lse],
         }| {
            with_scratch(problem, tiles, |s: &mut Scratch<T>| {
                let m = rows.len();
                let kv_head = pass.layout.kv_head(head);
                let q_rows = pass.layout.q_rows(q, head, &rows);
                scale_into(q_rows, scale, &mut s.q_scaled[..m * d]);
                let values = Values {
                    v,
                    packed: v_packed.as_deref(),
                    head: kv_head,
                };
                pass.tiles(s, head, &rows, values);
                let sink = rules.sink(head);
                let finish = |state: &RowState<T>| match sink {
                    Some(sink) => state.finish_with_sink(sink),
                    None => state.finish(),
                };
                // docs/design.md#non-finite-inputs: a row whose lse is
                // finite but whose accumulator is not met a NaN or an
                // infinity in v, maybe of a key it does not see (0 times
                // NaN in a tile's product). Its task computes again on
                // values with those replaced by 0, and a row that sees
                // such a key has o = NaN.
                let acc_rows = s.acc[..m * dv].chunks_exact(dv.max(1));
                let redo = dv > 0
                    && !kernels::all_finite(&s.acc[..m * dv])
                    && s.states[..m]
                        .iter()
                        .zip(acc_rows)
                        .any(|(state, a)| finish(state).1.is_finite() && !kernels::all_finite(a));
                let mut poisoned = vec![false; if redo { m } else { 0 }];
                if redo {
                    let (v_head, bad) =
                        clean_rows(pass.layout.v_rows(v, kv_head, &(0..problem.seq_k)), dv);
                    let packed = T::pack_head(&v_head, problem.seq_k, dv, Packing::Rows);
                    let values = Values {
                        v: &v_head,
                        packed: packed.as_deref(),
                        head: 0,
                    };
                    pass.tiles(s, head, &rows, values);
                    for (i, p) in poisoned.iter_mut().enumerate() {
                        *p = bad
                            .iter()
                            .any(|&j| rules.pair_visible(head, rows.start + i, j));
                    }
                }

                for (i, state) in s.states[..m].iter().enumerate() {
                    let (normaliser, row_lse) = finish(state);
                    let normaliser = match poisoned.get(i) {
                        Some(true) if row_lse != T::NEG_INFINITY => T::NAN,
                        _ => normaliser * rules.keep_scale(),
                    };
                    let o_row = out[i * dv..(i + 1) * dv].iter_mut();
                    let acc_row = &s.acc[i * dv..(i + 1) * dv];
                    if normaliser == T::ZERO {
                        // No key, or the sink took everything: o = 0, also
                        // where hidden values left a NaN in acc.
                        for (o, &a) in o_row.zip(acc_row) {
                            o.write(if a.is_finite() {
                                a * normaliser
                            } else {
                                T::ZERO
                            });
                        }
                    } else {
                        for (o, &a) in o_row.zip(acc_row) {
                            o.write(a * normaliser);
                        }
                    }
                    lse[i].write(row_lse);
                }
            })
        },
    )?;
    // SAFETY: the tasks' rows partition both outputs, and each task wrote
    // every element of its rows (the loop over its rows' states above);
    // an interrupted call has returned above.
    unsafe {
        out.set_len(out_len);
        lse.set_len(lse_len);
    }
    Ok((out, lse))
}

/// Where a forward task reads the values: the input and its packed
/// panels with the key/value head to read, or one head of them with
/// non-finite values replaced (docs/design.md#non-finite-inputs).
#[derive(Clone, Copy)]
struct Values<'a, T> {
    v: &'a [T],
    packed: Option<&'a [T]>,
    head: usize,
}

/// What every forward task reads but its values.
struct ForwardPass<'a, T: Clone> {
    problem: &'a Problem,
    rules: &'a ScoreRules<'a, T>,
    tiles: TileSizes,
    layout: Layout<'a>,
    k: &'a [T],
    k_packed: Option<&'a [T]>,
}

impl<T: Element> ForwardPass<'_, T> {
    /// Folds every key tile the rows `rows` of flat head `head` see into
    /// `s.states` and `s.acc` (both reset first), from the scaled query rows
    /// in `s.q_scaled`.
    fn tiles(&self, s: &mut Scratch<T>, head: usize, rows: &Range<usize>, values: Values<'_, T>) {
        let (problem, rules, layout) = (self.problem, self.rules, &self.layout);
        let (d, dv) = (problem.head_dim, problem.value_dim);
        let m = rows.len();
        let kv_head = layout.kv_head(head);
        let q_scaled = &s.q_scaled[..m * d];
        let states = &mut s.states[..m];
        states.fill(RowState::EMPTY);
        let acc = &mut s.acc[..m * dv];
        acc.fill(T::ZERO);

        let mut key_tiles = std::mem::take(&mut s.key_tiles);
        rules.key_tiles(
            head,
            rows,
            rules.key_range(rows),
            self.tiles.k_rows,
            &mut key_tiles,
        );
        for keys in key_tiles.drain(..) {
            let visibility = rules.classify(head, rows, &keys);
            if visibility == TileVisibility::Hidden {
                continue;
            }
            let n = keys.len();
            let scores = &mut s.scores[..m * n];
            let k_rows = layout.k_rows(self.k, kv_head, &keys);
            let k_t = layout.packed_tile(self.k_packed, kv_head, d, &keys);
            // Scores the rules leave alone: their row maxima come
            // with the product, saving a pass over the tile.
            let plain = visibility == TileVisibility::Full && !rules.modifies_scores();
            let maxes = &mut s.maxes[..m];
            if plain {
                T::matmul_nt_row_max(
                    q_scaled,
                    k_rows,
                    k_t,
                    scores,
                    (m, d, n),
                    &mut s.pack,
                    maxes,
                    &mut s.lanes,
                );
            } else {
                T::matmul_nt(q_scaled, k_rows, k_t, scores, n, (m, d, n), &mut s.pack);
                rules.apply(head, visibility, rows, &keys, scores, n, None);
            }
            for (i, (state, row)) in states
                .iter_mut()
                .zip(scores.chunks_exact_mut(n))
                .enumerate()
            {
                let rescale = if plain {
                    state.absorb_with_max(row, maxes[i])
                } else {
                    state.absorb(row)
                };
                if rescale != T::ONE {
                    acc[i * dv..(i + 1) * dv]
                        .iter_mut()
                        .for_each(|x| *x *= rescale);
                }
            }
            // The softmax sums above saw every probability; only the
            // values are weighted by the dropout mask (and by 1/(1-p),
            // folded into the normaliser below).
            rules.apply_dropout(head, rows, &keys, scores, n, true);
            let v_rows = layout.v_rows(values.v, values.head, &keys);
            let v_tile = layout.row_panels(values.packed, values.head, dv, &keys);
            T::matmul_acc_packed(scores, n, v_rows, v_tile, acc, (m, n, dv));
        }
        s.key_tiles = key_tiles;
    }
}

/// `x` (rows of `width`) with every NaN and infinity replaced by 0, and
/// the rows that held any.
fn clean_rows<T: Element>(x: &[T], width: usize) -> (Vec<T>, Vec<usize>) {
    let mut bad = Vec::new();
    let mut clean = x.to_vec();
    for (j, row) in clean.chunks_exact_mut(width.max(1)).enumerate() {
        if row.iter().any(|x| !x.is_finite()) {
            bad.push(j);
            row.iter_mut()
                .filter(|x| !x.is_finite())
                .for_each(|x| *x = T::ZERO);
        }
    }
    (clean, bad)
}

/// One key/value tile as the tile products read it: rows, and the same
/// transposed (with its row stride) when the kernels prefer that.
struct KvTile<'a, T> {
    k_rows: &'a [T],
    v_rows: &'a [T],
    k_t: Option<&'a [T]>,
    v_t: Option<&'a [T]>,
    /// Key rows packed for `dQ += dS·K`.
    k_panels: Option<(&'a [T], usize)>,
}

struct BackwardInputs<'a, T> {
    d_out: &'a [T],
    q: &'a [T],
    k: &'a [T],
    /// `k` and `v` transposed per head, when the kernels want them.
    k_packed: Option<&'a [T]>,
    v_packed: Option<&'a [T]>,
    k_row_panels: Option<&'a [T]>,
    v: &'a [T],
    out: &'a [T],
    lse: &'a [T],
}

/// Where the full score gradient `dS` goes when the float mask's gradient
/// is wanted: `(batch·heads_q, seq_q, seq_k)`, written by many tasks at
/// once. Each element belongs to exactly one key tile of one key/value
/// head, hence to one task, so the writes never overlap.
struct ScoreGradientSink<T> {
    data: *mut T,
    seq_q: usize,
    seq_k: usize,
}

// SAFETY: tasks write disjoint elements (see above) and the buffer
// outlives the parallel loop that writes it.
unsafe impl<T: Send> Send for ScoreGradientSink<T> {}
unsafe impl<T: Send> Sync for ScoreGradientSink<T> {}

impl<T: Copy> ScoreGradientSink<T> {
    /// Copies `tile` (rows `ld` apart) to its place.
    fn write(&self, head: usize, rows: &Range<usize>, keys: &Range<usize>, tile: &[T], ld: usize) {
        let n = keys.len();
        for (r, line) in rows.clone().zip(tile.chunks(ld)) {
            let offset = (head * self.seq_q + r) * self.seq_k + keys.start;
            // SAFETY: in bounds by construction (r < seq_q, keys ⊆ 0..seq_k)
            // and written by this task only.
            unsafe {
                std::ptr::copy_nonoverlapping(line.as_ptr(), self.data.add(offset), n);
            }
        }
    }
}

/// The per-tile inputs of the backward's recomputation.
struct TileRows<'a, T> {
    /// Flat (batch, query head).
    head: usize,
    rows: &'a Range<usize>,
    keys: &'a Range<usize>,
    visibility: TileVisibility,
    q_scaled: &'a [T],
    d_out_rows: &'a [T],
    lse_rows: &'a [T],
    delta_rows: &'a [T],
}

/// A backward task's inputs for its exact pass (docs/design.md#non-finite-inputs):
/// its key/value head of k with every NaN and infinity replaced by 0 (and
/// packed), for `dQ += dS K`, and which of its keys held any.
struct ExactKeys<T> {
    k_rows: Vec<T>,
    k_panels: Option<Vec<T>>,
    bad_k: Vec<bool>,
}

/// How a query row enters the backward (docs/design.md#non-finite-inputs).
#[derive(Clone, Copy, PartialEq, Eq)]
enum RowKind {
    /// Its lse is `-inf`: it saw no key, and contributes nothing.
    Empty,
    /// Its lse is NaN or `+inf`, or its `D = rowsum(dO ∘ O)` is not
    /// finite: NaN through every key it sees.
    Poisoned,
    Normal,
}

fn row_kind<T: Element>(lse: T, delta: T) -> RowKind {
    if lse == T::NEG_INFINITY {
        RowKind::Empty
    } else if lse.is_finite() && delta.is_finite() {
        RowKind::Normal
    } else {
        RowKind::Poisoned
    }
}

/// Recomputes one tile of probabilities and their score gradients:
/// `P · Z` (what multiplied V in the forward) into `scores` and `dU`, the
/// gradient of the scaled scores `u`, into `d_scores`, both (and `tanh`)
/// with rows `ld` apart; see [`crate::variants`] for the formulas.
///
/// A row that is [`RowKind::Poisoned`] gets NaN probabilities throughout,
/// which makes the task's outputs non-finite and has it run its exact
/// pass. In that pass (`exact`, with the keys whose k is not finite),
/// hidden pairs get exactly 0 in both tiles, poisoned rows NaN at the
/// keys they see, and `poison_dq` marks the rows whose dQ is NaN because
/// they see a key whose k is not finite.
#[allow(clippy::too_many_arguments)]
fn recompute_tile<T: Element>(
    problem: &Problem,
    rules: &ScoreRules<'_, T>,
    t: &TileRows<'_, T>,
    kv: &KvTile<'_, T>,
    s: &mut Scratch<T>,
    ld: usize,
    d_scores_sink: Option<&ScoreGradientSink<T>>,
    mut exact: Option<(&[bool], &mut [bool])>,
) {
    let (d, dv) = (problem.head_dim, problem.value_dim);
    let (m, n) = (t.rows.len(), t.keys.len());
    let (scores, d_scores) = (&mut s.scores[..m * ld], &mut s.d_scores[..m * ld]);
    T::matmul_nt(
        t.q_scaled,
        kv.k_rows,
        kv.k_t,
        scores,
        ld,
        (m, d, n),
        &mut s.pack,
    );
    let softcap = rules.softcap();
    if t.visibility == TileVisibility::Partial || rules.modifies_scores() {
        let tanh = softcap.map(|_| &mut s.tanh[..m * ld]);
        rules.apply(t.head, t.visibility, t.rows, t.keys, scores, ld, tanh);
    }
    for ((row, &l), &delta) in scores
        .chunks_exact_mut(ld)
        .zip(t.lse_rows)
        .zip(t.delta_rows)
    {
        let row = &mut row[..n];
        match row_kind(l, delta) {
            // The row saw no key in the forward: its probabilities are 0,
            // and exp(s - lse) would be exp(-inf + inf) = NaN.
            RowKind::Empty => row.fill(T::ZERO),
            RowKind::Poisoned => row.fill(T::NAN),
            RowKind::Normal => {
                T::exp_shifted_sum(row, l);
            }
        }
    }
    T::matmul_nt(
        t.d_out_rows,
        kv.v_rows,
        kv.v_t,
        d_scores,
        ld,
        (m, dv, n),
        &mut s.pack,
    );
    if rules.has_dropout() {
        rules.apply_dropout(t.head, t.rows, t.keys, d_scores, ld, false);
    }
    for ((ds_row, p_row), &delta) in d_scores
        .chunks_exact_mut(ld)
        .zip(scores.chunks_exact(ld))
        .zip(t.delta_rows)
    {
        for (ds, &p) in ds_row[..n].iter_mut().zip(&p_row[..n]) {
            *ds = p * (*ds - delta);
        }
    }
    // In the exact pass: each pair's kind, applied to both tiles.
    let kind_of = |i: usize, j: usize| {
        let kind = row_kind(t.lse_rows[i], t.delta_rows[i]);
        let seen = kind != RowKind::Empty
            && rules.pair_visible(t.head, t.rows.start + i, t.keys.start + j);
        (kind, seen)
    };
    let fix = |tile: &mut [T]| {
        for (i, row) in tile.chunks_exact_mut(ld).enumerate() {
            for (j, x) in row[..n].iter_mut().enumerate() {
                match kind_of(i, j) {
                    (_, false) => *x = T::ZERO,
                    (RowKind::Poisoned, true) => *x = T::NAN,
                    _ => {}
                }
            }
        }
    };
    if let Some((bad_k, poison_dq)) = exact.as_mut() {
        fix(d_scores);
        for (i, poison) in poison_dq.iter_mut().enumerate() {
            *poison =
                (0..n).any(|j| bad_k[t.keys.start + j] && kind_of(i, j) == (RowKind::Normal, true));
        }
    }
    if let Some(sink) = d_scores_sink {
        match &exact {
            // The gradient of a score whose key's k is not finite is NaN.
            Some((bad_k, poison_dq)) if poison_dq.iter().any(|&p| p) => {
                let mut marked = d_scores.to_vec();
                for (i, row) in marked.chunks_exact_mut(ld).enumerate() {
                    for (j, x) in row[..n].iter_mut().enumerate() {
                        if bad_k[t.keys.start + j] && kind_of(i, j) == (RowKind::Normal, true) {
                            *x = T::NAN;
                        }
                    }
                }
                sink.write(t.head, t.rows, t.keys, &marked, ld);
            }
            _ => sink.write(t.head, t.rows, t.keys, d_scores, ld),
        }
    }
    if softcap.is_some() {
        for (ds_row, th_row) in d_scores
            .chunks_exact_mut(ld)
            .zip(s.tanh[..m * ld].chunks_exact(ld))
        {
            for (ds, &th) in ds_row[..n].iter_mut().zip(&th_row[..n]) {
                *ds *= T::ONE - th * th;
            }
        }
    }
    if rules.has_dropout() {
        rules.apply_dropout(t.head, t.rows, t.keys, scores, ld, false);
    }
    if exact.is_some() {
        // After softcap (whose tanh may be NaN where a key is hidden) and
        // dropout (which zeroes a poisoned row's dropped pairs).
        fix(scores);
        if softcap.is_some() {
            fix(d_scores);
        }
    }
}

/// One chunk of key tiles of one key/value head in the backward:
/// recomputes P and dS against every query row that reads the chunk,
/// accumulates the chunk's dK and dV, and adds its contribution to the
/// head group's dQ partial (unscaled).
struct ChunkStep<'a, T: Clone> {
    problem: &'a Problem,
    rules: &'a ScoreRules<'a, T>,
    tiles: TileSizes,
    x: &'a BackwardInputs<'a, T>,
    d_scores_sink: Option<&'a ScoreGradientSink<T>>,
}

impl<T: Element> ChunkStep<'_, T> {
    /// Computes a task's outputs (zero on entry). Where NaN or infinities
    /// in the inputs, or a poisoned row, may have reached them, computes
    /// them again in the exact pass (see [`recompute_tile`]), which follows
    /// docs/design.md#non-finite-inputs to the letter where the products
    /// would not (0 times NaN where a key is hidden). A non-finite dS or
    /// P, or a NaN or infinity in q, dO or v, shows in dK or dV; one in k
    /// may show in dQ alone, so the chunk's k rows are checked instead of
    /// the (larger) dQ partial.
    fn run(
        &self,
        s: &mut Scratch<T>,
        kv_head: usize,
        chunk: &Range<usize>,
        dk: &mut [T],
        dv_out: &mut [T],
        dq_group: &mut [T],
    ) {
        self.pass(s, kv_head, chunk, dk, dv_out, dq_group, None);
        let (problem, layout) = (self.problem, Layout { p: self.problem });
        let k_chunk = layout.k_rows(self.x.k, kv_head, chunk);
        if [&*dk, &*dv_out, k_chunk]
            .into_iter()
            .all(kernels::all_finite)
        {
            return;
        }
        let d = problem.head_dim;
        let (k_rows, bad) = clean_rows(layout.k_rows(self.x.k, kv_head, &(0..problem.seq_k)), d);
        let mut bad_k = vec![false; problem.seq_k];
        bad.into_iter().for_each(|j| bad_k[j] = true);
        let exact = ExactKeys {
            k_panels: T::pack_head(&k_rows, problem.seq_k, d, Packing::Rows),
            k_rows,
            bad_k,
        };
        for x in [&mut *dk, &mut *dv_out, &mut *dq_group] {
            x.fill(T::ZERO);
        }
        self.pass(s, kv_head, chunk, dk, dv_out, dq_group, Some(&exact));
    }

    /// `dk` and `dv` are the chunk's rows of dK and dV (zero on entry).
    ///
    /// Query blocks outside, key tiles inside: a block's rows are scaled and
    /// packed once for all the chunk's tiles. Each gradient still receives
    /// its terms in the order of the tile-outside loop (for a key tile:
    /// head, then query block; for a block of dQ: key tile), so the bits
    /// are those of that order.
    ///
    /// With `exact`, the products read q, dO and k with every NaN and
    /// infinity replaced by 0 (the scores and D still read them as given).
    #[allow(clippy::too_many_arguments)]
    fn pass(
        &self,
        s: &mut Scratch<T>,
        kv_head: usize,
        chunk: &Range<usize>,
        dk: &mut [T],
        dv_out: &mut [T],
        dq_group: &mut [T],
        exact: Option<&ExactKeys<T>>,
    ) {
        let (problem, x) = (self.problem, self.x);
        let (d, dv) = (problem.head_dim, problem.value_dim);
        let layout = Layout { p: problem };
        let scale = T::from_f64(problem.scale);
        let mut q_scaled = std::mem::take(&mut s.q_scaled);
        let mut q_panels = std::mem::take(&mut s.q_panels);
        let mut d_out_panels = std::mem::take(&mut s.d_out_panels);
        let mut delta = std::mem::take(&mut s.delta);
        let mut segments = std::mem::take(&mut s.key_tiles);
        // The exact pass's cleaned block rows and rows to poison.
        let (mut q_clean, mut d_out_clean, mut poison_dq) = (Vec::new(), Vec::new(), Vec::new());
        let group = problem.group_size();
        let (batch, kv_index) = (kv_head / problem.heads_kv, kv_head % problem.heads_kv);
        let k_rows = self.tiles.k_rows;
        'blocks: for g in 0..group {
            let head = batch * problem.heads_q + kv_index * group + g;
            for rows in self.rules.row_blocks(self.tiles.q_block) {
                // A task visits every query row: long at long sequences.
                if parallel::stopping() {
                    break 'blocks;
                }
                let m = rows.len();
                let d_out_given = layout.o_rows(x.d_out, head, &rows);
                // Panel strides of the packed rows, once a tile needs them.
                let mut packed: Option<(Option<usize>, Option<usize>)> = None;
                // Keys past the block's last visible one (causal) or before
                // its first (window) are not computed at all: a tile across
                // the diagonal is cut where the block stops seeing keys, not
                // computed whole and masked (a fifth of the work at
                // (1,8,1024,64) causal).
                let visible = self.rules.key_range(&rows);
                for keys in key_tiles(chunk.clone(), k_rows) {
                    let keys = keys.start.max(visible.start)..keys.end.min(visible.end);
                    if keys.is_empty() {
                        continue;
                    }
                    // With a block-sparse mask, only the visible parts of
                    // the key tile (the whole tile without a mask).
                    self.rules
                        .key_tiles(head, &rows, keys, k_rows, &mut segments);
                    for part in segments.iter() {
                        let visibility = self.rules.classify(head, &rows, part);
                        if visibility == TileVisibility::Hidden {
                            continue;
                        }
                        let n = part.len();
                        let (q_stride, d_out_stride) = *packed.get_or_insert_with(|| {
                            let q_rows = layout.q_rows(x.q, head, &rows);
                            scale_into(q_rows, scale, &mut q_scaled[..m * d]);
                            // D = rowsum(dO ∘ O): the term of dS that comes
                            // from the softmax normaliser, once per block
                            // (here rather than in a pass of its own: a pass
                            // costs a hand-over to the helper threads).
                            let o_rows = layout.o_rows(x.out, head, &rows);
                            for (i, delta) in delta[..m].iter_mut().enumerate() {
                                let (o, g) = (
                                    &o_rows[i * dv..(i + 1) * dv],
                                    &d_out_given[i * dv..(i + 1) * dv],
                                );
                                *delta = o.iter().zip(g).fold(T::ZERO, |a, (&o, &g)| a + o * g);
                            }
                            if exact.is_some() {
                                q_clean = clean_rows(&q_scaled[..m * d], d).0;
                                d_out_clean = clean_rows(d_out_given, dv).0;
                                poison_dq = vec![false; m];
                            }
                            let (q_rows, d_out_rows) = match exact {
                                Some(_) => (&q_clean[..], &d_out_clean[..]),
                                None => (&q_scaled[..m * d], d_out_given),
                            };
                            (
                                T::pack_rows(q_rows, m, d, &mut q_panels),
                                T::pack_rows(d_out_rows, m, dv, &mut d_out_panels),
                            )
                        });
                        // What the products read: the inputs, or in the
                        // exact pass their cleaned copies.
                        let (q_product, d_out_rows) = match exact {
                            Some(_) => (&q_clean[..], &d_out_clean[..]),
                            None => (&q_scaled[..m * d], d_out_given),
                        };
                        let kv = layout.kv_tile(x, kv_head, part);
                        let (k_product, k_panels) = match exact {
                            Some(e) => (
                                &e.k_rows[part.start * d..part.end * d],
                                layout.row_panels(e.k_panels.as_deref(), 0, d, part),
                            ),
                            None => (kv.k_rows, kv.k_panels),
                        };
                        let tile = TileRows {
                            head,
                            rows: &rows,
                            keys: part,
                            visibility,
                            q_scaled: &q_scaled[..m * d],
                            d_out_rows,
                            lse_rows: layout.row_scalars(x.lse, head, &rows),
                            delta_rows: &delta[..m],
                        };
                        let ld = tiles::score_stride(n, std::mem::size_of::<T>());
                        let marks = exact.map(|e| (&e.bad_k[..], &mut poison_dq[..]));
                        recompute_tile(
                            problem,
                            self.rules,
                            &tile,
                            &kv,
                            s,
                            ld,
                            self.d_scores_sink,
                            marks,
                        );
                        let (scores, d_scores) = (&s.scores[..m * ld], &s.d_scores[..m * ld]);
                        let local = part.start - chunk.start..part.end - chunk.start;
                        T::matmul_t_acc_packed(
                            scores,
                            ld,
                            d_out_rows,
                            d_out_stride.map(|stride| (&d_out_panels[..], stride)),
                            &mut dv_out[local.start * dv..local.end * dv],
                            (m, n, dv),
                        );
                        // q_scaled carries the softmax scale: dK = scale · dSᵀ Q.
                        T::matmul_t_acc_packed(
                            d_scores,
                            ld,
                            q_product,
                            q_stride.map(|stride| (&q_panels[..], stride)),
                            &mut dk[local.start * d..local.end * d],
                            (m, n, d),
                        );
                        let first = g * problem.seq_q;
                        let dq_rows =
                            &mut dq_group[(first + rows.start) * d..(first + rows.end) * d];
                        T::matmul_acc_packed(d_scores, ld, k_product, k_panels, dq_rows, (m, n, d));
                        if exact.is_some() {
                            for (row, _) in dq_rows
                                .chunks_exact_mut(d.max(1))
                                .zip(&poison_dq)
                                .filter(|(_, &p)| p)
                            {
                                row.fill(T::NAN);
                            }
                        }
                    }
                }
            }
        }
        s.q_scaled = q_scaled;
        s.q_panels = q_panels;
        s.d_out_panels = d_out_panels;
        s.delta = delta;
        s.key_tiles = segments;
    }
}

type BackwardResult<T> = (Vec<T>, Vec<T>, Vec<T>, Option<Vec<T>>);

fn backward_typed<T: Element>(
    problem: &Problem,
    rules: &ScoreRules<'_, T>,
    tiles: TileSizes,
    x: &BackwardInputs<'_, T>,
) -> Result<BackwardResult<T>> {
    reserve_scratch::<T>(problem, tiles)?;
    let d = problem.head_dim;
    let scale = T::from_f64(problem.scale);

    // One task per (key/value head, chunk of its key tiles): it owns dK and
    // dV of those keys, and loops over every query row that reads them (all
    // heads of its GQA group), so no two tasks write the same gradient and
    // no atomics are needed. It also accumulates those keys' contribution
    // to dQ into a partial of its own, so P and dS are recomputed once; the
    // partials are summed in chunk order afterwards. The chunk count
    // depends on the problem only, so the bits do not depend on threads.
    let kv_heads = problem.batch * problem.heads_kv;
    let key_tile_count = problem.seq_k.div_ceil(tiles.k_rows);
    let chunks = tiles::backward_key_chunks(kv_heads, key_tile_count);
    let group_len = problem.group_size() * problem.seq_q * d;
    let (q_len, k_len, v_len) = (problem.q_len(), problem.k_len(), problem.v_len());
    let (mut dq, mut dk, mut dvv) = (
        buffers::try_with_capacity(q_len, "the gradient dq")?,
        buffers::try_with_capacity(k_len, "the gradient dk")?,
        buffers::try_with_capacity(v_len, "the gradient dv")?,
    );
    // The first chunk of a head accumulates straight into dQ (0 + its
    // partial is its partial), the others into partials of their own.
    let partials_len = kv_heads * (chunks - 1) * group_len;
    let mut partials = T::pool().take(partials_len, "the backward's partial dq sums")?;
    // Zeroed by their tasks, whatever an earlier call left in them.
    partials.vec_mut().clear();
    let mut tasks = chunk_tasks(
        problem,
        tiles,
        chunks,
        [spare(&mut dk, k_len), spare(&mut dvv, v_len)],
        [
            spare(&mut dq, q_len),
            spare(partials.vec_mut(), partials_len),
        ],
    );
    // Head by head, the longest first (see the forward).
    tasks.sort_by_cached_key(|t| {
        let blocks = rules.row_blocks(tiles.q_block);
        let pairs: usize = blocks
            .into_iter()
            .map(|rows| {
                let seen = rules.key_range(&rows);
                let keys = seen.start.max(t.keys.start)..seen.end.min(t.keys.end);
                rows.len() * keys.len()
            })
            .sum();
        (t.kv_head, std::cmp::Reverse(pairs))
    });
    // Scores no task visits (hidden tiles) have a zero gradient.
    // Counted in u128: batch × heads × seq_q × seq_k can pass usize.
    let d_scores_len =
        usize::try_from(problem.lse_len() as u128 * problem.seq_k as u128).unwrap_or(usize::MAX);
    let mut d_scores_full = match problem.return_dmask {
        true => Some(buffers::try_zeros(
            d_scores_len,
            "return_dmask=True (the gradient of every score before it is summed to the mask's shape)",
        )?),
        false => None,
    };
    let d_scores_sink = d_scores_full.as_mut().map(|full| ScoreGradientSink {
        data: full.as_mut_ptr(),
        seq_q: problem.seq_q,
        seq_k: problem.seq_k,
    });
    let step = ChunkStep {
        problem,
        rules,
        tiles,
        x,
        d_scores_sink: d_scores_sink.as_ref(),
    };
    parallel::for_each(tasks, |task| {
        with_scratch(problem, tiles, |s: &mut Scratch<T>| {
            let [dk_chunk, dv_chunk, partial] = task.outputs.map(zero_init);
            step.run(s, task.kv_head, &task.keys, dk_chunk, dv_chunk, partial);
        })
    })?;
    // SAFETY: the tasks' chunks partition dK and dV, their dQ groups and
    // partials partition dQ and the partials, and each task initialised
    // its parts (`zero_init`) before anything else; an interrupted call,
    // some of whose tasks never ran, has returned above.
    unsafe {
        dq.set_len(q_len);
        dk.set_len(k_len);
        dvv.set_len(v_len);
        partials.vec_mut().set_len(partials_len);
    }

    if group_len > 0 {
        let per_head = (chunks - 1) * group_len;
        parallel::for_each(
            dq.chunks_mut(group_len).enumerate().collect(),
            |(kv_head, dq_group)| {
                let head_partials = &partials[kv_head * per_head..(kv_head + 1) * per_head];
                for partial in head_partials.chunks_exact(group_len) {
                    dq_group.iter_mut().zip(partial).for_each(|(q, &p)| *q += p);
                }
                dq_group.iter_mut().for_each(|q| *q *= scale);
            },
        )?;
    }
    Ok((dq, dk, dvv, d_scores_full))
}

/// A backward task: one key/value head, the keys of a chunk of its key
/// tiles, and the outputs it owns: those keys' rows of dK and dV, and the
/// head group's dQ (first chunk) or a dQ partial (the others).
struct ChunkTask<'a, T> {
    kv_head: usize,
    keys: Range<usize>,
    outputs: [&'a mut [T]; 3],
}

/// Cuts `[dK, dV]` by chunks of keys and `[dQ, partials]` by head group
/// and chunk (partials hold chunks 1.. of each head).
fn chunk_tasks<'a, T>(
    problem: &Problem,
    tiles: TileSizes,
    chunks: usize,
    key_outputs: [&'a mut [T]; 2],
    query_outputs: [&'a mut [T]; 2],
) -> Vec<ChunkTask<'a, T>> {
    let (d, dv) = (problem.head_dim, problem.value_dim);
    let group_len = problem.group_size() * problem.seq_q * d;
    let key_tile_count = problem.seq_k.div_ceil(tiles.k_rows);
    let [mut dk, mut dv_rest] = key_outputs;
    let [mut dq, mut partials] = query_outputs;
    let cut = |rest: &mut &'a mut [T], len: usize| {
        let (mine, tail) = std::mem::take(rest).split_at_mut(len);
        *rest = tail;
        mine
    };
    let mut tasks = Vec::new();
    for kv_head in 0..problem.batch * problem.heads_kv {
        for chunk in 0..chunks {
            let first_tile = chunk * key_tile_count / chunks;
            let end_tile = (chunk + 1) * key_tile_count / chunks;
            let keys = (first_tile * tiles.k_rows).min(problem.seq_k)
                ..(end_tile * tiles.k_rows).min(problem.seq_k);
            let dk_part = cut(&mut dk, keys.len() * d);
            let dv_part = cut(&mut dv_rest, keys.len() * dv);
            let dq_part = if chunk == 0 {
                cut(&mut dq, group_len)
            } else {
                cut(&mut partials, group_len)
            };
            tasks.push(ChunkTask {
                kv_head,
                keys,
                outputs: [dk_part, dv_part, dq_part],
            });
        }
    }
    tasks
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::interrupt;
    use std::ffi::OsStr;

    #[test]
    fn thread_counts_are_bounded_and_every_bad_value_is_an_error() {
        let parse = |text: &str| parse_num_threads(Some(OsStr::new(text)), 2);
        assert_eq!(parse_num_threads(None, 6), Ok(6));
        assert_eq!(parse("3"), Ok(3));
        assert_eq!(parse(" 64 "), Ok(64));
        assert_eq!(parse("1024"), Ok(MAX_THREADS));
        // A machine with more cores than the bound may use them all.
        assert_eq!(parse_num_threads(Some(OsStr::new("2048")), 2048), Ok(2048));
        for bad in [
            "4294967297",
            "1025",
            "0",
            "-1",
            "",
            "  ",
            "two",
            "1.5",
            "99999999999999999999999",
        ] {
            match parse(bad) {
                Err(Error::Value {
                    argument,
                    value,
                    reason,
                }) => {
                    assert_eq!(argument, NUM_THREADS_ENV);
                    assert_eq!(value, format!("{bad:?}"));
                    assert!(reason.contains("from 1 to 1024"), "{reason}");
                }
                other => panic!("{bad:?} gave {other:?}"),
            }
        }
    }

    #[test]
    fn an_interrupted_call_returns_no_result_and_the_next_call_computes() {
        use crate::{validate_backward, validate_forward, ArrayInfo, Options};
        use std::cell::Cell;
        use std::rc::Rc;
        use std::time::Duration;
        let shape = [1, 2, 512, 32];
        let lse_shape = [1, 2, 512];
        let info = |shape| ArrayInfo::new(shape, "float64");
        let options = Options::default();
        let problem = validate_forward(info(&shape), info(&shape), info(&shape), &options).unwrap();
        let x: Vec<f64> = (0..problem.q_len()).map(|i| (i % 7) as f64 * 0.1).collect();
        let x = Slice::F64(&x);
        let none = VariantArrays::default();
        let forward_call = || forward(&problem, x, x, x, &none);
        let asked = Rc::new(Cell::new(0));
        let stop_at_once = |f: &dyn Fn() -> bool| {
            let counter = asked.clone();
            interrupt::with_check_every(
                Duration::ZERO,
                move || {
                    counter.set(counter.get() + 1);
                    true
                },
                f,
            )
        };
        let interrupted = stop_at_once(&|| forward_call() == Err(Error::Interrupted));
        assert!(interrupted);
        let done = forward_call().unwrap();
        let (Buffer::F64(out), Buffer::F64(lse)) = (&done.out, &done.lse) else {
            unreachable!()
        };

        let problem = validate_backward(
            info(&shape),
            info(&shape),
            info(&shape),
            info(&shape),
            info(&shape),
            info(&lse_shape),
            &options,
        )
        .unwrap();
        let inputs = [x, x, x, x, Slice::F64(out), Slice::F64(lse)];
        let backward_call = || backward(&problem, inputs, &none);
        let interrupted = stop_at_once(&|| backward_call() == Err(Error::Interrupted));
        assert!(interrupted);
        assert_eq!(asked.get(), 2, "asked once per call");
        assert!(backward_call().is_ok());
        // A check that lets the call go on changes nothing.
        let checked = interrupt::with_check_every(Duration::ZERO, || false, forward_call);
        assert_eq!(checked.unwrap(), done);
    }

    #[cfg(unix)]
    #[test]
    fn a_value_that_is_not_text_is_an_error() {
        use std::os::unix::ffi::OsStrExt;
        let err = parse_num_threads(Some(OsStr::from_bytes(b"4\xff")), 2).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("FLASHPORT_NUM_THREADS=\"4\u{fffd}\""),
            "{err}"
        );
    }
}
