//! Each computing thread's working memory, kept between tasks and calls
//! (`runtime/buffers.rs` says why) and sized before any task runs.

use super::tiles;
use std::any::Any;
use std::cell::RefCell;
use std::ops::Range;

use super::element::Element;
use super::softmax::RowState;
use super::tiles::TileSizes;
use crate::error::{Error, Result};
use crate::problem::Problem;

/// Per-thread working memory, reused across tasks.
pub(super) struct Scratch<T> {
    pub(super) q_scaled: Vec<T>,
    /// Transposed key or value tile for the SIMD products.
    pub(super) pack: Vec<T>,
    pub(super) scores: Vec<T>,
    pub(super) d_scores: Vec<T>,
    /// `tanh(u / softcap)` of the tile, for the softcap gradient.
    pub(super) tanh: Vec<T>,
    pub(super) acc: Vec<T>,
    /// A block of (scaled) query rows and of output-gradient rows, packed
    /// for the backward's `dK += dSᵀ Q` and `dV += Pᵀ dO`.
    pub(super) q_panels: Vec<T>,
    pub(super) d_out_panels: Vec<T>,
    /// `rowsum(dO ∘ O)` of a block of query rows.
    pub(super) delta: Vec<T>,
    pub(super) states: Vec<RowState<T>>,
    /// Each row's largest score of a tile, and 8 lanes a row to find it.
    pub(super) maxes: Vec<T>,
    pub(super) lanes: Vec<T>,
    /// The key tiles of the current query tile.
    pub(super) key_tiles: Vec<Range<usize>>,
}

impl<T: Element> Scratch<T> {
    pub(super) fn new() -> Self {
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
    pub(super) fn fit(&mut self, problem: &Problem, tiles: TileSizes) -> Result<()> {
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
    /// `runtime/buffers.rs` for why); boxed as `Any` to serve both element types.
    static SCRATCH: RefCell<Option<Box<dyn Any>>> = const { RefCell::new(None) };
}

/// Sizes the calling thread's scratch for `problem` before any task runs,
/// so that a problem whose working memory cannot be had is an error here
/// rather than an allocation failure inside a task (the other threads'
/// scratch is the same size).
pub(super) fn reserve_scratch<T: Element>(problem: &Problem, tiles: TileSizes) -> Result<()> {
    let kept = SCRATCH.with(|cell| cell.borrow_mut().take());
    let mut scratch = kept
        .and_then(|b| b.downcast::<Scratch<T>>().ok())
        .unwrap_or_else(|| Box::new(Scratch::new()));
    let fitted = scratch.fit(problem, tiles);
    SCRATCH.with(|cell| *cell.borrow_mut() = Some(scratch));
    fitted
}

/// Runs `f` with this thread's scratch, sized for `problem`.
pub(super) fn with_scratch<T: Element, R>(
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
