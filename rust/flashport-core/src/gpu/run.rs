//! Running work on a GPU context: a panic inside wgpu becomes an error,
//! and a device that failed is dropped so that the next call opens a new
//! one; device-array inputs pin the call to their own context.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use super::context::{self, Context};
use super::inputs::Source;
use crate::{DeviceArray, Error, Result};

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

/// Runs `f` on the shared context; a device that failed is dropped so that
/// the next call creates a new one.
pub(crate) fn with_context<T>(what: &str, f: impl FnOnce(&Arc<Context>) -> Result<T>) -> Result<T> {
    guarded(what, || run_on(&context::get()?, f))
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
                    "the GPU device {} was lost ({message}); the next GPU call opens it again",
                    ctx.adapter.name
                )
            } else {
                format!("{message}; the next GPU call starts on a fresh device")
            }))
        }
        result => result,
    }
}

/// Runs `f` on the context of the call's device inputs (all of one
/// context, which must still be alive: an error names the argument
/// otherwise), or on the shared context when there are none.
pub(crate) fn with_inputs<T>(
    what: &str,
    inputs: &[(&str, Source<'_>)],
    f: impl FnOnce(&Arc<Context>) -> Result<T>,
) -> Result<T> {
    guarded(what, || {
        let arrays: Vec<(&str, &DeviceArray)> = inputs
            .iter()
            .filter_map(|(name, s)| match s {
                Source::Device(t) => Some((*name, *t)),
                Source::Host(_) => None,
            })
            .collect();
        let Some(&(_, first)) = arrays.first() else {
            return run_on(&context::get()?, f);
        };
        // One poll delivers a pending device-lost callback for all of them.
        let _ = first.context().device.poll(wgpu::PollType::Poll);
        for (name, t) in &arrays {
            t.was_alive(name)?;
        }
        let ctx = first.context().clone();
        if let Some((name, _)) = arrays.iter().find(|(_, t)| !Arc::ptr_eq(t.context(), &ctx)) {
            return Err(Error::Value {
                argument: name.to_string(),
                value: "a device array of another GPU context".to_string(),
                reason: format!(
                    "the device arrays of one call must come from the same GPU context \
                     (this one is on {})",
                    ctx.adapter.name
                ),
            });
        }
        run_on(&ctx, |ctx| match f(ctx) {
            Err(Error::Gpu(message)) => {
                let _ = ctx.device.poll(wgpu::PollType::Poll);
                if !ctx.is_lost() {
                    return Err(Error::Gpu(message));
                }
                // Lost during the call: the arrays went with the device.
                let names: Vec<&str> = arrays.iter().map(|(name, _)| *name).collect();
                Err(Error::Gpu(format!(
                    "{message}; the device arrays {} were lost with it: upload them again",
                    names.join(", ")
                )))
            }
            result => result,
        })
    })
}
