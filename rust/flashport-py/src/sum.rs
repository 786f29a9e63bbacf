//! `sum_widened`: same-shaped float16, bfloat16 and float32 arrays summed
//! in float32 and rounded once (`flashport.dask`'s gradient sums).

use std::mem::MaybeUninit;

use flashport_core as core;
use flashport_core::{ArrayInfo, DType, Slice, SumOut};

use crate::arrays::{ArgMeta, Contiguous, Held};
use crate::detach::run_detached;
use crate::errors::{to_py_err, validated};
use numpy::{Element, PyArrayDyn, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::prelude::*;

/// sum_widened(parts, dtype) -> array
///
/// `parts[0] + parts[1] + …` left to right in float32, rounded once to
/// `dtype` (a NumPy dtype name: float16, bfloat16 or float32). The parts
/// are NumPy arrays of one shape, float16, bfloat16 or float32 each; they
/// are only read (one that is not C-contiguous is copied first).
#[pyfunction]
#[pyo3(signature = (parts, dtype))]
pub(crate) fn sum_widened<'py>(
    py: Python<'py>,
    parts: Vec<Bound<'py, PyAny>>,
    dtype: &str,
) -> PyResult<Bound<'py, PyAny>> {
    let names: Vec<String> = (0..parts.len()).map(|i| format!("parts[{i}]")).collect();
    let metas = parts
        .iter()
        .zip(&names)
        .map(|(a, name)| ArgMeta::read(name, a))
        .collect::<PyResult<Vec<_>>>()?;
    let infos: Vec<ArrayInfo<'_>> = metas.iter().map(ArgMeta::info).collect();
    let problem = validated(py, core::validate_sum(&infos, dtype))?;
    // Validation has accepted each dtype; extraction checks it again.
    let held = parts
        .iter()
        .zip(&metas)
        .map(|(a, m)| Held::host(a, DType::from_numpy_name(&m.dtype).unwrap_or(DType::F32)))
        .collect::<PyResult<Vec<_>>>()?;
    let data = held
        .iter()
        .zip(&names)
        .map(|(h, name)| h.contiguous(name))
        .collect::<PyResult<Vec<_>>>()?;
    // Held::host holds NumPy arrays only: every one is a host slice.
    let slices: Vec<Slice<'_>> = data.iter().filter_map(Contiguous::slice).collect();
    let shape = &problem.shape;
    let sum = |out: SumOut<'_>| run_detached(py, || core::sum_widened_into(&problem, &slices, out));
    match problem.dtype {
        DType::F16 => new_array(py, shape, |out| sum(SumOut::F16(out))),
        DType::BF16 => new_array(py, shape, |out| sum(SumOut::BF16(out))),
        _ => new_array(py, shape, |out| sum(SumOut::F32(out))),
    }
}

/// A new C-contiguous NumPy array of `shape` whose elements `write` writes,
/// every one, before the array reaches Python (on an error it never does).
/// Made by `numpy.empty`: NumPy's allocator asks the kernel for huge
/// pages (two parts of 16M float32 summed into a Rust vector took 16,385
/// page faults and 26–35 ms, NumPy's own add 544 faults and 11–14 ms),
/// and a failed allocation is NumPy's MemoryError, not a panic.
fn new_array<'py, T: Element>(
    py: Python<'py>,
    shape: &[usize],
    write: impl FnOnce(&mut [MaybeUninit<T>]) -> PyResult<()>,
) -> PyResult<Bound<'py, PyAny>> {
    // Validation has checked that the element count fits in memory's
    // address range.
    let bytes = shape.iter().product::<usize>() as u128 * std::mem::size_of::<T>() as u128;
    if !core::host_memory::admits(bytes) {
        return Err(to_py_err(
            py,
            core::Error::TooLarge(format!(
                "the sum needs {bytes} bytes of host memory, which could not be allocated{}",
                core::host_memory::why()
            )),
        ));
    }
    let array = py
        .import("numpy")?
        .call_method1("empty", (shape.to_vec(), T::get_dtype(py)))?
        .cast_into::<PyArrayDyn<T>>()?;
    let data: &mut [MaybeUninit<T>] = match array.len() {
        0 => &mut [],
        // SAFETY: the array was just made, C-contiguous with `len`
        // elements of `T`, and nothing else holds it while `data` lives;
        // its elements are plain numbers, written before they are read.
        len => unsafe { std::slice::from_raw_parts_mut(array.data().cast(), len) },
    };
    write(data)?;
    Ok(array.into_any())
}
