//! Which scores a (query tile, key tile) pair keeps.
//!
//! Every score modification (causal today; sliding windows, masks, ALiBi,
//! softcap and dropout next) enters the tile loops through this type: a
//! whole tile can be skipped, taken whole, or taken element by element.

use std::ops::Range;

use super::element::Element;
use crate::Problem;

/// How a tile of scores is treated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TileVisibility {
    /// No query row of the tile sees any of its keys: skip the tile.
    Hidden,
    /// Every query row sees every key: no per-element work.
    Full,
    /// Some scores are masked: call [`ScoreMask::apply`].
    Partial,
}

/// The masking rules of one problem.
#[derive(Debug, Clone, Copy)]
pub struct ScoreMask<'p> {
    problem: &'p Problem,
}

impl<'p> ScoreMask<'p> {
    pub fn new(problem: &'p Problem) -> Self {
        ScoreMask { problem }
    }

    /// Keys that any row of `rows` may see: the key loop of a query tile
    /// runs over `0..key_end(rows)`.
    pub fn key_end(&self, rows: &Range<usize>) -> usize {
        match rows.end.checked_sub(1) {
            Some(last) if !rows.is_empty() => self.problem.visible_key_end(last),
            _ => 0,
        }
    }

    pub fn classify(&self, rows: &Range<usize>, keys: &Range<usize>) -> TileVisibility {
        if rows.is_empty() || keys.is_empty() {
            return TileVisibility::Hidden;
        }
        // visible_key_end is non-decreasing in the row, so the first and
        // the last row bound the whole tile.
        if self.problem.visible_key_end(rows.end - 1) <= keys.start {
            TileVisibility::Hidden
        } else if self.problem.visible_key_end(rows.start) >= keys.end {
            TileVisibility::Full
        } else {
            TileVisibility::Partial
        }
    }

    /// Sets the masked scores of a partial tile to `-inf`. `scores` holds
    /// `rows.len()` rows of `row_stride` elements, column `c` being key
    /// `keys.start + c`.
    pub fn apply<T: Element>(
        &self,
        rows: &Range<usize>,
        keys: &Range<usize>,
        scores: &mut [T],
        row_stride: usize,
    ) {
        for (r, row) in rows.clone().zip(scores.chunks_mut(row_stride)) {
            let end = self.problem.visible_key_end(r).clamp(keys.start, keys.end);
            row[end - keys.start..keys.len()]
                .iter_mut()
                .for_each(|s| *s = T::NEG_INFINITY);
        }
    }
}
