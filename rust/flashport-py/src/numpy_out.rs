//! A core result on the host as the NumPy array of its shape (float16,
//! bfloat16 through ml_dtypes, float32, float64): what every call returns
//! for host outputs, and `DeviceArray.numpy()`.

use flashport_core::Buffer;
use numpy::{PyArray1, PyArrayMethods};
use pyo3::prelude::*;

pub(crate) fn to_numpy<'py>(
    py: Python<'py>,
    buffer: Buffer,
    shape: &[usize],
) -> PyResult<Bound<'py, PyAny>> {
    let array = match buffer {
        Buffer::F16(v) => PyArray1::from_vec(py, v).reshape(shape)?.into_any(),
        // Only a bfloat16 call returns bfloat16, so ml_dtypes is loaded.
        Buffer::BF16(v) => PyArray1::from_vec(py, v).reshape(shape)?.into_any(),
        Buffer::F32(v) => PyArray1::from_vec(py, v).reshape(shape)?.into_any(),
        Buffer::F64(v) => PyArray1::from_vec(py, v).reshape(shape)?.into_any(),
    };
    Ok(array)
}
