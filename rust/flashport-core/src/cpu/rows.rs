//! How both passes cut their work and read the arrays: row tiles of the
//! outputs (one parallel task each), the canonical layout's index helpers,
//! key tiles, and inputs with their non-finite entries cleared.

use std::ops::Range;

use super::element::Element;
use crate::problem::Problem;

/// One unit of parallel work: a tile of rows of one (batch, head) and the
/// disjoint output rows it owns.
pub(super) struct RowTile<'a, T> {
    /// Flat (batch, head) index: `batch * heads + head`.
    pub(super) head: usize,
    pub(super) rows: Range<usize>,
    pub(super) outputs: [&'a mut [T]; 2],
}

/// Cuts two outputs of `heads × seq × widths[i]` elements into row tiles,
/// none across the runs of rows `runs` (consecutive, covering `0..seq`).
pub(super) fn row_tiles<'a, T>(
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

/// Index helpers of one problem in canonical layout.
pub(super) struct Layout<'p> {
    pub(super) p: &'p Problem,
}

impl Layout<'_> {
    /// The key/value head a flat (batch, query head) index reads.
    pub(super) fn kv_head(&self, head: usize) -> usize {
        let (batch, h) = (head / self.p.heads_q, head % self.p.heads_q);
        batch * self.p.heads_kv + h / self.p.group_size()
    }
    pub(super) fn q_rows<'a, T>(&self, q: &'a [T], head: usize, rows: &Range<usize>) -> &'a [T] {
        let d = self.p.head_dim;
        &q[(head * self.p.seq_q + rows.start) * d..(head * self.p.seq_q + rows.end) * d]
    }
    pub(super) fn o_rows<'a, T>(&self, o: &'a [T], head: usize, rows: &Range<usize>) -> &'a [T] {
        let dv = self.p.value_dim;
        &o[(head * self.p.seq_q + rows.start) * dv..(head * self.p.seq_q + rows.end) * dv]
    }
    pub(super) fn k_rows<'a, T>(&self, k: &'a [T], kv_head: usize, keys: &Range<usize>) -> &'a [T] {
        let d = self.p.head_dim;
        &k[(kv_head * self.p.seq_k + keys.start) * d..(kv_head * self.p.seq_k + keys.end) * d]
    }
    pub(super) fn v_rows<'a, T>(&self, v: &'a [T], kv_head: usize, keys: &Range<usize>) -> &'a [T] {
        let dv = self.p.value_dim;
        &v[(kv_head * self.p.seq_k + keys.start) * dv..(kv_head * self.p.seq_k + keys.end) * dv]
    }
    /// The tile `keys` of one head of a `Packing::Transposed` result.
    pub(super) fn packed_tile<'a, T: Element>(
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
    pub(super) fn row_panels<'a, T: Element>(
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
    pub(super) fn row_scalars<'a, T>(
        &self,
        x: &'a [T],
        head: usize,
        rows: &Range<usize>,
    ) -> &'a [T] {
        &x[head * self.p.seq_q + rows.start..head * self.p.seq_q + rows.end]
    }
}

pub(super) fn scale_into<T: Element>(src: &[T], scale: T, dst: &mut [T]) {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = s * scale;
    }
}

/// Consecutive tiles of `tile` rows covering `rows` (the last may be short).
pub(super) fn key_tiles(rows: Range<usize>, tile: usize) -> impl Iterator<Item = Range<usize>> {
    let end = rows.end;
    rows.step_by(tile).map(move |s| s..(s + tile).min(end))
}

/// `x` (rows of `width`) with every NaN and infinity replaced by 0, and
/// the rows that held any.
pub(super) fn clean_rows<T: Element>(x: &[T], width: usize) -> (Vec<T>, Vec<usize>) {
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
