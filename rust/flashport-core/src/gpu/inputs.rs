//! A call's inputs as the GPU takes them: host bytes uploaded chunk by
//! chunk, or device arrays bound in place.

use std::sync::Arc;

// Also named from here by gpu/decode/, which imports them with the inputs.
pub(crate) use super::checks::{float16_error, float64_error};
use super::device_array;
use super::device_array::DeviceArray;
use super::pool::Pooled;
use super::transfer::Submission;
use crate::array::{Input, Slice};
use crate::error::{Error, Result};
use crate::problem::DType;

/// An input array as the bytes the shaders read (float16 or float32;
/// bfloat16 calls were widened to float32 by `bfloat16.rs` before this).
fn input_bytes<'a>(name: &str, s: &Slice<'a>) -> Result<&'a [u8]> {
    match *s {
        Slice::F32(x) => Ok(bytemuck::cast_slice(x)),
        Slice::F16(x) => Ok(bytemuck::cast_slice(x)),
        Slice::BF16(_) => Err(Error::DType {
            argument: name.to_string(),
            dtype: "bfloat16".to_string(),
            reason: "the GPU kernels read float32 or float16; this call was not widened \
                     from bfloat16"
                .to_string(),
        }),
        Slice::F64(_) => Err(float64_error(name)),
    }
}

/// The bytes of heads `first..first + count` of an array with `per_head` elements of
/// `elem` bytes each.
fn heads_of(bytes: &[u8], per_head: usize, elem: usize, first: usize, count: usize) -> &[u8] {
    &bytes[first * per_head * elem..(first + count) * per_head * elem]
}

/// Where a call's input comes from: host bytes uploaded chunk by chunk, or
/// an array already on the device.
#[derive(Clone, Copy)]
pub(crate) enum Source<'a> {
    Host(&'a [u8]),
    Device(&'a DeviceArray),
}

impl Source<'_> {
    /// A device array known to pass the screen (src/gpu/screen.rs).
    pub(crate) fn known_clean(&self) -> bool {
        matches!(self, Source::Device(a) if a.clean())
    }
}

pub(crate) fn source<'a>(name: &str, input: Input<'a>) -> Result<Source<'a>> {
    match input {
        Input::Host(s) => Ok(Source::Host(input_bytes(name, &s)?)),
        Input::Device(t) if t.dtype() == DType::F64 => Err(float64_error(name)),
        Input::Device(t) => Ok(Source::Device(t)),
    }
}

/// Heads `first..first + count` of an input, `per_head` elements of `eb`
/// bytes each, as a buffer the chunk binds: uploaded from the host, or
/// taken from the device array by commands recorded in `sub`.
pub(crate) fn chunk_input(
    sub: &mut Submission<'_>,
    name: &str,
    input: Source<'_>,
    (per_head, eb): (usize, usize),
    (first, count): (usize, usize),
) -> Result<Arc<Pooled>> {
    match input {
        Source::Host(bytes) => sub.upload(name, heads_of(bytes, per_head, eb, first, count)),
        Source::Device(t) => device_array::heads(sub.ctx(), sub, t, per_head, first, count),
    }
}
