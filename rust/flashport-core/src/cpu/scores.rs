//! Which scores a (query tile, key tile) pair keeps and how they are
//! modified, for the CPU tile loops: causal and the sliding window (ranges
//! of keys per row), a mask array, ALiBi, softcap, sinks and dropout.
//! The definitions are in [`crate::variants`]; this is where the CPU
//! applies them to a tile of scores.

use std::borrow::Cow;
use std::ops::Range;

use super::element::Element;
use crate::problem::{Problem, RowTable, Segments};
use crate::variants::{
    slopes_per_head, DropoutMask, MaskData, MaskLayout, VariantArrays, MASK_BLOCK,
};

/// The caller's mask as the CPU reads it, without converting a boolean
/// mask or a float mask already in the compute type (converting a
/// `seq × seq` mask would cost a pass over it on every call).
struct Mask<'a, T: Clone> {
    values: MaskValues<'a, T>,
    layout: MaskLayout,
}

enum MaskValues<'a, T: Clone> {
    Bool(&'a [bool]),
    Additive(Cow<'a, [T]>),
}

impl<'a, T: Element> Mask<'a, T> {
    fn new(problem: &Problem, data: MaskData<'a>) -> Option<Self> {
        let dims = problem.mask?.dims;
        let (values, layout) = match data {
            MaskData::Bool(keep) => (MaskValues::Bool(keep), MaskLayout::new(dims, keep, |&k| k)),
            MaskData::Float(values) => {
                let values = T::view(values);
                let layout = MaskLayout::new(dims, &values, |&v| v != T::NEG_INFINITY);
                (MaskValues::Additive(values), layout)
            }
        };
        Some(Mask { values, layout })
    }

    /// Adds the mask to the scores of `keys` in one row (`-inf` where a
    /// boolean mask is False).
    fn add_row(
        &self,
        batch: usize,
        head: usize,
        row: usize,
        keys: &Range<usize>,
        scores: &mut [T],
    ) {
        let base = self.layout.row_offset(batch, head, row);
        let per_key = self.layout.strides[3] != 0;
        let range = if per_key {
            base + keys.start..base + keys.end
        } else {
            base..base + 1
        };
        match &self.values {
            MaskValues::Bool(keep) => {
                let keep = &keep[range];
                for (j, s) in scores.iter_mut().enumerate() {
                    if !keep[if per_key { j } else { 0 }] {
                        *s = T::NEG_INFINITY;
                    }
                }
            }
            MaskValues::Additive(values) => {
                // A -inf entry hides its key whatever the score is (NaN
                // included: NaN + -inf would be NaN), so it is selected,
                // not added.
                let hide = |s: T, m: T| if m == T::NEG_INFINITY { m } else { s + m };
                let values = &values[range];
                if per_key {
                    scores
                        .iter_mut()
                        .zip(values)
                        .for_each(|(s, &m)| *s = hide(*s, m));
                } else {
                    scores.iter_mut().for_each(|s| *s = hide(*s, values[0]));
                }
            }
        }
    }

    /// Whether the mask shows key `key` to `row` (True, or not `-inf`).
    fn shows(&self, batch: usize, head: usize, row: usize, key: usize) -> bool {
        let at = self.layout.row_offset(batch, head, row) + key * self.layout.strides[3];
        match &self.values {
            MaskValues::Bool(keep) => keep[at],
            MaskValues::Additive(values) => values[at] != T::NEG_INFINITY,
        }
    }
}

/// How a tile of scores is treated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TileVisibility {
    /// No query row of the tile sees any of its keys: skip the tile.
    Hidden,
    /// Causal and the window hide nothing in the tile.
    Full,
    /// Causal or the window hide some scores.
    Partial,
}

/// The scoring rules of one call.
pub struct ScoreRules<'p, T: Clone> {
    problem: &'p Problem,
    softcap: Option<T>,
    /// ALiBi slope per flat (batch, query head).
    slopes: Option<Vec<T>>,
    mask: Option<Mask<'p, T>>,
    /// Sink logit per query head.
    sinks: Option<Vec<T>>,
    dropout: Option<DropoutMask>,
    /// `1 / (1 - p)`: the scale of the kept probabilities.
    keep_scale: T,
    /// A packed batch's sequences, and each row's visible keys in them.
    segments: Option<(&'p Segments, RowTable)>,
}

impl<'p, T: Element> ScoreRules<'p, T> {
    pub fn new(problem: &'p Problem, arrays: &VariantArrays<'p>) -> Self {
        let to_t = |values: Vec<f64>| values.into_iter().map(T::from_f64).collect();
        ScoreRules {
            problem,
            softcap: problem.softcap.map(T::from_f64),
            slopes: arrays
                .alibi_slopes
                .map(|s| to_t(slopes_per_head(problem, s))),
            mask: arrays.mask.and_then(|data| Mask::new(problem, data)),
            sinks: arrays.sinks.map(|s| to_t(s.to_vec())),
            dropout: problem.dropout.map(DropoutMask::new),
            keep_scale: T::from_f64(problem.dropout.map_or(1.0, |d| 1.0 / (1.0 - d.p))),
            segments: arrays.segments.map(|s| (s, s.rows(problem))),
        }
    }

    /// The keys query row `row` may see by causal and the window (within
    /// its sequence, in a packed batch); both ends are non-decreasing in
    /// the row.
    pub fn visible_keys(&self, row: usize) -> Range<usize> {
        match &self.segments {
            Some((_, rows)) => rows.visible[row].clone(),
            None => self.problem.visible_keys(row),
        }
    }

    /// Whether `row` of flat head `head` sees `key`: causal, the window, a
    /// packed batch's sequences and the mask (docs/design.md#non-finite-inputs:
    /// what a key must not reach). For the rare paths; the tile loops
    /// classify tiles instead.
    pub fn pair_visible(&self, head: usize, row: usize, key: usize) -> bool {
        if !self.visible_keys(row).contains(&key) {
            return false;
        }
        let (batch, h) = (head / self.problem.heads_q, head % self.problem.heads_q);
        self.mask
            .as_ref()
            .is_none_or(|mask| mask.shows(batch, h, row, key))
    }

    /// Whether rows see fewer keys than all: causal, the window, or the
    /// sequences of a packed batch.
    fn has_range_mask(&self) -> bool {
        self.segments.is_some() || self.problem.has_range_mask()
    }

    /// The rows the forward cuts into tiles, each tile within one: all of
    /// them, or each sequence's of a packed batch (so that a tile's keys
    /// are one sequence's).
    pub fn row_runs(&self) -> Vec<Range<usize>> {
        match &self.segments {
            Some((s, _)) => (0..s.sequences())
                .map(|b| s.sequence(b).rows)
                .filter(|rows| !rows.is_empty())
                .collect(),
            None => std::iter::once(0..self.problem.seq_q).collect(),
        }
    }

    /// Blocks of at most `block` consecutive rows, none across two runs of
    /// [`ScoreRules::row_runs`].
    pub fn row_blocks(&self, block: usize) -> Vec<Range<usize>> {
        let mut blocks = Vec::new();
        for run in self.row_runs() {
            let mut start = run.start;
            while start < run.end {
                let end = (start + block).min(run.end);
                blocks.push(start..end);
                start = end;
            }
        }
        blocks
    }

    /// The ALiBi slope and diagonal offset of row `r` of flat head `head`
    /// (a packed batch's rows take their sequence's).
    fn alibi_of(&self, slopes: &[T], head: usize, r: usize) -> (T, i128) {
        match &self.segments {
            Some((s, rows)) => {
                let b = rows.sequence[r];
                (
                    slopes[b * self.problem.heads_q + head],
                    i128::from(s.diagonal(b)),
                )
            }
            None => (slopes[head], self.problem.causal_offset()),
        }
    }

    /// Whether every visible tile needs [`ScoreRules::apply`] even where
    /// causal and the window hide nothing.
    pub fn modifies_scores(&self) -> bool {
        self.softcap.is_some() || self.slopes.is_some() || self.mask.is_some()
    }

    pub fn softcap(&self) -> Option<T> {
        self.softcap
    }

    pub fn has_dropout(&self) -> bool {
        self.dropout.is_some()
    }

    pub fn keep_scale(&self) -> T {
        self.keep_scale
    }

    /// The sink logit of a flat (batch, query head).
    pub fn sink(&self, head: usize) -> Option<T> {
        self.sinks.as_ref().map(|s| s[head % self.problem.heads_q])
    }

    /// Keys that any row of `rows` may see: both ends of each row's range
    /// are non-decreasing, so the first row bounds the start and the last
    /// the end.
    pub fn key_range(&self, rows: &Range<usize>) -> Range<usize> {
        if rows.is_empty() {
            return 0..0;
        }
        let start = self.visible_keys(rows.start).start;
        let end = self.visible_keys(rows.end - 1).end;
        start.min(end)..end
    }

    /// Sets `out` to the key tiles of `rows` to compute, in order, each
    /// starting at a multiple of [`MASK_BLOCK`] (where packed panels start)
    /// and at most `tile` keys long: consecutive tiles over `keys`, and
    /// with a mask, only the runs of [`MASK_BLOCK`]-key blocks that the
    /// mask leaves visible to some row, so a block-sparse mask skips work
    /// at that granularity rather than whole tiles.
    pub fn key_tiles(
        &self,
        head: usize,
        rows: &Range<usize>,
        keys: Range<usize>,
        tile: usize,
        out: &mut Vec<Range<usize>>,
    ) {
        out.clear();
        if keys.is_empty() || rows.is_empty() {
            return;
        }
        let Some(mask) = &self.mask else {
            // From the block where the rows' keys start (not the tile grid):
            // a sliding window's rows start anywhere.
            let mut start = keys.start / MASK_BLOCK * MASK_BLOCK;
            while start < keys.end {
                out.push(start..(start + tile).min(keys.end));
                start += tile;
            }
            return;
        };
        let (batch, h) = (head / self.problem.heads_q, head % self.problem.heads_q);
        let mut run: Option<Range<usize>> = None;
        let mut start = keys.start / MASK_BLOCK * MASK_BLOCK;
        while start < keys.end {
            let block = start..(start + MASK_BLOCK).min(keys.end);
            if mask.layout.any_visible(batch, h, rows, &block) {
                match &mut run {
                    Some(r) if r.len() + block.len() <= tile => r.end = block.end,
                    _ => {
                        if let Some(r) = run.take() {
                            out.push(r);
                        }
                        run = Some(block);
                    }
                }
            } else if let Some(r) = run.take() {
                out.push(r);
            }
            start += MASK_BLOCK;
        }
        if let Some(r) = run {
            out.push(r);
        }
    }

    pub fn classify(
        &self,
        head: usize,
        rows: &Range<usize>,
        keys: &Range<usize>,
    ) -> TileVisibility {
        if rows.is_empty() || keys.is_empty() {
            return TileVisibility::Hidden;
        }
        if let Some(mask) = &self.mask {
            let (batch, h) = (head / self.problem.heads_q, head % self.problem.heads_q);
            if !mask.layout.any_visible(batch, h, rows, keys) {
                return TileVisibility::Hidden;
            }
        }
        if !self.has_range_mask() {
            return TileVisibility::Full;
        }
        let (mut hidden, mut full) = (true, true);
        for row in rows.clone() {
            let seen = self.visible_keys(row);
            if seen.start.max(keys.start) < seen.end.min(keys.end) {
                hidden = false;
            }
            if seen.start > keys.start || seen.end < keys.end {
                full = false;
            }
        }
        match (hidden, full) {
            (true, _) => TileVisibility::Hidden,
            (false, true) => TileVisibility::Full,
            (false, false) => TileVisibility::Partial,
        }
    }

    /// Turns a tile of scaled scores `u` into the scores `s` the softmax
    /// sees: softcap, then ALiBi and the mask, then `-inf` where causal or
    /// the window hide a key. `scores` holds `rows.len()` rows of
    /// `row_stride` elements, column `c` being key `keys.start + c`. With
    /// softcap, `tanh_out` (same layout) receives `tanh(u / softcap)` for
    /// the backward.
    #[allow(clippy::too_many_arguments)]
    pub fn apply(
        &self,
        head: usize,
        visibility: TileVisibility,
        rows: &Range<usize>,
        keys: &Range<usize>,
        scores: &mut [T],
        row_stride: usize,
        mut tanh_out: Option<&mut [T]>,
    ) {
        let p = self.problem;
        let (batch, h) = (head / p.heads_q, head % p.heads_q);
        let n = keys.len();
        for (r, (row, line)) in rows.clone().zip(scores.chunks_mut(row_stride).enumerate()) {
            let line = &mut line[..n];
            if let Some(cap) = self.softcap {
                let inverse = T::ONE / cap;
                let tanh_row = tanh_out
                    .as_deref_mut()
                    .map(|t| &mut t[row * row_stride..row * row_stride + n]);
                match tanh_row {
                    Some(tanh_row) => {
                        for (s, t) in line.iter_mut().zip(tanh_row) {
                            *t = (*s * inverse).tanh();
                            *s = cap * *t;
                        }
                    }
                    None => line
                        .iter_mut()
                        .for_each(|s| *s = cap * (*s * inverse).tanh()),
                }
            }
            if let Some(slopes) = &self.slopes {
                let (slope, offset) = self.alibi_of(slopes, head, r);
                // The distance saturates at 2^63 - 1, which only offsets
                // at opposite ends of their ±2^62 range exceed.
                let diagonal = (r as i128 + offset).clamp(i64::MIN.into(), i64::MAX.into()) as i64;
                for (j, s) in keys.clone().zip(line.iter_mut()) {
                    let distance = diagonal.saturating_sub(j as i64).unsigned_abs() as f64;
                    *s = *s - slope * T::from_f64(distance);
                }
            }
            if let Some(mask) = &self.mask {
                mask.add_row(batch, h, r, keys, line);
            }
            if visibility == TileVisibility::Partial {
                // The visible keys of a row are one range: hide what lies
                // before and after it as two runs (a per-key test costs as
                // much as the rest of the tile's softmax).
                let seen = self.visible_keys(r);
                let lo = seen.start.clamp(keys.start, keys.end) - keys.start;
                let hi = seen.end.clamp(keys.start, keys.end) - keys.start;
                let hi = hi.max(lo);
                line[..lo].fill(T::NEG_INFINITY);
                line[hi..].fill(T::NEG_INFINITY);
            }
        }
    }

    /// Multiplies a tile by the dropout factors `Z = keep / (1 - p)`, or,
    /// with `zero_only`, just zeroes the dropped entries (the forward folds
    /// `1 / (1 - p)` into the final normaliser instead).
    pub fn apply_dropout(
        &self,
        head: usize,
        rows: &Range<usize>,
        keys: &Range<usize>,
        values: &mut [T],
        row_stride: usize,
        zero_only: bool,
    ) {
        let Some(dropout) = &self.dropout else {
            return;
        };
        let scale = if zero_only { T::ONE } else { self.keep_scale };
        for (r, line) in rows.clone().zip(values.chunks_mut(row_stride)) {
            dropout.for_each(head, r, keys.clone(), |c, kept| {
                line[c] = if kept { line[c] * scale } else { T::ZERO };
            });
        }
    }
}
