//! Arrays as the binding takes and gives them: each argument's metadata,
//! held as NumPy or a DeviceArray, viewed contiguously, and results back
//! to NumPy or DeviceArrays.

use std::borrow::Cow;

use flashport_core as core;
use flashport_core::{bf16, f16, Array, ArrayInfo, DType, Device, Input, Slice};

use crate::detach::run_detached;
use crate::device_array::DeviceArray;
use crate::errors::{to_py_err, validated};
use crate::numpy_out::to_numpy;
use crate::scalars;
use numpy::ndarray::{Axis, Slice as AxisRange};
use numpy::{Element, PyReadonlyArrayDyn, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;

/// Shape and dtype name of an argument, for validation.
pub(crate) struct ArgMeta {
    pub(crate) shape: Vec<usize>,
    pub(crate) dtype: String,
}

impl ArgMeta {
    /// A NumPy array's, or a device tensor's: validation treats both alike.
    pub(crate) fn read_main(name: &str, array: &Bound<'_, PyAny>) -> PyResult<ArgMeta> {
        match array.cast::<DeviceArray>() {
            Ok(t) => {
                let t = &t.get().inner;
                Ok(ArgMeta {
                    shape: t.shape().to_vec(),
                    dtype: t.dtype().numpy_name().to_string(),
                })
            }
            Err(_) => ArgMeta::read(name, array),
        }
    }

    pub(crate) fn read(name: &str, array: &Bound<'_, PyAny>) -> PyResult<ArgMeta> {
        let untyped = array.cast::<PyUntypedArray>().map_err(|_| {
            PyTypeError::new_err(format!(
                "{name} must be a numpy.ndarray, got {}",
                array
                    .get_type()
                    .name()
                    .map_or_else(|_| "?".to_string(), |n| n.to_string())
            ))
        })?;
        let dtype = untyped.dtype().getattr("name")?.extract::<String>()?;
        Ok(ArgMeta {
            shape: untyped.shape().to_vec(),
            dtype,
        })
    }
    pub(crate) fn info(&self) -> ArrayInfo<'_> {
        ArrayInfo::new(&self.shape, &self.dtype)
    }
}

/// An input array held for the duration of a call: the NumPy borrow, or
/// the device array.
pub(crate) enum Held<'py> {
    F16(PyReadonlyArrayDyn<'py, f16>),
    /// Through `ml_dtypes`' NumPy dtype: only an array of that dtype gets
    /// here, so the dtype is registered.
    BF16(PyReadonlyArrayDyn<'py, bf16>),
    F32(PyReadonlyArrayDyn<'py, f32>),
    F64(PyReadonlyArrayDyn<'py, f64>),
    Device(Bound<'py, DeviceArray>),
}

/// A held array's data as the core takes it: one contiguous row-major
/// slice (copied only when the NumPy array is not C-contiguous), or the
/// device array.
pub(crate) enum Contiguous<'a> {
    F16(Cow<'a, [f16]>),
    BF16(Cow<'a, [bf16]>),
    F32(Cow<'a, [f32]>),
    F64(Cow<'a, [f64]>),
    Device(&'a core::DeviceArray),
}

/// The array's elements in one row-major slice: the array's own memory
/// when it is C-contiguous, else a copy. The copy's memory is reserved
/// fallibly, so that a view larger than memory (a broadcast stride-0
/// array, say) is a ProblemTooLargeError naming it instead of an abort.
///
/// The axes flagged in `once` (see `core::broadcast`: repeated, stride 0)
/// are read at their first index only.
pub(crate) fn contiguous<'a, T: Element + Clone>(
    name: &str,
    array: &'a PyReadonlyArrayDyn<'_, T>,
    once: &[bool],
) -> PyResult<Cow<'a, [T]>> {
    let mut view = array.as_array();
    for (axis, _) in once.iter().enumerate().filter(|(_, &o)| o) {
        view.slice_axis_inplace(Axis(axis), AxisRange::from(0..1));
    }
    if let Some(slice) = view.to_slice() {
        return Ok(Cow::Borrowed(slice));
    }
    let mut copy = Vec::new();
    let bytes = view.len() as u128 * std::mem::size_of::<T>() as u128;
    if !core::host_memory::admits(bytes) || copy.try_reserve_exact(view.len()).is_err() {
        return Err(to_py_err(
            array.py(),
            core::Error::TooLarge(format!(
                "{name} is not contiguous, and a contiguous copy of it ({bytes} bytes) \
                 could not be allocated{}; pass a smaller array, or for a broadcast one \
                 the array it broadcasts",
                core::host_memory::why()
            )),
        ));
    }
    // Row by row where the last axis is contiguous (a transposed or sliced
    // array, as PyTorch and transformers hand over): a memcpy per row
    // instead of an index computation per element, 5-10x faster.
    match view.ndim() {
        0 => copy.extend(view.iter().cloned()),
        n if view.strides()[n - 1] == 1 => {
            for row in view.rows() {
                match row.as_slice() {
                    Some(row) => copy.extend_from_slice(row),
                    None => copy.extend(row.iter().cloned()),
                }
            }
        }
        _ => copy.extend(view.iter().cloned()),
    }
    Ok(Cow::Owned(copy))
}

impl<'py> Held<'py> {
    /// A device array as it is; a NumPy array as `dtype` (validation has
    /// checked that it has that dtype).
    pub(crate) fn new(array: &Bound<'py, PyAny>, dtype: DType) -> PyResult<Held<'py>> {
        match array.cast::<DeviceArray>() {
            Ok(t) => Ok(Held::Device(t.clone())),
            Err(_) => Held::host(array, dtype),
        }
    }
    /// A NumPy array as `dtype` (variant arrays, `to_device`'s argument).
    pub(crate) fn host(array: &Bound<'py, PyAny>, dtype: DType) -> PyResult<Held<'py>> {
        Ok(match dtype {
            DType::F16 => Held::F16(array.extract()?),
            DType::BF16 => Held::BF16(array.extract()?),
            DType::F32 => Held::F32(array.extract()?),
            DType::F64 => Held::F64(array.extract()?),
        })
    }
    /// The data as the core takes it; `name` is the argument's, for the
    /// error when a copy cannot be made.
    pub(crate) fn contiguous(&self, name: &str) -> PyResult<Contiguous<'_>> {
        self.contiguous_once(name, &[])
    }
    /// As `contiguous`, reading the axes flagged in `once` at their first
    /// index only (a NumPy array's repeated axes; a device array has none).
    pub(crate) fn contiguous_once(&self, name: &str, once: &[bool]) -> PyResult<Contiguous<'_>> {
        Ok(match self {
            Held::F16(a) => Contiguous::F16(contiguous(name, a, once)?),
            Held::BF16(a) => Contiguous::BF16(contiguous(name, a, once)?),
            Held::F32(a) => Contiguous::F32(contiguous(name, a, once)?),
            Held::F64(a) => Contiguous::F64(contiguous(name, a, once)?),
            Held::Device(t) => Contiguous::Device(&t.get().inner),
        })
    }
    /// The axes along which a NumPy array repeats one slice (stride 0).
    pub(crate) fn repeated_axes(&self) -> Vec<bool> {
        fn of<T: Element>(a: &PyReadonlyArrayDyn<'_, T>) -> Vec<bool> {
            let view = a.as_array();
            core::broadcast::repeated_axes(view.shape(), view.strides())
        }
        match self {
            Held::F16(a) => of(a),
            Held::BF16(a) => of(a),
            Held::F32(a) => of(a),
            Held::F64(a) => of(a),
            Held::Device(_) => Vec::new(),
        }
    }
}

impl Contiguous<'_> {
    pub(crate) fn input(&self) -> Input<'_> {
        match self {
            Contiguous::F16(c) => Input::Host(Slice::F16(c)),
            Contiguous::BF16(c) => Input::Host(Slice::BF16(c)),
            Contiguous::F32(c) => Input::Host(Slice::F32(c)),
            Contiguous::F64(c) => Input::Host(Slice::F64(c)),
            Contiguous::Device(t) => Input::Device(t),
        }
    }
    /// The host slice of a host array (variant arrays and `to_device`'s
    /// argument are never device arrays).
    pub(crate) fn slice(&self) -> Option<Slice<'_>> {
        match self.input() {
            Input::Host(s) => Some(s),
            Input::Device(_) => None,
        }
    }
}

pub(crate) fn is_device(array: &Bound<'_, PyAny>) -> bool {
    array.is_instance_of::<DeviceArray>()
}

/// An output: a NumPy array of `shape`, or a device tensor (which has its
/// shape).
pub(crate) fn to_python<'py>(
    py: Python<'py>,
    array: Array,
    shape: &[usize],
) -> PyResult<Bound<'py, PyAny>> {
    match array {
        Array::Host(buffer) => to_numpy(py, buffer, shape),
        Array::Device(inner) => Ok(Bound::new(py, DeviceArray { inner })?.into_any()),
    }
}

pub(crate) fn lse_dtype(meta: &ArgMeta) -> DType {
    // validate_backward has accepted only float32 and float64 here.
    DType::from_numpy_name(&meta.dtype).unwrap_or(DType::F32)
}

/// The device a call runs on, from `device=` as the caller gave it.
pub(crate) fn device_of(
    py: Python<'_>,
    device: &Bound<'_, PyAny>,
    on_gpu: bool,
) -> PyResult<Device> {
    let device = scalars::device_name(device)?;
    validated(py, Device::parse_for(device.as_deref(), on_gpu))
}

/// The six arrays of a backward (do, q, k, v, o, lse) held in the
/// problem's dtype, lse in its own (`lse_meta`).
pub(crate) fn hold_backward<'py>(
    arrays: &[&Bound<'py, PyAny>; 6],
    lse_meta: &ArgMeta,
    dtype: DType,
) -> PyResult<[Held<'py>; 6]> {
    let [d_out, q, k, v, out, lse] = *arrays;
    Ok([
        Held::new(d_out, dtype)?,
        Held::new(q, dtype)?,
        Held::new(k, dtype)?,
        Held::new(v, dtype)?,
        Held::new(out, dtype)?,
        Held::new(lse, lse_dtype(lse_meta))?,
    ])
}

/// The data of a backward's held arrays, named for errors.
pub(crate) fn backward_contiguous<'a>(
    held: &'a [Held<'_>; 6],
    names: &[&str; 6],
) -> PyResult<[Contiguous<'a>; 6]> {
    let [a, b, c, d, e, f] = held;
    Ok([
        a.contiguous(names[0])?,
        b.contiguous(names[1])?,
        c.contiguous(names[2])?,
        d.contiguous(names[3])?,
        e.contiguous(names[4])?,
        f.contiguous(names[5])?,
    ])
}

/// Original dtype name of an optional argument, to return its gradient in.
pub(crate) fn dtype_name(meta: &Option<ArgMeta>) -> Option<String> {
    meta.as_ref().map(|m| m.dtype.clone())
}

pub(crate) fn as_dtype<'py>(
    array: Bound<'py, PyAny>,
    dtype: Option<String>,
) -> PyResult<Bound<'py, PyAny>> {
    match dtype {
        Some(dtype) => array.call_method1("astype", (dtype,)),
        None => Ok(array),
    }
}

/// The entries of an integer argument `name` (cache_seqlens, block_table,
/// tokens) as i64, for the core to check; empty for a dtype that is no
/// integer type (the core refuses it by name). An unsigned length or token
/// above i64::MAX is refused by the core's conversion, by index and value
/// (every one is used); a block table's saturate (see below).
pub(crate) fn int_values(name: &str, array: &Bound<'_, PyAny>, dtype: &str) -> PyResult<Vec<i64>> {
    /// Each entry widened by `f`: read straight from a C-contiguous array
    /// (a block table of 256k entries took a millisecond through
    /// `astype` and ndarray's element iterator).
    fn each<T: Element + Copy>(array: &Bound<'_, PyAny>, f: fn(T) -> i64) -> PyResult<Vec<i64>> {
        let held: PyReadonlyArrayDyn<'_, T> = array.extract()?;
        let view = held.as_array();
        Ok(match view.as_slice() {
            Some(entries) => entries.iter().map(|&v| f(v)).collect(),
            None => view.iter().map(|&v| f(v)).collect(),
        })
    }
    match dtype {
        "int64" => each::<i64>(array, |v| v),
        "int32" => each::<i32>(array, i64::from),
        "int16" => each::<i16>(array, i64::from),
        "int8" => each::<i8>(array, i64::from),
        "uint32" => each::<u32>(array, i64::from),
        "uint16" => each::<u16>(array, i64::from),
        "uint8" => each::<u8>(array, i64::from),
        // A table's entries past a sequence's length are never read and may
        // be anything (-1 cast to uint64 among them): they saturate, and a
        // used one that does is out of range either way.
        "uint64" if name == "block_table" => {
            each::<u64>(array, |v| i64::try_from(v).unwrap_or(i64::MAX))
        }
        "uint64" => {
            let held: PyReadonlyArrayDyn<'_, u64> = array.extract()?;
            let view = held.as_array();
            let widened = core::scalar::int64_entries(name, view.shape(), view.iter().copied());
            widened.map_err(|e| to_py_err(array.py(), e))
        }
        _ => Ok(Vec::new()),
    }
}

/// to_device(array, device=None) -> DeviceArray: uploads a float32 or
/// float16 NumPy array to a GPU (None, "gpu" and "auto": the default one;
/// "gpu:N"). The private entry point behind flashport.to_device.
#[pyfunction]
#[pyo3(signature = (array, device=None))]
pub(crate) fn to_device(
    py: Python<'_>,
    array: &Bound<'_, PyAny>,
    device: Option<&Bound<'_, PyAny>>,
) -> PyResult<DeviceArray> {
    let name = match device {
        Some(device) => scalars::device_name(device)?,
        None => None,
    };
    let gpu = validated(py, core::device::parse_gpu(name.as_deref()))?;
    let meta = ArgMeta::read("array", array)?;
    let dtype = DType::from_numpy_name(&meta.dtype).ok_or_else(|| {
        to_py_err(
            py,
            core::Error::DType {
                argument: "array".to_string(),
                dtype: meta.dtype.clone(),
                reason: "the GPU computes in float32 or float16".to_string(),
            },
        )
    })?;
    let held = Held::host(array, dtype)?;
    // The GPU's limit first: an array no device buffer can hold is refused
    // before a contiguous copy of it is made.
    if dtype != DType::F64 {
        let element = if dtype == DType::F16 { 2 } else { 4 };
        let bytes = meta.shape.iter().map(|&n| n as u64).product::<u64>() * element;
        validated(py, core::gpu::check_array_bytes(gpu, "array", bytes))?;
    }
    let contiguous = held.contiguous("array")?;
    let slice = contiguous
        .slice()
        .ok_or_else(|| PyTypeError::new_err("array must be a numpy.ndarray"))?;
    let inner = run_detached(py, || {
        core::gpu::to_device_on(gpu, "array", slice, &meta.shape)
    })?;
    Ok(DeviceArray { inner })
}
