//! The online-softmax step of FlashAttention-2, written once for the CPU.
//!
//! A query row keeps a running maximum `row_max`, a running sum `row_sum`
//! of `exp(s - row_max)` and an unnormalised output accumulator `acc` (the
//! names docs/design.md's glossary gives, the same in the shaders). When a
//! new tile of scores arrives, the maximum may grow; everything accumulated
//! so far was computed relative to the old maximum and is multiplied by
//! `rescale = exp(row_max_old - row_max_new)` so that the final
//! `acc / row_sum` is exact. A row that has seen no key yet has
//! `row_max = -inf` (the GPU uses a finite stand-in, `NEG_BIG`).

use super::element::Element;

/// Running state of one query row.
#[derive(Debug, Clone, Copy)]
pub struct RowState<T> {
    pub row_max: T,
    pub row_sum: T,
}

impl<T: Element> RowState<T> {
    pub const EMPTY: Self = RowState {
        row_max: T::NEG_INFINITY,
        row_sum: T::ZERO,
    };

    /// Folds one tile of scaled scores into the row. `scores` is
    /// overwritten with the unnormalised probabilities
    /// `exp(s - row_max_new)` (0 where a score is `-inf`), and the `rescale`
    /// the caller must apply to its output accumulator is returned.
    #[inline]
    pub fn absorb(&mut self, scores: &mut [T]) -> T {
        self.absorb_with_max(scores, T::row_max(scores))
    }

    /// [`RowState::absorb`] for a tile whose largest score is known.
    #[inline]
    pub fn absorb_with_max(&mut self, scores: &mut [T], tile_max: T) -> T {
        let new_max = self.row_max.max(tile_max);
        if new_max == T::NEG_INFINITY {
            // Every key seen so far is masked. Subtracting the maximum would
            // compute -inf - -inf = NaN, so the row stays empty instead.
            scores.iter_mut().for_each(|s| *s = T::ZERO);
            return T::ONE;
        }
        // The old maximum may be -inf (nothing visible yet); exp(-inf) = 0
        // then discards the (empty) accumulator, which is what we want.
        let rescale = (self.row_max - new_max).exp();
        let tile_sum = T::exp_shifted_sum(scores, new_max);
        self.row_sum = self.row_sum * rescale + tile_sum;
        self.row_max = new_max;
        rescale
    }

    /// [`RowState::finish`] with a sink logit in the denominator: the sink
    /// takes probability mass but adds nothing to the output, so the
    /// accumulator (relative to the old maximum) is rescaled to the new
    /// maximum by the normaliser itself. A row that saw no key still has
    /// output 0, and lse = sink.
    #[inline]
    pub fn finish_with_sink(&self, sink: T) -> (T, T) {
        if sink == T::NEG_INFINITY {
            return self.finish();
        }
        let new_max = self.row_max.max(sink);
        let rescale = (self.row_max - new_max).exp();
        let row_sum = self.row_sum * rescale + (sink - new_max).exp();
        (rescale / row_sum, new_max + row_sum.ln())
    }

    /// The normaliser of the accumulator and the row's log-sum-exp. A row
    /// that saw no key has output 0 and lse `-inf`.
    #[inline]
    pub fn finish(&self) -> (T, T) {
        if self.row_sum == T::ZERO {
            (T::ZERO, T::NEG_INFINITY)
        } else {
            (T::ONE / self.row_sum, self.row_max + self.row_sum.ln())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_tiles_equal_one_softmax() {
        let scores = [0.3f64, -1.2, 2.5, 0.0, 4.0, -3.0];
        let mut whole = RowState::EMPTY;
        let mut s = scores;
        whole.absorb(&mut s);
        let mut split = RowState::EMPTY;
        let (mut a, mut b) = ([0.3f64, -1.2, 2.5], [0.0f64, 4.0, -3.0]);
        split.absorb(&mut a);
        split.absorb(&mut b);
        assert!((whole.finish().1 - split.finish().1).abs() < 1e-12);
        let direct = scores.iter().map(|x| x.exp()).sum::<f64>().ln();
        assert!((whole.finish().1 - direct).abs() < 1e-12);
    }

    #[test]
    fn fully_masked_row_stays_finite() {
        let mut state = RowState::<f32>::EMPTY;
        let mut s = [f32::NEG_INFINITY; 4];
        assert_eq!(state.absorb(&mut s), 1.0);
        assert_eq!(s, [0.0; 4]);
        assert_eq!(state.finish(), (0.0, f32::NEG_INFINITY));
    }
}
