//! The CPU backward: FlashAttention-2's recomputing backward, dQ by row
//! tiles and dK/dV by key chunks (see the module's comment).

use super::rows::{clean_rows, key_tiles, scale_into, Layout};
use super::scratch::{reserve_scratch, with_scratch, Scratch};
use super::{kernels, tiles};
use std::ops::Range;

use super::element::{Element, Packing};
use super::scores::{ScoreRules, TileVisibility};
use super::tiles::TileSizes;
use crate::error::Result;
use crate::problem::Problem;
use crate::runtime::buffers::{self, spare, zero_init};
use crate::runtime::parallel;

/// One key/value tile as the tile products read it: rows, and the same
/// transposed (with its row stride) when the kernels prefer that.
struct KvTile<'a, T> {
    pub(super) k_rows: &'a [T],
    pub(super) v_rows: &'a [T],
    pub(super) k_t: Option<&'a [T]>,
    v_t: Option<&'a [T]>,
    /// Key rows packed for `dQ += dS·K`.
    k_panels: Option<(&'a [T], usize)>,
}

pub(super) struct BackwardInputs<'a, T> {
    pub(super) d_out: &'a [T],
    pub(super) q: &'a [T],
    pub(super) k: &'a [T],
    /// `k` and `v` transposed per head, when the kernels want them.
    pub(super) k_packed: Option<&'a [T]>,
    pub(super) v_packed: Option<&'a [T]>,
    pub(super) k_row_panels: Option<&'a [T]>,
    pub(super) v: &'a [T],
    pub(super) out: &'a [T],
    pub(super) lse: &'a [T],
}

/// Where the full score gradient `dS` goes when the float mask's gradient
/// is wanted: `(batch·heads_q, seq_q, seq_k)`, written by many tasks at
/// once. Each element belongs to exactly one key tile of one key/value
/// head, hence to one task, so the writes never overlap.
struct ScoreGradientSink<T> {
    pub(super) data: *mut T,
    pub(super) seq_q: usize,
    pub(super) seq_k: usize,
}

// SAFETY: tasks write disjoint elements (see above) and the buffer
// outlives the parallel loop that writes it.
unsafe impl<T: Send> Send for ScoreGradientSink<T> {}
unsafe impl<T: Send> Sync for ScoreGradientSink<T> {}

impl<T: Copy> ScoreGradientSink<T> {
    /// Copies `tile` (rows `ld` apart) to its place.
    pub(super) fn write(
        &self,
        head: usize,
        rows: &Range<usize>,
        keys: &Range<usize>,
        tile: &[T],
        ld: usize,
    ) {
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
pub(super) struct TileRows<'a, T> {
    /// Flat (batch, query head).
    pub(super) head: usize,
    pub(super) rows: &'a Range<usize>,
    pub(super) keys: &'a Range<usize>,
    pub(super) visibility: TileVisibility,
    pub(super) q_scaled: &'a [T],
    d_out_rows: &'a [T],
    lse_rows: &'a [T],
    delta_rows: &'a [T],
}

/// A backward task's inputs for its exact pass (docs/design.md#non-finite-inputs):
/// its key/value head of k with every NaN and infinity replaced by 0 (and
/// packed), for `dQ += dS K`, and which of its keys held any.
struct ExactKeys<T> {
    pub(super) k_rows: Vec<T>,
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
    pub(super) problem: &'a Problem,
    pub(super) rules: &'a ScoreRules<'a, T>,
    pub(super) tiles: TileSizes,
    pub(super) x: &'a BackwardInputs<'a, T>,
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
    pub(super) fn run(
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
    pub(super) fn pass(
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

pub(super) fn backward_typed<T: Element>(
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
    pub(super) kv_head: usize,
    pub(super) keys: Range<usize>,
    pub(super) outputs: [&'a mut [T]; 3],
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

/// The backward's view of a key/value tile (`Layout` is the passes' index
/// helper, `rows.rs`).
impl Layout<'_> {
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
}
