//! The screen in front of the fast attention kernels (shaders/screen.wgsl).
//!
//! The tiled and cooperative kernels let IEEE arithmetic run over whole
//! tiles, so a NaN or an infinity in a hidden key, or an overflow, reaches
//! rows it must not (`0 * NaN`); following docs/design.md#non-finite-inputs
//! inside them cost 40% of the float16 forward on the H100. Only the simple
//! kernels follow those rules. So a call whose selected kernels are tiled
//! or cooperative records them and, after them, the simple ones built to
//! run behind a pass that reads `q`, `k` and `v` once and raises a flag for
//! any NaN, infinity or float32 value of 2^48 or more (the backward
//! pre-pass raises it for `do`, `o` and `lse`): where it is raised the
//! simple kernels compute every output again, elsewhere each of their
//! workgroups returns at once (shaders/lib/screened.wgsl). The host never
//! waits for the screen, and a call with finite data pays one read of its
//! inputs and two or three empty passes. What the host holds (a float mask,
//! ALiBi slopes, sinks, the scale) it screens itself
//! (`VariantData::screened`) and raises the flag before the work.

use super::context::Context;
use super::pool::Pooled;
use super::transfer::Submission;
use crate::Result;

/// Workgroups of the screen: enough to stream the inputs at the device's
/// bandwidth, each invocation reading at least 8 words of each.
const SCREEN_WORKGROUP: u64 = 256;
const SCREEN_MAX_WORKGROUPS: u64 = 8192;

/// Sets the flag, the last word of `buffer`, to whether the host already
/// screened the call out (1) or not (0), before `sub`'s work.
pub(crate) fn reset_flag(ctx: &Context, sub: &mut Submission<'_>, buffer: &Pooled, raised: bool) {
    let at = buffer.bytes() - 4;
    if raised {
        // Written before the submission's commands run.
        ctx.queue
            .write_buffer(buffer.buffer(), at, &1u32.to_le_bytes());
    } else {
        sub.encoder.clear_buffer(buffer.buffer(), at, Some(4));
    }
}

/// Records the screen of `inputs` (q, k, v as the kernels bind them,
/// float16 pairs where `f16`): raises the last word of `flag`.
pub(crate) fn screen(
    ctx: &Context,
    sub: &mut Submission<'_>,
    f16: bool,
    inputs: [&Pooled; 3],
    flag: &Pooled,
) -> Result<()> {
    let pipeline = ctx.specialised_pipeline(
        "screen",
        || super::shaders::SCREEN.to_string(),
        &[("F16", if f16 { 1.0 } else { 0.0 })],
    )?;
    let entries: Vec<wgpu::BindGroupEntry<'_>> = inputs
        .into_iter()
        .chain([flag])
        .enumerate()
        .map(|(i, b)| wgpu::BindGroupEntry {
            binding: i as u32,
            resource: b.binding(),
        })
        .collect();
    let group = ctx.device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: Some("screen"),
        layout: &pipeline.get_bind_group_layout(0),
        entries: &entries,
    });
    let words = inputs.iter().map(|b| b.bytes() / 4).max().unwrap_or(0);
    let groups = words
        .div_ceil(8 * SCREEN_WORKGROUP)
        .clamp(1, SCREEN_MAX_WORKGROUPS) as u32;
    sub.dispatch(&pipeline, &group, (groups, 1), "screen");
    Ok(())
}
