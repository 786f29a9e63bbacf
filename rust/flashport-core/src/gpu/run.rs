//! Running a call on the right GPU context: device-array inputs pin the
//! call to their own GPU (all on one, still alive, and the one `device=`
//! names if it names one), and a call without them runs on the GPU
//! `device=` names; either way through `guard.rs`.

use std::sync::Arc;

use super::adapters::{name, Gpu};
use super::context::{self, Context};
use super::device_array::DeviceArray;
use super::guard::{guarded, run_on};
use super::inputs::Source;
use crate::error::{Error, Result};

/// Runs `f` on the context of the call's device inputs (all on one GPU,
/// which must still be alive and be `gpu` where that is an index: an
/// error names the arguments and devices otherwise), or on `gpu`'s
/// context when there are none.
pub(crate) fn with_inputs<T>(
    what: &str,
    gpu: Gpu,
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
            return run_on(&context::get(gpu)?, f);
        };
        check_one_gpu(gpu, &arrays)?;
        // One poll delivers a pending device-lost callback for all of them.
        let _ = first.context().device.poll(wgpu::PollType::Poll);
        for (name, t) in &arrays {
            t.was_alive(name)?;
        }
        let ctx = first.context().clone();
        if let Some((name, _)) = arrays.iter().find(|(_, t)| !Arc::ptr_eq(t.context(), &ctx)) {
            // One GPU, two contexts: the first was lost and opened again
            // while this array was made (`was_alive` catches the lost one
            // unless the loss is not yet seen).
            return Err(Error::Gpu(format!(
                "{name} is a device array of an earlier device of {} that was lost or \
                 reset: upload it again",
                first.device()
            )));
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

/// An error unless the device arrays of a call are all on one GPU, and on
/// `gpu` where the call names one by index: the arguments and devices
/// named, and how to move an array.
pub(crate) fn check_one_gpu(gpu: Gpu, arrays: &[(&str, &DeviceArray)]) -> Result<()> {
    let Some(&(first_name, first)) = arrays.first() else {
        return Ok(());
    };
    if let Some((other_name, other)) = arrays.iter().find(|(_, t)| t.index() != first.index()) {
        return Err(Error::Value {
            argument: other_name.to_string(),
            value: format!("a device array on {}", other.device()),
            reason: format!(
                "{first_name} is on {} and {other_name} on {}: the device arrays of one call \
                 must be on one GPU; copy one over first ({other_name}.to(\"{}\"), through \
                 the host)",
                first.device(),
                other.device(),
                first.device(),
            ),
        });
    }
    match gpu {
        Gpu::Index(n) if n != first.index() => Err(Error::Value {
            argument: "device".to_string(),
            value: format!("\"{}\"", name(n)),
            reason: format!(
                "{first_name} is a device array on {}: compute where the arrays are \
                 (device=\"{}\" or None), or copy them over first ({first_name}.to(\"{}\"))",
                first.device(),
                first.device(),
                name(n),
            ),
        }),
        _ => Ok(()),
    }
}
