//! The online-softmax step of FlashAttention-2, written once for the CPU.
//!
//! A query row keeps a reference maximum `m`, a running sum `l` of
//! `exp(s - m)` and an unnormalised output accumulator. When a new tile of
//! scores arrives whose maximum is well above `m`, the reference moves;
//! everything accumulated so far was computed relative to the old one and
//! is rescaled by `exp(m_old - m_new)` so that the final `acc / l` is
//! exact (FlashAttention-4's conditional rescaling).

use super::element::Element;

/// How far a tile's maximum may exceed the row's reference maximum before
/// the reference moves: probabilities stay below `e^8 ≈ 2981`, so neither
/// they nor a row's sum of them can overflow, and float32 keeps the same
/// relative precision as with the exact running maximum.
pub const RESCALE_MARGIN: f64 = 8.0;

/// Running state of one query row.
#[derive(Debug, Clone, Copy)]
pub struct RowState<T> {
    pub max: T,
    pub sum: T,
    /// Scores (and `max`) in base 2, `s · log2 e`: probabilities are then
    /// `2^(s - max)` (see `simd::pow8xn` for why).
    pub base2: bool,
}

impl<T: Element> RowState<T> {
    pub const EMPTY: Self = RowState {
        max: T::NEG_INFINITY,
        sum: T::ZERO,
        base2: false,
    };

    /// An empty row whose scores come in base 2 when `base2`.
    pub fn new(base2: bool) -> Self {
        RowState {
            base2,
            ..Self::EMPTY
        }
    }

    /// `e^x`, or `2^x` in base 2.
    #[inline]
    fn pow(&self, x: T) -> T {
        if self.base2 {
            (x * T::from_f64(std::f64::consts::LN_2)).exp()
        } else {
            x.exp()
        }
    }

    /// A score of this row's base in natural units.
    #[inline]
    fn natural(&self, x: T) -> T {
        if self.base2 {
            x * T::from_f64(std::f64::consts::LN_2)
        } else {
            x
        }
    }

    #[inline]
    fn exp_shifted_sum(&self, scores: &mut [T], shift: T) -> T {
        if self.base2 {
            T::exp2_shifted_sum(scores, shift)
        } else {
            T::exp_shifted_sum(scores, shift)
        }
    }

    /// Folds one tile of scaled scores into the row. `scores` is
    /// overwritten with the unnormalised probabilities `exp(s - m_new)`
    /// (0 where a score is `-inf`), and the factor the caller must apply
    /// to its output accumulator is returned.
    #[inline]
    pub fn absorb(&mut self, scores: &mut [T]) -> T {
        self.absorb_with_max(scores, T::row_max(scores))
    }

    /// [`RowState::absorb`] for a tile whose largest score is known.
    ///
    /// The maximum is only a reference: it moves (and the accumulator is
    /// rescaled) when a tile's maximum exceeds it by more than
    /// [`RESCALE_MARGIN`], or on the first visible tile. Otherwise the tile
    /// is exponentiated against the old reference, probabilities up to
    /// `e^8` that float32 holds without loss; that lets the SIMD forward
    /// compute them while the scores are still in registers (see
    /// [`RowState::keeps`]). A row's result depends only on its own scores
    /// and the key tiling, never on which of the two paths ran.
    #[inline]
    pub fn absorb_with_max(&mut self, scores: &mut [T], tile_max: T) -> T {
        if self.keeps(tile_max) {
            let shift = self.max;
            self.add_sum(self.exp_shifted_sum(scores, shift));
            return T::ONE;
        }
        let new_max = self.max.max(tile_max);
        if new_max == T::NEG_INFINITY {
            // Every key seen so far is masked. Subtracting the maximum would
            // compute -inf - -inf = NaN, so the row stays empty instead.
            scores.iter_mut().for_each(|s| *s = T::ZERO);
            return T::ONE;
        }
        // The old maximum may be -inf (nothing visible yet); exp(-inf) = 0
        // then discards the (empty) accumulator, which is what we want.
        let correction = self.pow(self.max - new_max);
        let tile_sum = self.exp_shifted_sum(scores, new_max);
        self.sum = self.sum * correction + tile_sum;
        self.max = new_max;
        correction
    }

    /// Whether a tile with largest score `tile_max` is exponentiated
    /// against the current reference (no rescaling); then its probabilities
    /// are `exp(s - self.max)` and their sum goes to [`RowState::add_sum`].
    #[inline]
    pub fn keeps(&self, tile_max: T) -> bool {
        self.max != T::NEG_INFINITY && tile_max <= self.max + T::from_f64(RESCALE_MARGIN)
    }

    /// Adds the sum of a kept tile's probabilities.
    #[inline]
    pub fn add_sum(&mut self, tile_sum: T) {
        self.sum += tile_sum;
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
        let sink = if self.base2 {
            sink * T::from_f64(std::f64::consts::LOG2_E)
        } else {
            sink
        };
        let new_max = self.max.max(sink);
        let correction = self.pow(self.max - new_max);
        let sum = self.sum * correction + self.pow(sink - new_max);
        (correction / sum, self.natural(new_max) + sum.ln())
    }

    /// The normaliser of the accumulator and the row's log-sum-exp. A row
    /// that saw no key has output 0 and lse `-inf`.
    #[inline]
    pub fn finish(&self) -> (T, T) {
        if self.sum == T::ZERO {
            (T::ZERO, T::NEG_INFINITY)
        } else {
            (T::ONE / self.sum, self.natural(self.max) + self.sum.ln())
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
