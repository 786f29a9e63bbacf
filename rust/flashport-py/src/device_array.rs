//! `DeviceArray`, the GPU tensor behind `flashport.DeviceArray`, and the
//! GPU as a whole: `to_device`, `synchronize`, `devices` and the kernel
//! timing hooks.

use std::panic::catch_unwind;

use flashport_core as core;
use flashport_core::Device;

use crate::detach::run_detached;
use crate::errors::validated;
use crate::numpy_out::to_numpy;
use crate::scalars;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};

/// DeviceArray: a float32 or float16 array resident on the GPU, made by
/// to_device or kept there by attention / attention_backward.
/// flashport.DeviceArray wraps it; immutable.
#[pyclass(frozen, module = "flashport._core")]
pub(crate) struct DeviceArray {
    pub(crate) inner: core::DeviceArray,
}

#[pymethods]
impl DeviceArray {
    #[getter]
    pub(crate) fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, self.inner.shape())
    }
    /// The NumPy dtype name: "float32" or "float16".
    #[getter]
    pub(crate) fn dtype(&self) -> &'static str {
        self.inner.dtype().numpy_name()
    }
    #[getter]
    pub(crate) fn nbytes(&self) -> usize {
        self.inner.nbytes()
    }
    /// The name of the GPU adapter that holds it.
    #[getter]
    fn adapter(&self) -> String {
        self.inner.adapter_name().to_string()
    }
    /// "gpu:N": the GPU that holds it.
    #[getter]
    fn device(&self) -> String {
        self.inner.device()
    }
    /// to(device) -> DeviceArray: the array on `device` ("gpu:N"; "gpu"
    /// and "auto" the default GPU): itself where it is there, else a copy
    /// through host memory.
    fn to(&self, py: Python<'_>, device: &Bound<'_, PyAny>) -> PyResult<DeviceArray> {
        let name = scalars::device_name(device)?;
        let gpu = validated(py, core::device::parse_gpu(name.as_deref()))?;
        let inner = run_detached(py, || self.inner.to(gpu))?;
        Ok(DeviceArray { inner })
    }
    /// numpy() -> ndarray: a new NumPy array with the tensor's values.
    pub(crate) fn numpy<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let buffer = run_detached(py, || self.inner.to_host())?;
        to_numpy(py, buffer, self.inner.shape())
    }
    /// copy() -> DeviceArray: a new array with the same elements, copied
    /// on the GPU.
    pub(crate) fn copy(&self, py: Python<'_>) -> PyResult<DeviceArray> {
        let inner = run_detached(py, || self.inner.copy())?;
        Ok(DeviceArray { inner })
    }
    fn __repr__(&self) -> String {
        format!(
            "DeviceArray(shape={:?}, dtype={}, device={:?})",
            self.inner.shape(),
            self.inner.dtype().numpy_name(),
            self.inner.device()
        )
    }
}

/// synchronize(device=None) -> None: waits until the GPUs have done every
/// call queued on them (None, "gpu", "auto": every GPU in use; "gpu:N":
/// that one; "cpu": nothing to wait for, CPU calls return done);
/// GpuError if a device was lost on the way. The private entry point
/// behind flashport.synchronize.
#[pyfunction]
#[pyo3(signature = (device=None))]
pub(crate) fn synchronize(py: Python<'_>, device: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
    let name = match device {
        Some(device) => scalars::device_name(device)?,
        None => None,
    };
    // Not `Device::parse`'s default: FLASHPORT_DEVICE picks where calls
    // run, while queued work can be on any GPU in use. An index names one,
    // and is checked as every device= is.
    let index = match name {
        None => None,
        Some(name) => match validated(py, Device::parse_for(Some(&name), true))? {
            Device::Cpu => return Ok(()),
            Device::Gpu(core::gpu::Gpu::Index(n)) => Some(n),
            _ => None,
        },
    };
    run_detached(py, || core::gpu::synchronize(index))
}

/// devices() -> list[dict]: the CPU and every GPU adapter flashport can
/// use, in gpu:N order.
#[pyfunction]
pub(crate) fn devices<'py>(py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
    let list = PyList::empty(py);
    let cpu = PyDict::new(py);
    cpu.set_item("device", "cpu")?;
    cpu.set_item("backend", "cpu")?;
    cpu.set_item("name", std::env::consts::ARCH)?;
    cpu.set_item("type", "cpu")?;
    cpu.set_item("threads", validated(py, core::cpu::num_threads())?)?;
    cpu.set_item(
        "cache_bytes_per_core",
        core::cpu::tiles::per_core_cache_bytes(),
    )?;
    list.append(cpu)?;
    let adapters = py
        .detach(|| catch_unwind(core::gpu::adapters))
        .unwrap_or_default();
    for adapter in adapters {
        let entry = PyDict::new(py);
        entry.set_item("device", core::gpu::device_name(adapter.index))?;
        entry.set_item("index", adapter.index)?;
        entry.set_item("pci_bus_id", adapter.pci_bus_id)?;
        entry.set_item("backend", adapter.backend)?;
        entry.set_item("name", adapter.name)?;
        entry.set_item("type", adapter.device_type)?;
        entry.set_item("driver", adapter.driver)?;
        let limits = PyDict::new(py);
        for (name, value) in adapter.limits {
            limits.set_item(name, value)?;
        }
        entry.set_item("limits", limits)?;
        entry.set_item("features", adapter.features)?;
        list.append(entry)?;
    }
    Ok(list)
}

/// _gpu_kernel_times() -> list[tuple[str, float]]: the host phases of the
/// last GPU call on this thread and, while `_gpu_kernel_timing(True)` is
/// set, the GPU time in seconds of each of its kernels, from timestamp
/// queries (none where the adapter has none). For benchmarks.
#[pyfunction]
pub(crate) fn _gpu_kernel_times() -> Vec<(String, f64)> {
    core::gpu::last_kernel_times()
}

/// _gpu_kernel_timing(enabled): whether the calling thread's GPU calls
/// measure their kernels with timestamp queries (off by default: they cost
/// each call a readback).
#[pyfunction]
pub(crate) fn _gpu_kernel_timing(enabled: bool) {
    core::gpu::set_kernel_timing(enabled);
}
