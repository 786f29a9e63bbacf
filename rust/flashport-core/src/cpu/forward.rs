//! The CPU forward: FlashAttention-2's tiled online softmax over key
//! tiles, one task per row tile (see the module's comment).

use super::kernels;
use super::rows::{clean_rows, row_tiles, scale_into, Layout, RowTile};
use super::scratch::{reserve_scratch, with_scratch, Scratch};
use std::ops::Range;

use super::element::{Element, PackInput, Packing};
use super::scores::{ScoreRules, TileVisibility};
use super::softmax::RowState;
use super::tiles::TileSizes;
use crate::error::Result;
use crate::problem::Problem;
use crate::runtime::buffers::{self, spare};
use crate::runtime::parallel;

pub(super) fn forward_typed<T: Element>(
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
pub(super) struct Values<'a, T> {
    pub(super) v: &'a [T],
    pub(super) packed: Option<&'a [T]>,
    pub(super) head: usize,
}

/// What every forward task reads but its values.
struct ForwardPass<'a, T: Clone> {
    pub(super) problem: &'a Problem,
    pub(super) rules: &'a ScoreRules<'a, T>,
    pub(super) tiles: TileSizes,
    pub(super) layout: Layout<'a>,
    pub(super) k: &'a [T],
    pub(super) k_packed: Option<&'a [T]>,
}

impl<T: Element> ForwardPass<'_, T> {
    /// Folds every key tile the rows `rows` of flat head `head` see into
    /// `s.states` and `s.acc` (both reset first), from the scaled query rows
    /// in `s.q_scaled`.
    pub(super) fn tiles(
        &self,
        s: &mut Scratch<T>,
        head: usize,
        rows: &Range<usize>,
        values: Values<'_, T>,
    ) {
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
