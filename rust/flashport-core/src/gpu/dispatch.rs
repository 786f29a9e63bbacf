//! What a pass binds and how large its grid is: the uniform, the variants'
//! data, the bind group, the workgroup count.

use super::arena::Param;
use super::context::Context;
use super::params::VariantData;
use super::transfer::Submission;
use crate::error::{Error, Result};

/// The binding of `vx` in the shaders' common fragment.
const VX_BINDING: u32 = 15;

/// The variants' data `vx` of a call, which must fit one binding of at
/// most `limit` bytes.
pub(crate) fn upload_variants(
    sub: &mut Submission<'_>,
    vd: &VariantData,
    limit: u64,
) -> Result<Param> {
    let bytes = 4 * vd.words.len() as u64;
    if bytes > limit {
        return Err(Error::TooLarge(format!(
            "the variants' data (a mask with its block map, slopes, sinks, a packed batch's \
             row table: {bytes} bytes) is larger than this adapter's largest GPU binding \
             ({limit} bytes); use device=\"cpu\" or a mask that broadcasts"
        )));
    }
    sub.data(vd.upload_words())
}

/// Binds `buffers` to bindings 0, 1, ... and `vx` to its own binding.
pub(crate) fn bind(
    ctx: &Context,
    pipeline: &wgpu::ComputePipeline,
    buffers: &[wgpu::BindingResource<'_>],
    vx: Option<&Param>,
) -> wgpu::BindGroup {
    let entries: Vec<wgpu::BindGroupEntry<'_>> = buffers
        .iter()
        .cloned()
        .enumerate()
        .map(|(i, resource)| (i as u32, resource))
        .chain(vx.map(|b| (VX_BINDING, b.binding())))
        .map(|(binding, resource)| wgpu::BindGroupEntry { binding, resource })
        .collect();
    ctx.device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: None,
        layout: &pipeline.get_bind_group_layout(0),
        entries: &entries,
    })
}

/// Workgroups along x for `count` rows in tiles of `tile`, within the
/// adapter's limit.
pub(crate) fn grid(count: usize, tile: u32, ctx: &Context, what: &str) -> Result<u32> {
    let n = count.div_ceil(tile.max(1) as usize);
    let max = ctx.limits.max_compute_workgroups_per_dimension as usize;
    if n > max {
        return Err(Error::TooLarge(format!(
            "{what} of {count} rows needs {n} workgroups, more than this adapter's \
             {max} per dimension; use device=\"cpu\""
        )));
    }
    Ok(n as u32)
}
