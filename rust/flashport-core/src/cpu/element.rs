//! The floating-point types the CPU kernels compute in.

use std::borrow::Cow;
use std::fmt::Debug;
use std::ops::{Add, AddAssign, Div, Mul, MulAssign, Sub};

use crate::{Buffer, Slice};

/// float32 or float64: the types the tile kernels are generic over.
pub trait Element:
    Copy
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
    const ZERO: Self;
    const ONE: Self;
    const NEG_INFINITY: Self;
    fn exp(self) -> Self;
    fn ln(self) -> Self;
    fn from_f64(x: f64) -> Self;
    fn max(self, other: Self) -> Self;
    /// Views an input in this type, converting (float16 inputs, a float32
    /// lse in a float64 problem) only when the stored type differs.
    fn view(s: Slice<'_>) -> Cow<'_, [Self]>;
    fn into_buffer(v: Vec<Self>) -> Buffer;
}

impl Element for f32 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
    const NEG_INFINITY: Self = f32::NEG_INFINITY;
    #[inline(always)]
    fn exp(self) -> Self {
        f32::exp(self)
    }
    #[inline(always)]
    fn ln(self) -> Self {
        f32::ln(self)
    }
    #[inline(always)]
    fn from_f64(x: f64) -> Self {
        x as f32
    }
    #[inline(always)]
    fn max(self, other: Self) -> Self {
        f32::max(self, other)
    }
    fn view(s: Slice<'_>) -> Cow<'_, [f32]> {
        match s {
            Slice::F32(x) => Cow::Borrowed(x),
            Slice::F16(x) => Cow::Owned(x.iter().map(|v| v.to_f32()).collect()),
            Slice::F64(x) => Cow::Owned(x.iter().map(|&v| v as f32).collect()),
        }
    }
    fn into_buffer(v: Vec<Self>) -> Buffer {
        Buffer::F32(v)
    }
}

impl Element for f64 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
    const NEG_INFINITY: Self = f64::NEG_INFINITY;
    #[inline(always)]
    fn exp(self) -> Self {
        f64::exp(self)
    }
    #[inline(always)]
    fn ln(self) -> Self {
        f64::ln(self)
    }
    #[inline(always)]
    fn from_f64(x: f64) -> Self {
        x
    }
    #[inline(always)]
    fn max(self, other: Self) -> Self {
        f64::max(self, other)
    }
    fn view(s: Slice<'_>) -> Cow<'_, [f64]> {
        match s {
            Slice::F64(x) => Cow::Borrowed(x),
            Slice::F32(x) => Cow::Owned(x.iter().map(|&v| v as f64).collect()),
            Slice::F16(x) => Cow::Owned(x.iter().map(|v| v.to_f64()).collect()),
        }
    }
    fn into_buffer(v: Vec<Self>) -> Buffer {
        Buffer::F64(v)
    }
}
