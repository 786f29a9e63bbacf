//! Running the core outside the GIL: interruptible by Ctrl-C through
//! the signal checks, and a panic (a bug) turned into
//! `flashport.InternalError` rather than crossing into Python.

use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::rc::Rc;

use flashport_core as core;

use crate::errors::{raise, to_py_err};
use pyo3::prelude::*;

/// Runs the core outside the GIL, interruptible (`signals`). A panic (a
/// bug) becomes `flashport.InternalError` instead of crossing into Python.
pub(crate) fn run_detached<R: Send>(
    py: Python<'_>,
    f: impl FnOnce() -> core::Result<R> + Send,
) -> PyResult<R> {
    let (result, raised) = py.detach(|| {
        let signals = Rc::new(Signals::default());
        let check = signals.clone();
        let result = core::interrupt::with_check(
            move || check.interrupted(),
            || catch_unwind(AssertUnwindSafe(f)),
        );
        (result, signals.raised.take())
    });
    // What a signal handler raised (KeyboardInterrupt for Ctrl-C) is the
    // call's outcome: the handler has run, and would be lost otherwise.
    if let Some(err) = raised {
        return Err(err);
    }
    match result {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(err)) => Err(to_py_err(py, err)),
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".to_string());
            Err(raise(
                py,
                "InternalError",
                format!("flashport hit an internal error (please report it): {what}"),
            ))
        }
    }
}

/// The core's interrupt check for a call made from Python: runs Python's
/// signal handlers, which only the main thread runs, and keeps what one
/// raised. The core asks only after a call's first 50 ms (and then every
/// 50 ms), so a short call never takes the GIL back for it.
#[derive(Default)]
struct Signals {
    /// Whether this call runs on Python's main thread (asked once).
    main_thread: Cell<Option<bool>>,
    pub(crate) raised: Cell<Option<PyErr>>,
}

impl Signals {
    fn interrupted(&self) -> bool {
        if self.main_thread.get() == Some(false) {
            return false;
        }
        Python::attach(|py| {
            if self.main_thread.get().is_none() {
                // On another thread a check would only wait for the GIL.
                let main = is_main_thread(py).unwrap_or(true);
                self.main_thread.set(Some(main));
                if !main {
                    return false;
                }
            }
            match py.check_signals() {
                Ok(()) => false,
                Err(err) => {
                    self.raised.set(Some(err));
                    true
                }
            }
        })
    }
}

fn is_main_thread(py: Python<'_>) -> PyResult<bool> {
    let threading = py.import("threading")?;
    let main = threading.call_method0("main_thread")?;
    Ok(main.is(&threading.call_method0("current_thread")?))
}
