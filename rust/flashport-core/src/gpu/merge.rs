//! Merging attention states on the GPU (see [`crate::merge`] for the
//! arithmetic): shaders/merge_states.wgsl, per chunk of rows three passes
//! over the parts in order (the largest lse, the sum of exponentials, the
//! weighted outputs) and one for the merged lse. Each dispatch binds one
//! part's rows as buffers of their own (uploaded, or taken from a device
//! array on the device), so the parts need not be one array, and any
//! number of them fits WebGPU's bindings.

use std::sync::Arc;

use super::adapters::Gpu;
use super::assemble::{check_device_outputs, empty_output, Sink};
use super::bfloat16::{narrow, Widened};
use super::chunks::binding_limit;
use super::context::Context;
use super::inputs::{source, Source};
use super::pool::Pooled;
use super::run::with_inputs;
use super::shaders::MERGE_STATES;
use super::transfer::Submission;
use super::{device_array, timing};
use crate::array::{Array, Input, Placement};
use crate::error::{Error, Result};
use crate::output::ForwardOutput;
use crate::overrides;
use crate::problem::{DType, MergeProblem, PartInputs};

/// Invocations per workgroup of every merge pass (`WG` of lib/merge.wgsl).
const WORKGROUP: u64 = 64;

/// The shader's `struct Merge`.
#[repr(C)]
#[derive(Debug, Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Uniform {
    rows: u32,
    dv: u32,
    part: u32,
    f16: u32,
}

/// The shader's `struct RowState`: four 4-byte members.
const ROW_STATE_BYTES: u64 = 16;

/// One argument's parts as the GPU takes them.
struct Sources<'a> {
    /// Per given array: host bytes or a device array.
    arrays: Vec<Source<'a>>,
    parts: PartInputs<'a, Input<'a>>,
}

impl<'a> Sources<'a> {
    fn new(argument: &str, parts: PartInputs<'a, Input<'a>>) -> Result<Self> {
        let count = parts.arrays().len();
        let arrays = parts
            .arrays()
            .iter()
            .enumerate()
            .map(|(i, &input)| match count {
                1 => source(argument, input),
                _ => source(&format!("{argument}[{i}]"), input),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Sources { arrays, parts })
    }

    /// Elements `first..first + n` of part `p` (of `eb` bytes each) as a
    /// buffer of their own, from element 0.
    fn range(
        &self,
        sub: &mut Submission<'_>,
        p: usize,
        first: usize,
        n: usize,
        eb: usize,
    ) -> Result<Arc<Pooled>> {
        let (_, index) = self.parts.part(p);
        let array = if self.arrays.len() == 1 { 0 } else { p };
        let start = index * self.parts.part_len() + first;
        match self.arrays[array] {
            Source::Host(bytes) => sub.upload("merge part", &bytes[start * eb..(start + n) * eb]),
            Source::Device(t) => device_array::heads(sub.ctx(), sub, t, 1, start, n),
        }
    }

    fn named<'s>(&'s self, argument: &'s str, names: &mut Vec<(String, Source<'a>)>) {
        let count = self.arrays.len();
        for (i, s) in self.arrays.iter().enumerate() {
            let name = match count {
                1 => argument.to_string(),
                _ => format!("{argument}[{i}]"),
            };
            names.push((name, *s));
        }
    }
}

/// Merges the states of `outs` and `lses` on `gpu` (or where the device
/// inputs are), leaving the results
/// where `outputs` says.
pub fn merge_states(
    gpu: Gpu,
    problem: &MergeProblem,
    outs: PartInputs<'_, Input<'_>>,
    lses: PartInputs<'_, Input<'_>>,
    outputs: Placement,
) -> Result<ForwardOutput<Array>> {
    if problem.dtype == DType::BF16 {
        let named: Vec<(&str, Input<'_>)> = outs.arrays().iter().map(|&a| ("outs", a)).collect();
        let wide = Widened::new(&named, outputs)?;
        let wide_outs = wide.list(outs.arrays());
        let wide_problem = MergeProblem {
            dtype: DType::F32,
            ..problem.clone()
        };
        let outs = PartInputs::new(&wide_outs, outs.part_len());
        let r = merge_states(gpu, &wide_problem, outs, lses, outputs)?;
        return Ok(ForwardOutput {
            out: narrow(r.out)?,
            lse: r.lse,
        });
    }
    let out_sources = Sources::new("outs", outs)?;
    let lse_sources = Sources::new("lses", lses)?;
    let mut names = Vec::new();
    out_sources.named("outs", &mut names);
    lse_sources.named("lses", &mut names);
    let named: Vec<(&str, Source<'_>)> = names.iter().map(|(n, s)| (n.as_str(), *s)).collect();
    with_inputs("merging attention states", gpu, &named, |ctx| {
        merge_on(ctx, problem, &out_sources, &lse_sources, outputs)
    })
}

fn merge_on(
    ctx: &Arc<Context>,
    p: &MergeProblem,
    outs: &Sources<'_>,
    lses: &Sources<'_>,
    outputs: Placement,
) -> Result<ForwardOutput<Array>> {
    let (rows, dv, parts) = (p.rows, p.value_dim, p.parts);
    timing::start_call();
    if rows == 0 {
        return ctx.scoped("making the outputs", || {
            let mut sub = Submission::new(ctx);
            let out = empty_output(ctx, &mut sub, outputs, p.dtype, p.out_shape.clone(), 0.0)?;
            let lse = empty_output(
                ctx,
                &mut sub,
                outputs,
                DType::F32,
                p.lse_shape(),
                f32::NEG_INFINITY,
            )?;
            sub.submit(&[])?;
            Ok(ForwardOutput { out, lse })
        });
    }
    check_device_outputs(ctx, outputs, &[("out", p.out_len()), ("lse", rows)])?;
    // Rows per chunk: every binding (a part's lse rows and output rows, the
    // float32 merged rows, 16 bytes of state per row) within the limit.
    let limit = binding_limit(ctx, &overrides::current());
    let widest = (4 * dv as u64).max(ROW_STATE_BYTES);
    let chunk_rows = (limit / widest).min(rows as u64) as usize;
    if chunk_rows == 0 {
        return Err(Error::TooLarge(format!(
            "merging rows of d_v={dv} needs a GPU binding of {widest} bytes per row, more \
             than this adapter allows ({limit} bytes); use device=\"cpu\""
        )));
    }
    let pipeline = |entry| ctx.array_pipeline(entry, MERGE_STATES);
    let [max, sum, accumulate, finish] = [
        pipeline("merge_max")?,
        pipeline("merge_sum")?,
        pipeline("merge_accumulate")?,
        pipeline("merge_finish")?,
    ];
    let eb = if p.dtype == DType::F16 { 2 } else { 4 };
    let mut out = Sink::new(outputs, p.out_len(), 0.0);
    let mut lse = Sink::new(outputs, rows, f32::NEG_INFINITY);
    let last_first = (rows - 1) / chunk_rows * chunk_rows;
    for first in (0..rows).step_by(chunk_rows) {
        let n = chunk_rows.min(rows - first);
        let reads = ctx.scoped("merging attention states", || {
            let mut sub = Submission::new(ctx);
            let part_lses = (0..parts)
                .map(|part| lses.range(&mut sub, part, first, n, 4))
                .collect::<Result<Vec<_>>>()?;
            let state = sub.scratch(ROW_STATE_BYTES * n as u64);
            let lse_buffer = sub.output(n);
            let out_buffer = sub.output(n * dv);
            let uniforms = (0..parts)
                .map(|part| {
                    sub.uniform(&Uniform {
                        rows: n as u32,
                        dv: dv as u32,
                        part: part as u32,
                        f16: u32::from(p.dtype == DType::F16),
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            // Each pass over every part in order before the next starts.
            for pass in [&max, &sum] {
                for (u, part_lse) in uniforms.iter().zip(&part_lses) {
                    let group = bind(
                        ctx,
                        pass,
                        &[
                            (0, u.binding()),
                            (1, part_lse.binding()),
                            (2, state.binding()),
                        ],
                    );
                    run(ctx, &mut sub, (pass, "merge_states"), &group, n)?;
                }
            }
            if dv > 0 {
                for (part, (u, part_lse)) in uniforms.iter().zip(&part_lses).enumerate() {
                    let src = outs.range(&mut sub, part, first * dv, n * dv, eb)?;
                    let group = bind(
                        ctx,
                        &accumulate,
                        &[
                            (0, u.binding()),
                            (1, part_lse.binding()),
                            (2, state.binding()),
                            (4, src.binding()),
                            (5, out_buffer.binding()),
                        ],
                    );
                    run(ctx, &mut sub, (&accumulate, "merge_states"), &group, n * dv)?;
                }
            }
            let group = bind(
                ctx,
                &finish,
                &[
                    (0, uniforms[0].binding()),
                    (2, state.binding()),
                    (3, lse_buffer.binding()),
                ],
            );
            run(ctx, &mut sub, (&finish, "merge_states"), &group, n)?;
            let mut reads = Vec::new();
            let s = &mut sub;
            if dv > 0 {
                out.collect(ctx, s, &out_buffer, first * dv, n * dv, false, &mut reads)?;
            }
            lse.collect(ctx, s, &lse_buffer, first, n, false, &mut reads)?;
            if first == last_first {
                out.finish_on_device(ctx, s, p.dtype, p.out_shape.clone())?;
                lse.finish_on_device(ctx, s, DType::F32, p.lse_shape())?;
            }
            let reads: Vec<(&Pooled, usize)> = reads.iter().map(|(b, n)| (&**b, *n)).collect();
            sub.submit(&reads)
        })?;
        let mut reads = reads.into_iter();
        if dv > 0 {
            out.place(first * dv, false, &mut reads);
        }
        lse.place(first, false, &mut reads);
    }
    Ok(ForwardOutput {
        out: out.into_array(p.dtype)?,
        lse: lse.into_array(DType::F32)?,
    })
}

fn bind(
    ctx: &Context,
    pipeline: &wgpu::ComputePipeline,
    buffers: &[(u32, wgpu::BindingResource<'_>)],
) -> wgpu::BindGroup {
    let entries: Vec<wgpu::BindGroupEntry<'_>> = buffers
        .iter()
        .map(|(binding, resource)| wgpu::BindGroupEntry {
            binding: *binding,
            resource: resource.clone(),
        })
        .collect();
    ctx.device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: Some("merge"),
        layout: &pipeline.get_bind_group_layout(0),
        entries: &entries,
    })
}

/// Records one pass of a merge kernel of lib/merge.wgsl's workgroup
/// size (these, and decoding's combine pass) over `count` invocations, on
/// a two-dimensional grid where one dimension cannot hold them.
pub(super) fn run(
    ctx: &Context,
    sub: &mut Submission<'_>,
    (pipeline, name): (&wgpu::ComputePipeline, &'static str),
    group: &wgpu::BindGroup,
    count: usize,
) -> Result<()> {
    let groups = (count as u64).div_ceil(WORKGROUP);
    let max_dim = ctx.limits.max_compute_workgroups_per_dimension.max(1) as u64;
    let x = groups.min(max_dim);
    let y = groups.div_ceil(x.max(1));
    if y > max_dim {
        return Err(Error::TooLarge(format!(
            "merging {count} values needs more workgroups than the GPU {} allows; use \
             device=\"cpu\"",
            ctx.adapter.name
        )));
    }
    sub.dispatch(pipeline, group, (x as u32, y as u32), name);
    Ok(())
}
