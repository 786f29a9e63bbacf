//! `attention_with_kvcache` on the CPU (see [`crate::decode`]): one task
//! per (sequence, key/value head, key split) holds every query row of the
//! head's GQA group, so each cached key and value is read once per group;
//! the splits' states are then merged in split order.
//!
//! A task walks its keys in tiles of [`TILE_KEYS`]. Each tile's key and
//! value rows are gathered from the cache (through the block table when
//! paged, a run of rows per block) into contiguous tiles in the compute
//! type, widening float16 as they are copied, so that the cache is never
//! converted as a whole and only the keys read are touched. The tile's
//! scores come from the same products, variant rules and online softmax
//! (`RowState`) as [`super::forward`]'s.

use std::any::TypeId;
use std::ops::Range;

use half::slice::HalfFloatSliceExt;

use super::element::Element;
use super::merge::merge_row;
use super::scores::{ScoreRules, TileVisibility};
use super::softmax::RowState;
use super::{narrow, num_threads, parallel, run_with};
use crate::decode::{cpu_splits, split_keys};
use crate::{DType, ForwardOutput, KvCacheProblem, Problem, Result, Slice, VariantArrays};

/// Keys per tile: a tile of keys and one of values of d = 128 in float32
/// take 64 KiB, in a core's L2 beside the rows' scores.
pub const TILE_KEYS: usize = 64;

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
                out: narrow(r.out, problem.dtype()),
                lse: r.lse,
            })
        }
    }
}

/// A cache as the tasks read it: in the compute type, or float16 or
/// bfloat16 to be widened row by row.
enum Cache<'a, T> {
    Same(&'a [T]),
    Half(&'a [half::f16]),
    Brain(&'a [half::bf16]),
}

impl<'a, T: Element> Cache<'a, T> {
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

    /// Copies elements `range` into `dst`.
    fn copy(&self, range: Range<usize>, dst: &mut [T]) {
        match self {
            Cache::Same(x) => dst.copy_from_slice(&x[range]),
            Cache::Half(x) => widen(&x[range], dst),
            Cache::Brain(x) => widen(&x[range], dst),
        }
    }
}

/// float16 or bfloat16 widened into the compute type (float32 for such
/// problems), by slices (F16C where the CPU has it, for float16).
fn widen<T: Element, H>(src: &[H], dst: &mut [T])
where
    H: Copy + Into<f64>,
    [H]: HalfFloatSliceExt,
{
    if TypeId::of::<T>() == TypeId::of::<f32>() {
        // SAFETY: T is f32, so the two slice types are the same type.
        let dst = unsafe { &mut *(dst as *mut [T] as *mut [f32]) };
        src.convert_to_f32_slice(dst);
    } else {
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = T::from_f64(s.into());
        }
    }
}

/// One task: the rows of one (sequence, key/value head) and the keys of
/// one split, with the partial state it owns (`o` normalised, `lse`).
struct Task<'a, T> {
    batch: usize,
    kv_head: usize,
    keys: Range<usize>,
    out: &'a mut [T],
    lse: &'a mut [T],
}

fn decode_as<T: Element>(
    p: &KvCacheProblem,
    q: Slice<'_>,
    k_cache: Slice<'_>,
    v_cache: Slice<'_>,
    variants: &VariantArrays<'_>,
) -> Result<ForwardOutput> {
    let q = T::view(q);
    let (k_cache, v_cache) = (Cache::<T>::new(k_cache), Cache::<T>::new(v_cache));
    let dv = p.attention.value_dim;
    let rows = p.group_rows();
    let heads = p.batch() * p.heads_kv();
    let splits = cpu_splits(p);
    // Per sequence: its attention problem (positions, visible keys) and
    // the rules that score it (variants indexed by the flat query head).
    let sequences: Vec<Problem> = (0..p.batch()).map(|b| p.sequence(b)).collect();
    let rules: Vec<ScoreRules<'_, T>> = sequences
        .iter()
        .map(|s| ScoreRules::new(s, variants))
        .collect();
    use super::buffers::try_zeros;
    let mut part_out = try_zeros(heads * splits * rows * dv, "the splits' outputs")?;
    let mut part_lse = try_zeros(heads * splits * rows, "the splits' lse")?;
    let mut out = try_zeros(p.out_len(), "the output o")?;
    let mut lse = try_zeros(p.lse_len(), "the output lse")?;
    run_with(num_threads()?, || {
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
            for head in 0..heads {
                let batch = head / p.heads_kv();
                let read = p.keys_read(batch);
                for s in 0..splits {
                    let (out, o_tail) = std::mem::take(&mut out_rest).split_at_mut(rows * dv);
                    let (lse, l_tail) = std::mem::take(&mut lse_rest).split_at_mut(rows);
                    (out_rest, lse_rest) = (o_tail, l_tail);
                    tasks.push(Task {
                        batch,
                        kv_head: head % p.heads_kv(),
                        keys: split_keys(read.clone(), splits, s),
                        out,
                        lse,
                    });
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
                let at = |s: usize| (head * splits + s) * rows + r;
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

/// What every task reads.
struct Walk<'a, T: Clone> {
    p: &'a KvCacheProblem,
    q: &'a [T],
    k_cache: &'a Cache<'a, T>,
    v_cache: &'a Cache<'a, T>,
    rules: &'a [ScoreRules<'a, T>],
}

impl<T: Element> Walk<'_, T> {
    /// Copies the cache rows of keys `keys` of (sequence `b`, key/value
    /// head `h`), `width` elements each, into `dst`: a run of rows per
    /// block (the whole range when contiguous).
    fn gather(
        &self,
        cache: &Cache<'_, T>,
        b: usize,
        h: usize,
        keys: &Range<usize>,
        width: usize,
        dst: &mut [T],
    ) {
        let bs = self.p.block_size();
        let mut j = keys.start;
        while j < keys.end {
            let run = (bs - j % bs).min(keys.end - j);
            let row = self.p.cache_row(b, h, j);
            let at = (j - keys.start) * width;
            cache.copy(
                row * width..(row + run) * width,
                &mut dst[at..at + run * width],
            );
            j += run;
        }
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
        let (sq, group) = (p.seq_q(), p.group_size());
        let rows = group * sq;
        let (b, h) = (task.batch, task.kv_head);
        let rules = &self.rules[b];
        let scale = T::from_f64(p.attention.scale);
        // The group's query rows are consecutive in q: heads h·g.., each
        // seq_q rows.
        let first = (b * p.heads_q() + h * group) * sq;
        let q_scaled: Vec<T> = self.q[first * d..(first + rows) * d]
            .iter()
            .map(|&x| x * scale)
            .collect();
        let mut states = vec![RowState::<T>::EMPTY; rows];
        let mut acc = vec![T::ZERO; rows * dv];
        let tile = TILE_KEYS;
        let mut k_tile = vec![T::ZERO; tile * d];
        let mut v_tile = vec![T::ZERO; tile * dv];
        let mut scores = vec![T::ZERO; rows * tile];
        let mut pack = vec![T::ZERO; d.max(dv) * tile.next_multiple_of(16)];
        let mut poisoned = vec![false; if exact { rows } else { 0 }];
        let mut start = task.keys.start;
        while start < task.keys.end {
            let keys = start..(start + tile).min(task.keys.end);
            start = keys.end;
            let n = keys.len();
            self.gather(self.k_cache, b, h, &keys, d, &mut k_tile[..n * d]);
            let scores = &mut scores[..rows * n];
            T::matmul_nt(
                &q_scaled,
                &k_tile[..n * d],
                None,
                scores,
                n,
                (rows, d, n),
                &mut pack,
            );
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
            self.gather(self.v_cache, b, h, &keys, dv, &mut v_tile[..n * dv]);
            if exact {
                for (j, value) in keys.clone().zip(v_tile.chunks_exact_mut(dv.max(1))) {
                    if value.iter().any(|x| !x.is_finite()) {
                        value.iter_mut().for_each(|x| {
                            *x = if x.is_finite() { *x } else { T::ZERO };
                        });
                        for (r, poisoned) in poisoned.iter_mut().enumerate() {
                            let head = b * p.heads_q() + h * group + r / sq;
                            *poisoned |= rules.pair_visible(head, r % sq, j);
                        }
                    }
                }
            }
            T::matmul_acc(scores, n, &v_tile[..n * dv], &mut acc, rows, n, dv);
        }
        let dirty = |(state, a): (&RowState<T>, &[T])| {
            state.finish().1.is_finite() && a.iter().any(|x| !x.is_finite())
        };
        if !exact && dv > 0 && states.iter().zip(acc.chunks_exact(dv)).any(dirty) {
            return false;
        }
        for (r, state) in states.iter().enumerate() {
            let (normaliser, lse) = state.finish();
            let normaliser = match poisoned.get(r) {
                Some(true) if lse != T::NEG_INFINITY => T::NAN,
                _ => normaliser,
            };
            for (o, &a) in task.out[r * dv..(r + 1) * dv]
                .iter_mut()
                .zip(&acc[r * dv..(r + 1) * dv])
            {
                // A normaliser of 0: no key, o = 0 (not 0 times NaN).
                *o = match normaliser == T::ZERO && !a.is_finite() {
                    true => T::ZERO,
                    false => a * normaliser,
                };
            }
            task.lse[r] = lse;
        }
        true
    }
}
