//! Scalar keywords handed to the core as the caller wrote them: each
//! Python object classified (`flashport_core::scalar::Kind`) and checked
//! there, never coerced here with `float()`, `bool()` or `int()`.

use flashport_core as core;
use flashport_core::scalar::{Given, IndicesGiven, Kind, WindowGiven};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBool, PyFloat, PyInt, PyList, PyString, PyTuple, PyType};

use crate::errors::to_py_err;

/// Longest `repr` quoted in a message (a large set or array would fill
/// the screen).
const REPR_CHARS: usize = 80;

/// `obj` as the caller wrote it: its kind and its `repr` (for messages).
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

/// `obj`'s kind alone: a check that passes quotes nothing, and Python's
/// `repr` of every argument of every call cost microseconds a call.
fn unquoted(obj: &Bound<'_, PyAny>) -> Given {
    Given::new(kind(obj), String::new())
}

/// NumPy's scalar classes, looked up once (importing numpy and reading its
/// attributes on every argument of every call showed in the profile of a
/// decode step).
fn numpy_class<'py>(py: Python<'py>, which: usize) -> Option<&'py Bound<'py, PyType>> {
    static CLASSES: PyOnceLock<Option<[Py<PyType>; 3]>> = PyOnceLock::new();
    let classes = CLASSES.get_or_init(py, || {
        let np = py.import("numpy").ok()?;
        let class = |name: &str| {
            np.getattr(name)
                .ok()?
                .cast_into::<PyType>()
                .ok()
                .map(Bound::unbind)
        };
        Some([class("bool_")?, class("integer")?, class("floating")?])
    });
    classes.as_ref().map(|c| c[which].bind(py))
}

/// `obj`'s kind: Python's and NumPy's bools, integers and floats count as
/// such; anything else (a 0-d array, a tensor, a `Decimal`) is "other".
/// Python's own types are tested first, NumPy's after (a Python bool is an
/// int, NumPy's float64 a float; no NumPy scalar is a Python int).
fn kind(obj: &Bound<'_, PyAny>) -> Kind {
    let numpy = |which: usize| {
        numpy_class(obj.py(), which).is_some_and(|class| obj.is_instance(class).unwrap_or(false))
    };
    let int = || match obj.extract::<i64>() {
        Ok(i) => Kind::Int(Some(i128::from(i))),
        Err(_) => Kind::Int(obj.extract::<i128>().ok()),
    };
    let float = || match obj.extract::<f64>() {
        Ok(x) => Kind::Float(x),
        Err(_) => Kind::Other(type_name(obj)),
    };
    if obj.is_none() {
        Kind::None
    } else if let Ok(b) = obj.cast::<PyBool>() {
        Kind::Bool(b.is_true())
    } else if obj.is_instance_of::<PyInt>() {
        int()
    } else if obj.is_instance_of::<PyFloat>() {
        float()
    } else if let Ok(s) = obj.cast::<PyString>() {
        Kind::Str(s.to_string())
    } else if numpy(0) {
        Kind::Bool(obj.is_truthy().unwrap_or(false))
    } else if numpy(1) {
        int()
    } else if numpy(2) {
        float()
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
fn window_given(obj: &Bound<'_, PyAny>, given: fn(&Bound<'_, PyAny>) -> Given) -> WindowGiven {
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

/// `seq_ids=`: the items of an iterable, read once (an iterator the caller
/// passed is spent by the first read, and a failed check reads them again
/// for its message); `None` when it is an int, a string or not iterable
/// (the core names it).
fn items<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Option<Vec<Bound<'py, PyAny>>>> {
    // A list or a tuple, what every decode step passes, is read as one:
    // classifying it first went through its type's name (`kind` of a
    // container is "other") and a Python iterator with its length hint,
    // a tenth of a queued KVCache.attention's host time on the VM.
    if let Ok(list) = obj.cast::<PyList>() {
        return Ok(Some(list.iter().collect()));
    }
    if let Ok(tuple) = obj.cast::<PyTuple>() {
        return Ok(Some(tuple.iter().collect()));
    }
    if matches!(kind(obj), Kind::Int(_) | Kind::Bool(_) | Kind::Str(_)) {
        return Ok(None);
    }
    match obj.try_iter() {
        Ok(items) => items.collect::<PyResult<_>>().map(Some),
        Err(_) => Ok(None),
    }
}

fn checked<T>(py: Python<'_>, result: core::Result<T>) -> PyResult<T> {
    result.map_err(|e| to_py_err(py, e))
}

/// `check` of `obj`, classified without its `repr`; where it fails, again
/// with it, for the message (the checks are pure: the same kind fails the
/// same way).
fn check<T>(obj: &Bound<'_, PyAny>, check: impl Fn(&Given) -> core::Result<T>) -> PyResult<T> {
    check(&unquoted(obj)).or_else(|_| checked(obj.py(), check(&given(obj))))
}

pub fn flag(name: &str, obj: &Bound<'_, PyAny>) -> PyResult<bool> {
    check(obj, |g| core::scalar::flag(name, g))
}

pub fn real(name: &str, obj: &Bound<'_, PyAny>) -> PyResult<f64> {
    check(obj, |g| core::scalar::real(name, g))
}

pub fn optional_real(name: &str, obj: &Bound<'_, PyAny>) -> PyResult<Option<f64>> {
    check(obj, |g| core::scalar::optional_real(name, g))
}

pub fn integer(name: &str, obj: &Bound<'_, PyAny>) -> PyResult<Option<i128>> {
    check(obj, |g| core::scalar::integer(name, g))
}

pub fn device_name(obj: &Bound<'_, PyAny>) -> PyResult<Option<String>> {
    check(obj, |g| core::scalar::name("device", g))
}

pub fn window(obj: &Bound<'_, PyAny>) -> PyResult<Option<(i64, i64)>> {
    core::scalar::window(&window_given(obj, unquoted))
        .or_else(|_| checked(obj.py(), core::scalar::window(&window_given(obj, given))))
}

pub fn index(name: &str, obj: &Bound<'_, PyAny>) -> PyResult<i64> {
    check(obj, |g| core::scalar::index(name, g))
}

pub fn seq_id(name: &str, obj: &Bound<'_, PyAny>) -> PyResult<i64> {
    check(obj, |g| core::scalar::seq_id(name, g))
}

pub fn indices(name: &str, obj: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
    let items = items(obj)?;
    let read = |given: fn(&Bound<'_, PyAny>) -> Given| match &items {
        Some(items) => IndicesGiven::Items(items.iter().map(given).collect()),
        None => IndicesGiven::Other(given(obj)),
    };
    core::scalar::indices(name, &read(unquoted))
        .or_else(|_| checked(obj.py(), core::scalar::indices(name, &read(given))))
}
