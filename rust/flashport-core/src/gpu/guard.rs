//! Running work on a GPU context, guarded: a panic inside wgpu becomes an
//! error, and a device that failed is dropped so that the next call opens
//! a new one. Below the device arrays and `run.rs` (a call's context),
//! which both run their work through it.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use super::adapters::{name, Gpu};
use super::context::{self, Context};
use crate::error::{Error, Result};

/// Runs `f`, turning a panic into an error.
pub(crate) fn guarded<T>(what: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    // wgpu reports misuse by panicking in a few places; no panic may cross
    // into Python, so one becomes an error.
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(result) => result,
        Err(payload) => {
            let msg = payload
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| payload.downcast_ref::<&str>().copied())
                .unwrap_or("unknown panic");
            Err(Error::Gpu(format!(
                "the GPU backend failed while {what}: {msg}"
            )))
        }
    }
}

/// Runs `f` on the context of `gpu`; a device that failed is dropped so
/// that the next call on that GPU creates a new one.
pub(crate) fn with_context<T>(
    gpu: Gpu,
    what: &str,
    f: impl FnOnce(&Arc<Context>) -> Result<T>,
) -> Result<T> {
    guarded(what, || run_on(&context::get(gpu)?, f))
}

/// Runs `f` on `ctx`, dropping the context if the GPU fails.
pub(crate) fn run_on<T>(
    ctx: &Arc<Context>,
    f: impl FnOnce(&Arc<Context>) -> Result<T>,
) -> Result<T> {
    crate::env::check_gpu_switches()?;
    match f(ctx) {
        Err(Error::Gpu(message)) => {
            // Whatever failed first (often a buffer the dead device
            // refuses), the user needs to know the device is gone and
            // that the next call will open a new one.
            // A poll delivers a pending device-lost callback.
            let _ = ctx.device.poll(wgpu::PollType::Poll);
            let lost = ctx.is_lost();
            context::discard(ctx);
            Err(Error::Gpu(if lost {
                format!(
                    "the GPU device {} ({}) was lost ({message}); the next call on it opens \
                     it again",
                    name(ctx.index),
                    ctx.adapter.name
                )
            } else {
                format!("{message}; the next GPU call starts on a fresh device")
            }))
        }
        result => result,
    }
}
