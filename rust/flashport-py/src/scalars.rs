//! Scalar keywords handed to the core as the caller wrote them: each
//! Python object classified (`flashport_core::scalar::Kind`) and checked
//! there, never coerced here with `float()`, `bool()` or `int()`.

use flashport_core as core;
use flashport_core::scalar::{Given, IndicesGiven, Kind, WindowGiven};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyFloat, PyInt, PyList, PyString, PyTuple};

use crate::to_py_err;

/// Longest `repr` quoted in a message (a large set or array would fill
/// the screen).
const REPR_CHARS: usize = 80;

/// `obj`'s kind: Python's and NumPy's bools, integers and floats count as
/// such; anything else (a 0-d array, a tensor, a `Decimal`) is "other".
pub fn given(obj: &Bound<'_, PyAny>) -> Given {
    let repr = obj
        .repr()
        .map(|r| r.to_string())
        .unwrap_or_else(|_| "?".to_string());
    let repr = match repr.char_indices().nth(REPR_CHARS) {
        Some((cut, _)) => format!("{}...", &repr[..cut]),
        None => repr,
    };
    Given::new(kind(obj), repr)
}

fn kind(obj: &Bound<'_, PyAny>) -> Kind {
    let numpy = |name: &str| {
        obj.py()
            .import("numpy")
            .and_then(|np| np.getattr(name))
            .and_then(|class| obj.is_instance(&class))
            .unwrap_or(false)
    };
    if obj.is_none() {
        Kind::None
    } else if let Ok(b) = obj.cast::<PyBool>() {
        Kind::Bool(b.is_true())
    } else if numpy("bool_") {
        Kind::Bool(obj.is_truthy().unwrap_or(false))
    } else if obj.is_instance_of::<PyInt>() || numpy("integer") {
        Kind::Int(obj.extract::<i128>().ok())
    } else if obj.is_instance_of::<PyFloat>() || numpy("floating") {
        match obj.extract::<f64>() {
            Ok(x) => Kind::Float(x),
            Err(_) => Kind::Other(type_name(obj)),
        }
    } else if let Ok(s) = obj.cast::<PyString>() {
        Kind::Str(s.to_string())
    } else {
        Kind::Other(type_name(obj))
    }
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".to_string())
}

/// `window=`: `None`, a tuple or list of two, or anything else.
fn window_given(obj: &Bound<'_, PyAny>) -> WindowGiven {
    let pair = |items: Vec<Bound<'_, PyAny>>| match items.as_slice() {
        [left, right] => WindowGiven::Pair(given(left), given(right)),
        _ => WindowGiven::Other(given(obj)),
    };
    if obj.is_none() {
        WindowGiven::None
    } else if let Ok(t) = obj.cast::<PyTuple>() {
        pair(t.iter().collect())
    } else if let Ok(l) = obj.cast::<PyList>() {
        pair(l.iter().collect())
    } else {
        WindowGiven::Other(given(obj))
    }
}

/// `seq_ids=`: the items of an iterable, or the object itself when it is
/// an int, a string or not iterable (the core names it).
fn indices_given(obj: &Bound<'_, PyAny>) -> PyResult<IndicesGiven> {
    if matches!(kind(obj), Kind::Int(_) | Kind::Bool(_) | Kind::Str(_)) {
        return Ok(IndicesGiven::Other(given(obj)));
    }
    match obj.try_iter() {
        Ok(items) => Ok(IndicesGiven::Items(
            items
                .map(|item| item.map(|i| given(&i)))
                .collect::<PyResult<_>>()?,
        )),
        Err(_) => Ok(IndicesGiven::Other(given(obj))),
    }
}

fn checked<T>(py: Python<'_>, result: core::Result<T>) -> PyResult<T> {
    result.map_err(|e| to_py_err(py, e))
}

pub fn flag(name: &str, obj: &Bound<'_, PyAny>) -> PyResult<bool> {
    checked(obj.py(), core::scalar::flag(name, &given(obj)))
}

pub fn real(name: &str, obj: &Bound<'_, PyAny>) -> PyResult<f64> {
    checked(obj.py(), core::scalar::real(name, &given(obj)))
}

pub fn optional_real(name: &str, obj: &Bound<'_, PyAny>) -> PyResult<Option<f64>> {
    checked(obj.py(), core::scalar::optional_real(name, &given(obj)))
}

pub fn integer(name: &str, obj: &Bound<'_, PyAny>) -> PyResult<Option<i128>> {
    checked(obj.py(), core::scalar::integer(name, &given(obj)))
}

pub fn device_name(obj: &Bound<'_, PyAny>) -> PyResult<Option<String>> {
    checked(obj.py(), core::scalar::name("device", &given(obj)))
}

pub fn window(obj: &Bound<'_, PyAny>) -> PyResult<Option<(i64, i64)>> {
    checked(obj.py(), core::scalar::window(&window_given(obj)))
}

pub fn index(name: &str, obj: &Bound<'_, PyAny>) -> PyResult<i64> {
    checked(obj.py(), core::scalar::index(name, &given(obj)))
}

pub fn seq_id(name: &str, obj: &Bound<'_, PyAny>) -> PyResult<i64> {
    checked(obj.py(), core::scalar::seq_id(name, &given(obj)))
}

pub fn indices(name: &str, obj: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
    checked(obj.py(), core::scalar::indices(name, &indices_given(obj)?))
}
