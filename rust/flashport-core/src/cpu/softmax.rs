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
    ///
    /// Non-finite scores follow docs/design.md#non-finite-inputs: a NaN
    /// makes `row_sum` NaN (through `exp`, or below where no finite score
    /// gives a maximum to subtract), a `+inf` makes the row "infinite"
    /// (`row_max = +inf`, `row_sum = +inf`, or NaN once a NaN came too),
    /// and either way the probabilities become NaN so that the output
    /// accumulator is NaN. `tile_max` may ignore NaN scores.
    #[inline]
    pub fn absorb_with_max(&mut self, scores: &mut [T], tile_max: T) -> T {
        let new_max = self.row_max.max(tile_max);
        if new_max == T::NEG_INFINITY {
            // Every key seen so far is masked. Subtracting the maximum would
            // compute -inf - -inf = NaN, so the row stays empty instead,
            // unless a NaN score hid from the maximum.
            if scores.iter().any(|s| s.is_nan()) {
                return self.poison(scores, T::NAN);
            }
            scores.iter_mut().for_each(|s| *s = T::ZERO);
            return T::ONE;
        }
        if new_max == T::INFINITY {
            let nan = self.row_sum.is_nan() || scores.iter().any(|s| s.is_nan());
            return self.poison(scores, if nan { T::NAN } else { T::INFINITY });
        }
        // The old maximum may be -inf (nothing visible yet); exp(-inf) = 0
        // then discards the (empty) accumulator, which is what we want.
        let rescale = (self.row_max - new_max).exp();
        let tile_sum = T::exp_shifted_sum(scores, new_max);
        self.row_sum = self.row_sum * rescale + tile_sum;
        self.row_max = new_max;
        rescale
    }

    /// A row that saw a NaN or `+inf` score: its lse will be `row_sum`
    /// (NaN or `+inf`), its output NaN (the probabilities and the rescale
    /// of the accumulator are NaN).
    #[cold]
    fn poison(&mut self, scores: &mut [T], row_sum: T) -> T {
        self.row_max = T::INFINITY;
        self.row_sum = row_sum;
        scores.iter_mut().for_each(|s| *s = T::NAN);
        T::NAN
    }

    /// [`RowState::finish`] with a sink logit in the denominator: the sink
    /// takes probability mass but adds nothing to the output, so the
    /// accumulator (relative to the old maximum) is rescaled to the new
    /// maximum by the normaliser itself. A row that saw no key still has
    /// output 0, and lse = sink. A NaN sink makes the row NaN, a `+inf`
    /// one infinite, like a score.
    #[inline]
    pub fn finish_with_sink(&self, sink: T) -> (T, T) {
        if sink == T::NEG_INFINITY {
            return self.finish();
        }
        if sink.is_nan() || self.row_sum.is_nan() {
            return (T::NAN, T::NAN);
        }
        if sink == T::INFINITY || self.row_max == T::INFINITY {
            return (T::NAN, T::INFINITY);
        }
        if self.row_sum == T::ZERO {
            // No key: the output is 0 whatever the accumulator holds.
            return (T::ZERO, sink);
        }
        let new_max = self.row_max.max(sink);
        let rescale = (self.row_max - new_max).exp();
        let row_sum = self.row_sum * rescale + (sink - new_max).exp();
        (rescale / row_sum, new_max + row_sum.ln())
    }

    /// The normaliser of the accumulator and the row's log-sum-exp. A row
    /// that saw no key has output 0 and lse `-inf`; one that saw a NaN
    /// (`+inf`) score has lse NaN (`+inf`) and a NaN normaliser. A
    /// normaliser of 0 means "the output is 0": the caller writes 0 where
    /// the accumulator is not finite (that of a row that saw no key may
    /// hold what hidden keys' values left in it: 0 times NaN).
    #[inline]
    pub fn finish(&self) -> (T, T) {
        if self.row_sum == T::ZERO {
            (T::ZERO, T::NEG_INFINITY)
        } else if self.row_max == T::INFINITY || self.row_sum.is_nan() {
            (T::NAN, self.row_sum)
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
    fn nan_and_infinite_scores_poison_the_row() {
        let (inf, nan) = (f64::INFINITY, f64::NAN);
        // NaN alone among hidden keys (the maximum ignores it).
        let mut state = RowState::<f64>::EMPTY;
        let mut s = [f64::NEG_INFINITY, nan];
        assert!(state.absorb(&mut s).is_nan());
        assert!(state.finish().0.is_nan() && state.finish().1.is_nan());
        // +inf: lse +inf, NaN output; a later NaN makes the lse NaN.
        let mut state = RowState::<f64>::EMPTY;
        state.absorb(&mut [1.0, 2.0]);
        assert!(state.absorb(&mut [inf, 0.0]).is_nan());
        assert_eq!(state.finish().1, inf);
        assert!(state.finish().0.is_nan());
        state.absorb(&mut [3.0]);
        assert_eq!(state.finish().1, inf);
        state.absorb(&mut [nan]);
        assert!(state.finish().1.is_nan());
        // Sinks: NaN and +inf like a score; -inf is no sink.
        let mut state = RowState::<f64>::EMPTY;
        state.absorb(&mut [0.5]);
        assert!(state.finish_with_sink(nan).1.is_nan());
        assert_eq!(state.finish_with_sink(inf).1, inf);
        assert!(state.finish_with_sink(inf).0.is_nan());
        assert_eq!(state.finish_with_sink(f64::NEG_INFINITY), state.finish());
        // A row that saw no key: output 0, lse = sink.
        assert_eq!(RowState::<f64>::EMPTY.finish_with_sink(0.25), (0.0, 0.25));
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
