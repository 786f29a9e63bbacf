//! float32 and float64 as numbers: the arithmetic every CPU kernel is
//! generic over. Below the portable tile products (`kernels.rs`) and the
//! elements (`element.rs`), whose tile products default to those kernels,
//! so that the two do not import each other.

use std::fmt::Debug;
use std::ops::{Add, AddAssign, Div, Mul, MulAssign, Sub};

use crate::variants::MaskScalar;

/// float32 or float64 as the arithmetic sees them. `ZERO`,
/// `NEG_INFINITY` and `from_f64` come from [`MaskScalar`].
pub trait Real:
    MaskScalar
    + Copy
    + Default
    + Debug
    + Send
    + Sync
    + PartialOrd
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + AddAssign
    + MulAssign
    + 'static
{
    const ONE: Self;
    const INFINITY: Self;
    const NAN: Self;
    fn is_nan(self) -> bool;
    /// Neither NaN nor an infinity.
    fn is_finite(self) -> bool;
    fn exp(self) -> Self;
    fn ln(self) -> Self;
    fn tanh(self) -> Self;
    fn max(self, other: Self) -> Self;
}

impl Real for f32 {
    const ONE: Self = 1.0;
    const INFINITY: Self = f32::INFINITY;
    const NAN: Self = f32::NAN;
    #[inline(always)]
    fn is_nan(self) -> bool {
        f32::is_nan(self)
    }
    #[inline(always)]
    fn is_finite(self) -> bool {
        f32::is_finite(self)
    }
    fn tanh(self) -> Self {
        f32::tanh(self)
    }
    #[inline(always)]
    fn exp(self) -> Self {
        f32::exp(self)
    }
    #[inline(always)]
    fn ln(self) -> Self {
        f32::ln(self)
    }
    #[inline(always)]
    fn max(self, other: Self) -> Self {
        f32::max(self, other)
    }
}

impl Real for f64 {
    const ONE: Self = 1.0;
    const INFINITY: Self = f64::INFINITY;
    const NAN: Self = f64::NAN;
    #[inline(always)]
    fn is_nan(self) -> bool {
        f64::is_nan(self)
    }
    #[inline(always)]
    fn is_finite(self) -> bool {
        f64::is_finite(self)
    }
    fn tanh(self) -> Self {
        f64::tanh(self)
    }
    #[inline(always)]
    fn exp(self) -> Self {
        f64::exp(self)
    }
    #[inline(always)]
    fn ln(self) -> Self {
        f64::ln(self)
    }
    #[inline(always)]
    fn max(self, other: Self) -> Self {
        f64::max(self, other)
    }
}
