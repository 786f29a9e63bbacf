//! Recording a kernel's dispatch: its uniform, its bindings, its grid, and
//! the submission that reads the outputs back.

use super::chunks::Chunk;
use super::context::Context;
use super::params::{Params, VariantData};
use super::timing::Timer;
use super::transfer::{read_back, upload, upload_as};
use crate::{Error, Problem, Result};

/// The binding of `vx` in the shaders' common fragment.
const VX_BINDING: u32 = 15;

/// Uploads `vx`, which must fit one binding of at most `limit` bytes.
pub(crate) fn upload_variants(ctx: &Context, vd: &VariantData, limit: u64) -> Result<wgpu::Buffer> {
    let bytes = 4 * vd.words.len() as u64;
    if bytes > limit {
        return Err(Error::TooLarge(format!(
            "the mask (with its block map, slopes and sinks: {bytes} bytes) is larger than \
             this adapter's largest GPU binding ({limit} bytes); use device=\"cpu\" or a mask \
             that broadcasts"
        )));
    }
    upload(ctx, "variants", bytemuck::cast_slice(vd.upload_words()))
}

/// The uniform block of one chunk of `p`, uploaded.
pub(crate) fn uniform(
    ctx: &Context,
    p: &Problem,
    chunk: &Chunk,
    vd: &VariantData,
) -> Result<wgpu::Buffer> {
    let params = Params::new(p, chunk, vd);
    upload_as(
        ctx,
        "params",
        bytemuck::bytes_of(&params),
        wgpu::BufferUsages::UNIFORM,
    )
}

/// Binds `buffers` to bindings 0, 1, ... and `vx` to its own binding.
pub(crate) fn bind(
    ctx: &Context,
    pipeline: &wgpu::ComputePipeline,
    buffers: &[&wgpu::Buffer],
    vx: Option<&wgpu::Buffer>,
) -> wgpu::BindGroup {
    let entries: Vec<wgpu::BindGroupEntry<'_>> = buffers
        .iter()
        .enumerate()
        .map(|(i, b)| (i as u32, *b))
        .chain(vx.map(|b| (VX_BINDING, b)))
        .map(|(binding, b)| wgpu::BindGroupEntry {
            binding,
            resource: b.as_entire_binding(),
        })
        .collect();
    ctx.device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: None,
        layout: &pipeline.get_bind_group_layout(0),
        entries: &entries,
    })
}

/// Records one pass of `pipeline` over an `x` × `y` grid, timed where the
/// call has a timer.
pub(crate) fn dispatch(
    encoder: &mut wgpu::CommandEncoder,
    pipeline: &wgpu::ComputePipeline,
    group: &wgpu::BindGroup,
    x: u32,
    y: u32,
    timer: Option<(&mut Timer, &'static str)>,
) {
    if x == 0 || y == 0 {
        return;
    }
    let timestamp_writes = timer.and_then(|(t, name)| t.next(name));
    let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
        label: None,
        timestamp_writes,
    });
    pass.set_pipeline(pipeline);
    pass.set_bind_group(0, group, &[]);
    pass.dispatch_workgroups(x, y, 1);
}

/// Copies `outputs` into one mappable buffer, submits, waits and returns
/// each output's floats.
pub(crate) fn submit_and_read(
    ctx: &Context,
    mut encoder: wgpu::CommandEncoder,
    outputs: &[(&wgpu::Buffer, usize)],
    timer: Option<&Timer>,
) -> Result<Vec<Vec<f32>>> {
    let mut outputs = outputs.to_vec();
    if let Some(t) = timer {
        let words = t.resolve(&mut encoder);
        outputs.push((&t.resolve, words));
    }
    let mut results = read_back(ctx, encoder, &outputs)?;
    if let Some(t) = timer {
        let words = results.pop().unwrap_or_default();
        t.record(ctx, &words);
    }
    Ok(results)
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
