//! Core errors as flashport's Python exceptions (classes defined in
//! `flashport._errors`).

use flashport_core as core;

use pyo3::exceptions::PyKeyboardInterrupt;
use pyo3::prelude::*;

/// Raises the flashport exception class (defined in `flashport._errors`)
/// that corresponds to a core error.
pub(crate) fn to_py_err(py: Python<'_>, err: core::Error) -> PyErr {
    let class = match &err {
        core::Error::Shape(_) => "ShapeError",
        core::Error::DType { .. } => "DTypeError",
        core::Error::Value { .. } => "InvalidArgumentError",
        core::Error::BackendUnavailable(_) => "BackendUnavailableError",
        core::Error::TooLarge(_) => "ProblemTooLargeError",
        core::Error::CacheFull(_) => "CacheFullError",
        core::Error::UnknownSequence { .. } => "UnknownSequenceError",
        core::Error::Gpu(_) => "GpuError",
        // Only when the call's check did not keep what Python raised.
        core::Error::Interrupted => return PyKeyboardInterrupt::new_err(err.to_string()),
    };
    raise(py, class, err.to_string())
}

pub(crate) fn raise(py: Python<'_>, class: &str, message: String) -> PyErr {
    let class = py
        .import("flashport._errors")
        .and_then(|module| module.getattr(class));
    match class {
        Ok(class) => match class.call1((message,)) {
            Ok(instance) => PyErr::from_value(instance),
            Err(e) => e,
        },
        Err(e) => e,
    }
}

pub(crate) fn validated<T>(py: Python<'_>, result: core::Result<T>) -> PyResult<T> {
    result.map_err(|e| to_py_err(py, e))
}
