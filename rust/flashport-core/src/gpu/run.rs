//! Running a call on the right GPU context: device-array inputs pin the
//! call to their own context (all of one, still alive), and a call without
//! them runs on the shared one; either way through `guard.rs`.

use std::sync::Arc;

use super::context::{self, Context};
use super::device_array::DeviceArray;
use super::guard::{guarded, run_on};
use super::inputs::Source;
use crate::error::{Error, Result};

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
