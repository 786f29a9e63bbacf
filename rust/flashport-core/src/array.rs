//! The arrays a call takes and returns, by where they live: a [`Slice`]
//! borrows host memory and a [`Buffer`] owns it; a [`DeviceArray`] lives
//! on the GPU; an [`Input`] is either of the borrowed kinds, an [`Array`]
//! either of the owned ones, and a [`Placement`] says where a call leaves
//! its outputs.
//!
//! `Input` and `Array` name the GPU's [`DeviceArray`], whose machinery
//! (its context, its buffer) is the GPU backend's: the one import of the
//! crate that runs up (docs/development.md, Layers).

use half::{bf16, f16};

use crate::error::{Error, Result};
use crate::gpu::DeviceArray;
use crate::problem::DType;

/// A borrowed, contiguous, row-major input array.
#[derive(Debug, Clone, Copy)]
pub enum Slice<'a> {
    F16(&'a [f16]),
    BF16(&'a [bf16]),
    F32(&'a [f32]),
    F64(&'a [f64]),
}

/// An owned, contiguous, row-major output array.
#[derive(Debug, Clone, PartialEq)]
pub enum Buffer {
    F16(Vec<f16>),
    BF16(Vec<bf16>),
    F32(Vec<f32>),
    F64(Vec<f64>),
}

impl Slice<'_> {
    pub fn len(&self) -> usize {
        match self {
            Slice::F16(s) => s.len(),
            Slice::BF16(s) => s.len(),
            Slice::F32(s) => s.len(),
            Slice::F64(s) => s.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn dtype(&self) -> DType {
        match self {
            Slice::F16(_) => DType::F16,
            Slice::BF16(_) => DType::BF16,
            Slice::F32(_) => DType::F32,
            Slice::F64(_) => DType::F64,
        }
    }
}

/// An input array: a host slice, or a tensor resident on the GPU.
#[derive(Debug, Clone, Copy)]
pub enum Input<'a> {
    Host(Slice<'a>),
    Device(&'a DeviceArray),
}

impl<'a> From<Slice<'a>> for Input<'a> {
    fn from(s: Slice<'a>) -> Self {
        Input::Host(s)
    }
}

impl<'a> From<&'a DeviceArray> for Input<'a> {
    fn from(t: &'a DeviceArray) -> Self {
        Input::Device(t)
    }
}

impl Input<'_> {
    pub fn len(&self) -> usize {
        match self {
            Input::Host(s) => s.len(),
            Input::Device(t) => t.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn dtype(&self) -> DType {
        match self {
            Input::Host(s) => s.dtype(),
            Input::Device(t) => t.dtype(),
        }
    }
    pub fn is_device(&self) -> bool {
        matches!(self, Input::Device(_))
    }
}

/// An output array: read back into host memory, or kept on the GPU.
#[derive(Debug, Clone)]
pub enum Array {
    Host(Buffer),
    Device(DeviceArray),
}

impl Array {
    /// The array in host memory, read back if it is on the GPU.
    pub fn into_host(self) -> Result<Buffer> {
        match self {
            Array::Host(b) => Ok(b),
            Array::Device(t) => t.read(),
        }
    }
}

/// Where a call leaves its outputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Placement {
    /// Read back into host memory.
    Host,
    /// Kept on the GPU as [`DeviceArray`]s.
    Device,
}

impl Placement {
    /// Results live where the inputs live: on the GPU if any input does.
    pub fn of_inputs(inputs: &[Input<'_>]) -> Placement {
        if inputs.iter().any(Input::is_device) {
            Placement::Device
        } else {
            Placement::Host
        }
    }
}

impl Buffer {
    /// The buffer as an input slice.
    pub fn as_slice(&self) -> Slice<'_> {
        match self {
            Buffer::F16(x) => Slice::F16(x),
            Buffer::BF16(x) => Slice::BF16(x),
            Buffer::F32(x) => Slice::F32(x),
            Buffer::F64(x) => Slice::F64(x),
        }
    }
    pub fn len(&self) -> usize {
        match self {
            Buffer::F16(s) => s.len(),
            Buffer::BF16(s) => s.len(),
            Buffer::F32(s) => s.len(),
            Buffer::F64(s) => s.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Checks that an input holds the elements and the dtype a validated
/// problem needs, naming the argument.
pub(crate) fn check_len(argument: &str, got: &Input<'_>, want: usize, dtype: DType) -> Result<()> {
    if got.len() != want {
        return Err(Error::Shape(format!(
            "{argument} holds {} elements but the problem needs {want}",
            got.len()
        )));
    }
    if got.dtype() != dtype {
        return Err(Error::DType {
            argument: argument.to_string(),
            dtype: got.dtype().numpy_name().to_string(),
            reason: format!("the problem was validated for {}", dtype.numpy_name()),
        });
    }
    Ok(())
}
