//! `attention_with_kvcache` on the CPU (see [`crate::decode`]): one task
//! per (sequence, key/value head, key split) holds every query row of the
//! head's GQA group, so each cached key and value is read once per group;
//! the splits' states are then merged in split order.
//!
//! A task walks its keys in tiles of [`TILE_KEYS`]. A tile is the list
//! of the cache offsets of its keys' rows (through the block table when
//! paged), and its two products read those rows where they lie, float16
//! and bfloat16 widened in registers ([`kernels`]): the cache is never
//! copied or converted, and only the keys read are touched. The tile's
//! scores go through the same variant rules and online softmax
//! (`RowState`) as [`super::forward`]'s.

use std::any::TypeId;
use std::borrow::Cow;
use std::ops::Range;

use half::slice::HalfFloatSliceExt;

use super::element::Element;
use super::kernels::all_finite;
use super::merge::merge_row;
use super::num_threads;
use super::scores::{ScoreRules, TileVisibility};
use super::softmax::RowState;
use super::threads::run_with;
use crate::array::{Buffer, Slice};
use crate::error::Result;
use crate::output::ForwardOutput;
use crate::problem::{CacheLayout, DType, KvCacheProblem, Problem};
use crate::splits::{cpu_splits, split_keys};
use crate::variants::VariantArrays;

mod kernels;
use crate::runtime::parallel;
use kernels::{Ahead, CacheElement};

/// Keys per tile: also how far ahead of the products their rows are
/// prefetched. The keys and values of a tile of d = 128 in float32 take
/// 32 KiB, which stay in L2 (the product with the values reads them once
/// per 16 columns) beside the next tile's. 32 read 5-10% faster than 64
/// or 128 on the 2-core development VM.
pub const TILE_KEYS: usize = 32;

/// Decodes on the CPU from host slices.
pub fn attention_with_kvcache(
    problem: &KvCacheProblem,
    q: Slice<'_>,
    k_cache: Slice<'_>,
    v_cache: Slice<'_>,
    variants: &VariantArrays<'_>,
) -> Result<ForwardOutput> {
    match problem.dtype() {
        DType::F64 => decode_as::<f64>(problem, q, k_cache, v_cache, variants),
        DType::F32 => decode_as::<f32>(problem, q, k_cache, v_cache, variants),
        DType::F16 | DType::BF16 => {
            let r = decode_as::<f32>(problem, q, k_cache, v_cache, variants)?;
            Ok(ForwardOutput {
                out: narrow_slice(r.out, problem.dtype()),
                lse: r.lse,
            })
        }
    }
}

/// A float32 output rounded to the float16 or bfloat16 inputs' type by
/// slices (F16C for float16): one element at a time, the queries and
/// outputs of batch 8 took 0.09 ms longer (about 2% of a decode over 4k
/// keys).
fn narrow_slice(out: Buffer, dtype: DType) -> Buffer {
    match (out, dtype) {
        (Buffer::F32(x), DType::F16) => {
            let mut y = vec![half::f16::ZERO; x.len()];
            y.convert_from_f32_slice(&x);
            Buffer::F16(y)
        }
        (Buffer::F32(x), DType::BF16) => {
            let mut y = vec![half::bf16::ZERO; x.len()];
            y.convert_from_f32_slice(&x);
            Buffer::BF16(y)
        }
        (other, _) => other,
    }
}

/// The queries in the compute type: [`Element::view`], with float16 and
/// bfloat16 widened by slices (see [`narrow_slice`]).
fn queries<T: Element>(q: Slice<'_>) -> Cow<'_, [T]> {
    let half = matches!(q, Slice::F16(_) | Slice::BF16(_));
    if !half || TypeId::of::<T>() != TypeId::of::<f32>() {
        return T::view(q);
    }
    let mut wide = vec![T::ZERO; q.len()];
    let dst = as_f32_mut(&mut wide).expect("T is f32");
    match q {
        Slice::F16(x) => x.convert_to_f32_slice(dst),
        Slice::BF16(x) => x.convert_to_f32_slice(dst),
        _ => unreachable!("a half type"),
    }
    Cow::Owned(wide)
}

/// A cache as the tasks read it: in the compute type, or float16 or
/// bfloat16 to be widened row by row.
enum Cache<'a, T> {
    Same(&'a [T]),
    Half(&'a [half::f16]),
    Brain(&'a [half::bf16]),
}

impl<'a, T: Element + CacheElement> Cache<'a, T> {
    fn new(s: Slice<'a>) -> Self {
        match s {
            Slice::F16(x) => Cache::Half(x),
            Slice::BF16(x) => Cache::Brain(x),
            // Validation gave the caches the problem's dtype, which is T's.
            other => match T::view(other) {
                std::borrow::Cow::Borrowed(x) => Cache::Same(x),
                std::borrow::Cow::Owned(_) => unreachable!("the cache has the compute type"),
            },
        }
    }

    /// The elements of `out.len()` from `start`, in the compute type.
    fn read(&self, start: usize, out: &mut [T]) {
        let end = start + out.len();
        match self {
            Cache::Same(x) => out.copy_from_slice(&x[start..end]),
            Cache::Half(x) => out
                .iter_mut()
                .zip(&x[start..end])
                .for_each(|(o, &h)| *o = h.to()),
            Cache::Brain(x) => out
                .iter_mut()
                .zip(&x[start..end])
                .for_each(|(o, &h)| *o = h.to()),
        }
    }

    /// The rows of `width` elements at `starts`, to prefetch.
    fn ahead<'s>(&self, starts: &'s [usize], width: usize) -> Ahead<'s> {
        match self {
            Cache::Same(x) => Ahead::new(x, starts, width),
            Cache::Half(x) => Ahead::new(x, starts, width),
            Cache::Brain(x) => Ahead::new(x, starts, width),
        }
    }

    /// `out[r * ld + j] = q[r] · row j` ([`kernels::scores`]): `q` is
    /// `rows × d`, row j starts at element `starts[j]`.
    #[allow(clippy::too_many_arguments)]
    fn scores(
        &self,
        q: &[T],
        shape: (usize, usize),
        starts: &[usize],
        out: &mut [T],
        ld: usize,
        ahead: Ahead<'_>,
        scratch: &mut [T],
    ) {
        if let (Some(q), Some(out)) = (as_f32(q), as_f32_mut(out)) {
            if kernels::available() {
                use kernels::scores;
                return match self {
                    Cache::Same(x) => scores(q, shape, as_f32(x).unwrap(), starts, out, ld, ahead),
                    Cache::Half(x) => scores(q, shape, x, starts, out, ld, ahead),
                    Cache::Brain(x) => scores(q, shape, x, starts, out, ld, ahead),
                };
            }
        }
        use kernels::portable::scores;
        match self {
            Cache::Same(x) => scores(q, shape, x, starts, out, ld, scratch),
            Cache::Half(x) => scores(q, shape, x, starts, out, ld, scratch),
            Cache::Brain(x) => scores(q, shape, x, starts, out, ld, scratch),
        }
    }

    /// `acc[r] += Σ_j p[r * ldp + j] · row j` ([`kernels::accumulate`]):
    /// `acc` is `rows × dv`, row j starts at element `starts[j]`.
    #[allow(clippy::too_many_arguments)]
    fn accumulate(
        &self,
        p: &[T],
        ldp: usize,
        starts: &[usize],
        acc: &mut [T],
        shape: (usize, usize),
        ahead: Ahead<'_>,
        scratch: &mut [T],
    ) {
        if let (Some(p), Some(acc)) = (as_f32(p), as_f32_mut(acc)) {
            if kernels::available() {
                use kernels::accumulate;
                return match self {
                    Cache::Same(x) => {
                        accumulate(p, ldp, as_f32(x).unwrap(), starts, acc, shape, ahead)
                    }
                    Cache::Half(x) => accumulate(p, ldp, x, starts, acc, shape, ahead),
                    Cache::Brain(x) => accumulate(p, ldp, x, starts, acc, shape, ahead),
                };
            }
        }
        use kernels::portable::accumulate;
        match self {
            Cache::Same(x) => accumulate(p, ldp, x, starts, acc, shape, scratch),
            Cache::Half(x) => accumulate(p, ldp, x, starts, acc, shape, scratch),
            Cache::Brain(x) => accumulate(p, ldp, x, starts, acc, shape, scratch),
        }
    }
}

/// `x` as float32, when `T` is float32.
fn as_f32<T: 'static>(x: &[T]) -> Option<&[f32]> {
    // SAFETY: T is f32 (checked), so the two slice types are the same.
    (TypeId::of::<T>() == TypeId::of::<f32>())
        .then(|| unsafe { &*(x as *const [T] as *const [f32]) })
}

/// [`as_f32`] of a mutable slice.
fn as_f32_mut<T: 'static>(x: &mut [T]) -> Option<&mut [f32]> {
    // SAFETY: as in `as_f32`.
    (TypeId::of::<T>() == TypeId::of::<f32>())
        .then(|| unsafe { &mut *(x as *mut [T] as *mut [f32]) })
}

/// One task: the rows of a few key/value heads of one sequence
/// ([`heads_per_task`]) and the keys of one split, with the partial states
/// it owns (`o` normalised, `lse`), head after head.
struct Task<'a, T> {
    batch: usize,
    kv_heads: Range<usize>,
    keys: Range<usize>,
    out: &'a mut [T],
    lse: &'a mut [T],
}

/// Key/value heads per task. A contiguous cache holds each head's keys in
/// one run of rows: one head per task, each task one stream of keys and
/// one of values. A paged pool holds a block's heads one after the other
/// (`block_size` rows each, 8 KiB at block 16, d = 128 in float32): a task
/// walks several heads tile by tile, so that it reads a block's heads
/// together instead of pieces of it far apart in time. With one head per
/// task, block 16 took 1.22x (float32) and 1.34x (float16) the time of the
/// contiguous cache at batch 8, context 16384 on the 2-core VM, 1.05x and
/// 1.18x with all 8 heads in a task (1.11x and 1.26x with 2). As many as
/// still leave two tasks a thread. The bits do not depend on it (each head
/// is computed on its own), so the thread count may choose it.
fn heads_per_task(p: &KvCacheProblem, splits: usize, threads: usize) -> usize {
    let heads = p.heads_kv();
    if matches!(p.layout, CacheLayout::Contiguous { .. }) {
        return 1;
    }
    let tasks = |per: usize| p.batch() * splits * heads.div_ceil(per);
    (1..=heads)
        .rev()
        .filter(|per| heads % per == 0)
        .find(|&per| tasks(per) >= 2 * threads)
        .unwrap_or(1)
}

fn decode_as<T: Element + CacheElement>(
    p: &KvCacheProblem,
    q: Slice<'_>,
    k_cache: Slice<'_>,
    v_cache: Slice<'_>,
    variants: &VariantArrays<'_>,
) -> Result<ForwardOutput> {
    let q = queries::<T>(q);
    let (k_cache, v_cache) = (Cache::<T>::new(k_cache), Cache::<T>::new(v_cache));
    let dv = p.attention.value_dim;
    let rows = p.group_rows();
    let heads = p.batch() * p.heads_kv();
    let splits = cpu_splits(p);
    let threads = num_threads()?;
    let per_task = heads_per_task(p, splits, threads);
    // Per sequence: its attention problem (positions, visible keys) and
    // the rules that score it (variants indexed by the flat query head).
    let sequences: Vec<Problem> = (0..p.batch()).map(|b| p.sequence(b)).collect();
    let rules: Vec<ScoreRules<'_, T>> = sequences
        .iter()
        .map(|s| ScoreRules::new(s, variants))
        .collect();
    use crate::runtime::buffers::try_zeros;
    let mut part_out = try_zeros(heads * splits * rows * dv, "the splits' outputs")?;
    let mut part_lse = try_zeros(heads * splits * rows, "the splits' lse")?;
    let mut out = try_zeros(p.out_len(), "the output o")?;
    let mut lse = try_zeros(p.lse_len(), "the output lse")?;
    // The state of (sequence b, split s, key/value head h) starts at row
    // ((b · splits + s) · heads_kv + h) · rows of the parts: a task's
    // heads are consecutive.
    let part = |b: usize, s: usize, h: usize| ((b * splits + s) * p.heads_kv() + h) * rows;
    run_with(threads, || {
        let walk = Walk {
            p,
            q: &q,
            k_cache: &k_cache,
            v_cache: &v_cache,
            rules: &rules,
        };
        let mut tasks = Vec::with_capacity(heads * splits);
        {
            let (mut out_rest, mut lse_rest) = (part_out.as_mut_slice(), part_lse.as_mut_slice());
            for batch in 0..p.batch() {
                let read = p.keys_read(batch);
                for s in 0..splits {
                    for first in (0..p.heads_kv()).step_by(per_task) {
                        let kv_heads = first..(first + per_task).min(p.heads_kv());
                        let n = kv_heads.len() * rows;
                        let (out, o_tail) = std::mem::take(&mut out_rest).split_at_mut(n * dv);
                        let (lse, l_tail) = std::mem::take(&mut lse_rest).split_at_mut(n);
                        (out_rest, lse_rest) = (o_tail, l_tail);
                        tasks.push(Task {
                            batch,
                            kv_heads,
                            keys: split_keys(read.clone(), splits, s),
                            out,
                            lse,
                        });
                    }
                }
            }
        }
        // The longest first, so that the threads finish together.
        tasks.sort_by_key(|t| std::cmp::Reverse(t.keys.len()));
        parallel::for_each(tasks, |task| walk.run(task))?;
        // Each (sequence, key/value head) owns R consecutive output rows
        // (its query heads, each seq_q rows): row r = g·seq_q + i.
        let mut merges = Vec::with_capacity(heads);
        let (mut out_rest, mut lse_rest) = (out.as_mut_slice(), lse.as_mut_slice());
        for head in 0..heads {
            let (o, o_tail) = std::mem::take(&mut out_rest).split_at_mut(rows * dv);
            let (l, l_tail) = std::mem::take(&mut lse_rest).split_at_mut(rows);
            (out_rest, lse_rest) = (o_tail, l_tail);
            merges.push((head, o, l));
        }
        let zeros = vec![T::ZERO; dv];
        // The sink joins as one more part, whose output is 0.
        let parts = splits + usize::from(p.attention.sinks);
        parallel::for_each(merges, |(head, out, lse)| {
            let batch = head / p.heads_kv();
            let mut weights = vec![T::ZERO; parts];
            for r in 0..rows {
                let h = (head % p.heads_kv()) * p.group_size() + r / p.seq_q();
                let sink = rules[batch].sink(batch * p.heads_q() + h);
                let at = |s: usize| part(batch, s, head % p.heads_kv()) + r;
                lse[r] = merge_row(
                    |s| match s < splits {
                        true => part_lse[at(s)],
                        false => sink.unwrap_or(T::NEG_INFINITY),
                    },
                    |s| match s < splits {
                        true => &part_out[at(s) * dv..(at(s) + 1) * dv],
                        false => &zeros[..],
                    },
                    &mut weights,
                    &mut out[r * dv..(r + 1) * dv],
                );
            }
        })
    })??;
    Ok(ForwardOutput {
        out: T::into_buffer(out),
        lse: T::into_buffer(lse),
    })
}

/// A tile of keys and where their rows start in the caches.
#[derive(Default)]
struct TileRows {
    keys: Range<usize>,
    k: Vec<usize>,
    v: Vec<usize>,
}

/// What every task reads.
struct Walk<'a, T: Clone> {
    p: &'a KvCacheProblem,
    q: &'a [T],
    k_cache: &'a Cache<'a, T>,
    v_cache: &'a Cache<'a, T>,
    rules: &'a [ScoreRules<'a, T>],
}

impl<T: Element + CacheElement> Walk<'_, T> {
    /// The keys `keys` of (sequence `b`, key/value head `h`) as a tile:
    /// a run of consecutive cache rows per block (the whole range when
    /// contiguous).
    fn rows(&self, b: usize, h: usize, keys: Range<usize>, tile: &mut TileRows) {
        let (d, dv) = (self.p.attention.head_dim, self.p.attention.value_dim);
        let bs = self.p.block_size();
        tile.k.clear();
        tile.v.clear();
        let mut j = keys.start;
        while j < keys.end {
            let run = (bs - j % bs).min(keys.end - j);
            let row = self.p.cache_row(b, h, j);
            tile.k.extend((row..row + run).map(|row| row * d));
            tile.v.extend((row..row + run).map(|row| row * dv));
            j += run;
        }
        tile.keys = keys;
    }

    fn run(&self, mut task: Task<'_, T>) {
        if !self.walk(&mut task, false) {
            self.walk(&mut task, true);
        }
    }

    /// Computes the task's state; false, without writing it, where the
    /// pass without `exact` cannot (docs/design.md#non-finite-inputs: a
    /// row whose lse is finite but whose accumulator is not met a NaN or an
    /// infinity in v, maybe of a key it does not see, 0 times NaN in a
    /// tile's product). The `exact` pass reads those values as 0 and gives
    /// o = NaN to a row that sees a key whose value held any.
    fn walk(&self, task: &mut Task<'_, T>, exact: bool) -> bool {
        let p = self.p;
        let (d, dv) = (p.attention.head_dim, p.attention.value_dim);
        let rows = p.group_rows();
        let b = task.batch;
        let tile_at = |start: usize| start..(start + TILE_KEYS).min(task.keys.end);
        let mut heads: Vec<Head<T>> = task
            .kv_heads
            .clone()
            .map(|h| self.head(b, h, tile_at(task.keys.start), tile_at, exact))
            .collect();
        let mut scores = vec![T::ZERO; rows * TILE_KEYS];
        let mut scratch = vec![T::ZERO; d.max(dv)];
        let mut keys = tile_at(task.keys.start);
        while !keys.is_empty() {
            // A task can be long (a prefill of many query rows over a
            // long cache): asked between key tiles, a stop leaves it
            // unwritten and the call returns Error::Interrupted.
            if parallel::stopping() {
                return true;
            }
            for head in &mut heads {
                self.step(b, head, &mut scores, &mut scratch, tile_at);
            }
            keys = tile_at(keys.end);
        }
        // A vectorised pass over each accumulator first: the rows are
        // looked at only where one is not finite.
        let dirty =
            |(state, a): (&RowState<T>, &[T])| state.finish().1.is_finite() && !all_finite(a);
        let any_dirty = |head: &Head<T>| {
            !all_finite(&head.acc) && head.states.iter().zip(head.acc.chunks_exact(dv)).any(dirty)
        };
        if !exact && dv > 0 && heads.iter().any(any_dirty) {
            return false;
        }
        for (i, head) in heads.iter().enumerate() {
            let (out, lse) = (&mut task.out[i * rows * dv..], &mut task.lse[i * rows..]);
            for (r, state) in head.states.iter().enumerate() {
                let (normaliser, row_lse) = state.finish();
                let normaliser = match head.poisoned.get(r) {
                    Some(true) if row_lse != T::NEG_INFINITY => T::NAN,
                    _ => normaliser,
                };
                for (o, &a) in out[r * dv..(r + 1) * dv]
                    .iter_mut()
                    .zip(&head.acc[r * dv..(r + 1) * dv])
                {
                    // A normaliser of 0: no key, o = 0 (not 0 times NaN).
                    *o = match normaliser == T::ZERO && !a.is_finite() {
                        true => T::ZERO,
                        false => a * normaliser,
                    };
                }
                lse[r] = row_lse;
            }
        }
        true
    }

    /// The state of key/value head `h` of sequence `b` before its first
    /// tile `first`, whose rows are requested at once (each later tile's
    /// while the one before it is computed, see [`Walk::step`]).
    fn head(
        &self,
        b: usize,
        h: usize,
        first: Range<usize>,
        tile_at: impl Fn(usize) -> Range<usize>,
        exact: bool,
    ) -> Head<T> {
        let p = self.p;
        let (d, dv) = (p.attention.head_dim, p.attention.value_dim);
        let (sq, group) = (p.seq_q(), p.group_size());
        let rows = group * sq;
        let scale = T::from_f64(p.attention.scale);
        // The group's query rows are consecutive in q: heads h·g.., each
        // seq_q rows.
        let at = (b * p.heads_q() + h * group) * sq;
        let q_scaled = self.q[at * d..(at + rows) * d]
            .iter()
            .map(|&x| x * scale)
            .collect();
        let (mut this, mut next) = (TileRows::default(), TileRows::default());
        self.rows(b, h, first, &mut this);
        self.rows(b, h, tile_at(this.keys.end), &mut next);
        kernels::prefetch(self.k_cache.ahead(&this.k, d));
        kernels::prefetch(self.v_cache.ahead(&this.v, dv));
        Head {
            h,
            q_scaled,
            states: vec![RowState::EMPTY; rows],
            acc: vec![T::ZERO; rows * dv],
            this,
            next,
            poisoned: vec![false; if exact { rows } else { 0 }],
        }
    }

    /// One tile of one head: its scores, the rules, the online softmax
    /// and the product with its values, prefetching the next tile.
    fn step(
        &self,
        b: usize,
        head: &mut Head<T>,
        scores: &mut [T],
        scratch: &mut [T],
        tile_at: impl Fn(usize) -> Range<usize>,
    ) {
        let p = self.p;
        let (d, dv) = (p.attention.head_dim, p.attention.value_dim);
        let (sq, group) = (p.seq_q(), p.group_size());
        let rows = group * sq;
        let rules = &self.rules[b];
        let Head {
            h,
            q_scaled,
            states,
            acc,
            this,
            next,
            poisoned,
        } = head;
        let h = *h;
        let keys = this.keys.clone();
        let n = keys.len();
        let scores = &mut scores[..rows * n];
        // Each stream one tile ahead: the next tile's keys are prefetched
        // while this one's scores are computed, its values during the
        // product with this one's values.
        let ahead = self.k_cache.ahead(&next.k, d);
        let shape = (rows, d);
        self.k_cache
            .scores(q_scaled, shape, &this.k, scores, n, ahead, scratch);
        for g in 0..group {
            let head = b * p.heads_q() + h * group + g;
            let q_rows = 0..sq;
            let block = &mut scores[g * sq * n..(g + 1) * sq * n];
            // Rows that see none of the tile get -inf throughout (the
            // rules hide what lies outside each row's range).
            let visibility = match rules.classify(head, &q_rows, &keys) {
                TileVisibility::Hidden => TileVisibility::Partial,
                v => v,
            };
            if visibility == TileVisibility::Partial || rules.modifies_scores() {
                rules.apply(head, visibility, &q_rows, &keys, block, n, None);
            }
        }
        for (r, (state, line)) in states
            .iter_mut()
            .zip(scores.chunks_exact_mut(n))
            .enumerate()
        {
            let rescale = state.absorb(line);
            if rescale != T::ONE {
                acc[r * dv..(r + 1) * dv]
                    .iter_mut()
                    .for_each(|x| *x *= rescale);
            }
        }
        if poisoned.is_empty() {
            let ahead = self.v_cache.ahead(&next.v, dv);
            let shape = (rows, dv);
            self.v_cache
                .accumulate(scores, n, &this.v, acc, shape, ahead, scratch);
        } else {
            // The exact pass (Walk::walk): values read with NaN and
            // infinities as 0, and the rows that see such a key poisoned.
            let mut values = vec![T::ZERO; n * dv];
            for ((key, &start), value) in keys
                .clone()
                .zip(&this.v)
                .zip(values.chunks_exact_mut(dv.max(1)))
            {
                self.v_cache.read(start, value);
                if value.iter().any(|x| !x.is_finite()) {
                    value
                        .iter_mut()
                        .filter(|x| !x.is_finite())
                        .for_each(|x| *x = T::ZERO);
                    for (r, poisoned) in poisoned.iter_mut().enumerate() {
                        let head = b * p.heads_q() + h * group + r / sq;
                        *poisoned |= rules.pair_visible(head, r % sq, key);
                    }
                }
            }
            T::matmul_acc(scores, n, &values, acc, rows, n, dv);
        }
        std::mem::swap(this, next);
        self.rows(b, h, tile_at(this.keys.end), next);
    }
}

/// A key/value head as a task walks it: its group's scaled query rows,
/// their online-softmax states and output accumulators, this tile and the
/// next.
struct Head<T> {
    h: usize,
    q_scaled: Vec<T>,
    states: Vec<RowState<T>>,
    acc: Vec<T>,
    this: TileRows,
    next: TileRows,
    /// The exact pass's rows that see a key whose value is not finite
    /// (empty in the fast pass).
    poisoned: Vec<bool>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::problem::{validate_kvcache, ArrayInfo, IntArray, KvCacheOptions};

    /// 8 key/value heads, 4096 keys a sequence, contiguous or in blocks of
    /// 16.
    fn problem(batch: usize, paged: bool) -> KvCacheProblem {
        let q = [batch, 32, 1, 128];
        let (cache, table): ([usize; 4], Vec<i64>) = match paged {
            false => ([batch, 8, 4096, 128], vec![]),
            true => ([batch * 256, 8, 16, 128], (0..batch as i64 * 256).collect()),
        };
        let table_shape = [batch, 256];
        validate_kvcache(
            ArrayInfo::new(&q, "float32"),
            ArrayInfo::new(&cache, "float32"),
            ArrayInfo::new(&cache, "float32"),
            IntArray {
                shape: &[batch],
                dtype: "int32",
                values: &vec![4096; batch],
            },
            paged.then_some(IntArray {
                shape: &table_shape,
                dtype: "int32",
                values: &table,
            }),
            &KvCacheOptions::default(),
        )
        .unwrap()
    }

    #[test]
    fn paged_tasks_take_the_heads_that_leave_two_tasks_a_thread() {
        // Contiguous: one head a task, whatever the shape.
        assert_eq!(heads_per_task(&problem(8, false), 1, 2), 1);
        assert_eq!(heads_per_task(&problem(1, false), 2, 1), 1);
        // Paged: 8 sequences on 2 threads, all 8 heads; on 16, 2 (32 tasks).
        assert_eq!(heads_per_task(&problem(8, true), 1, 2), 8);
        assert_eq!(heads_per_task(&problem(8, true), 1, 16), 2);
        // One sequence in 2 splits on 2 threads: 4 tasks of 4 heads.
        assert_eq!(heads_per_task(&problem(1, true), 2, 2), 4);
        // Too few for the threads: one head a task.
        assert_eq!(heads_per_task(&problem(1, true), 1, 64), 1);
    }
}
