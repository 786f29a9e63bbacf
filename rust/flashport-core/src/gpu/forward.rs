//! The forward pass on the GPU: one dispatch of the selected kernel per
//! chunk of heads, its outputs read back or kept on the device.

use std::sync::Arc;
use std::time::Instant;

use super::adapters::Gpu;
use super::assemble::{check_device_outputs, empty_output, Sink};
use super::bfloat16::{narrow, Widened};
use super::checks::{check_dtype, check_f16, check_sizes};
use super::chunks::{self, binding_limit};
use super::context::Context;
use super::dispatch::{bind, grid, upload_variants};
use super::inputs::{chunk_input, source, Source};
use super::kernel::{Kernel, Tier};
use super::params::{Params, VariantData};
use super::pool::Pooled;
use super::run::with_inputs;
use super::select::{check_loop_limit, select_forward, simple_forward};
use super::transfer::Submission;
use super::{screen, timing};
use crate::array::{Array, Input, Placement, Slice};
use crate::error::Result;
use crate::output::ForwardOutput;
use crate::overrides::{self, Overrides};
use crate::problem::{DType, Problem};
use crate::variants::VariantArrays;

/// The forward pass on host inputs, outputs read back.
pub fn forward(
    problem: &Problem,
    q: Slice<'_>,
    k: Slice<'_>,
    v: Slice<'_>,
    variants: &VariantArrays<'_>,
) -> Result<ForwardOutput> {
    forward_arrays(
        Gpu::Best,
        problem,
        [q.into(), k.into(), v.into()],
        variants,
        Placement::Host,
    )?
    .into_host()
}

/// The forward pass on host or device inputs, on `gpu` (or where the
/// device inputs are), its outputs left where `outputs` says.
pub fn forward_arrays(
    gpu: Gpu,
    problem: &Problem,
    [q, k, v]: [Input<'_>; 3],
    variants: &VariantArrays<'_>,
    outputs: Placement,
) -> Result<ForwardOutput<Array>> {
    if problem.dtype == DType::BF16 {
        let wide = Widened::new(&[("q", q), ("k", k), ("v", v)], outputs)?;
        let wide_problem = Problem {
            dtype: DType::F32,
            ..*problem
        };
        let r = forward_arrays(
            gpu,
            &wide_problem,
            wide.inputs([q, k, v]),
            variants,
            outputs,
        )?;
        return Ok(ForwardOutput {
            out: narrow(r.out)?,
            lse: r.lse,
        });
    }
    check_dtype(problem)?;
    check_sizes(problem)?;
    let sources = [source("q", q)?, source("k", k)?, source("v", v)?];
    let vd = VariantData::new(problem, variants)?;
    let named = [("q", sources[0]), ("k", sources[1]), ("v", sources[2])];
    let overrides = overrides::current();
    with_inputs("running the forward pass", gpu, &named, |ctx| {
        forward_on(ctx, problem, sources, &vd, outputs, &overrides)
    })
}

/// Float32 `values` as an output where `outputs` says (a device one
/// uploaded before `sub`'s work).
fn resident(
    ctx: &Arc<Context>,
    sub: &mut Submission<'_>,
    outputs: Placement,
    values: Vec<f32>,
    shape: Vec<usize>,
) -> Result<Array> {
    Ok(match outputs {
        Placement::Host => Array::Host(crate::array::Buffer::F32(values)),
        Placement::Device => {
            let buffer = sub.upload("lse", bytemuck::cast_slice(&values))?;
            Array::Device(super::device_array::DeviceArray::from_buffer(
                ctx,
                buffer,
                DType::F32,
                shape,
            ))
        }
    })
}

fn forward_on(
    ctx: &Arc<Context>,
    p: &Problem,
    [q, k, v]: [Source<'_>; 3],
    vd: &VariantData,
    outputs: Placement,
    overrides: &Overrides,
) -> Result<ForwardOutput<Array>> {
    check_f16(ctx, p)?;
    timing::start_call();
    if (p.out_len() == 0 && p.lse_len() == 0) || p.seq_k == 0 {
        return ctx.scoped("making the outputs", || {
            let mut sub = Submission::new(ctx);
            let out = empty_output(ctx, &mut sub, outputs, p.dtype, p.out_shape(), 0.0)?;
            let lse = match vd.sinks(p) {
                // A row that sees no key still has its sink in the
                // denominator: its lse is the sink's logit.
                Some(sinks) if p.lse_len() > 0 => {
                    let values: Vec<f32> = (0..p.batch * p.heads_q)
                        .flat_map(|bh| std::iter::repeat_n(sinks[bh % p.heads_q], p.seq_q))
                        .collect();
                    resident(ctx, &mut sub, outputs, values, p.lse_shape())?
                }
                _ => empty_output(
                    ctx,
                    &mut sub,
                    outputs,
                    DType::F32,
                    p.lse_shape(),
                    f32::NEG_INFINITY,
                )?,
            };
            sub.submit(&[])?;
            Ok(ForwardOutput { out, lse })
        });
    }
    check_device_outputs(ctx, outputs, &[("o", p.out_len()), ("lse", p.lse_len())])?;
    let prepared = Instant::now();
    let mut out = Sink::new(outputs, p.out_len(), 0.0);
    let mut lse = Sink::new(outputs, p.lse_len(), f32::NEG_INFINITY);
    let (d, dv, sq, sk) = (p.head_dim, p.value_dim, p.seq_q, p.seq_k);
    let eb = if p.dtype == DType::F16 { 2 } else { 4 };
    let plan = select_forward(p, ctx.caps, overrides);
    let key = plan.forward;
    check_loop_limit(p, ctx.caps, &[key])?;
    let x = grid(sq, key.tiles.q_rows, ctx, "the forward pass")?;
    let screened_on_host = vd.screened(p);
    // Device arrays that passed the host's test as they were uploaded need
    // no screen, nor the simple kernel behind it.
    let clean = !screened_on_host && [&q, &k, &v].iter().all(|s| s.known_clean());
    // The simple kernel behind the screen (src/gpu/screen.rs), where one
    // is needed and its grid fits.
    let simple = match simple_forward(p, ctx.caps, overrides, &plan).filter(|_| !clean) {
        Some(k) => match grid(sq, k.tiles.q_rows, ctx, "the forward pass") {
            Ok(xs) => Some((ctx.pipeline(k)?, xs)),
            Err(_) => None,
        },
        None => None,
    };
    let limit = binding_limit(ctx, overrides);
    let chunks = chunks::plan(p, limit, ctx.limits.max_compute_workgroups_per_dimension)?;
    let pipeline = ctx.pipeline(key)?;
    let g = p.group_size();
    for (i, chunk) in chunks.iter().enumerate() {
        let (q0, nq) = (chunk.q0(g), chunk.q_count());
        let (kv0, nkv) = (chunk.kv0, chunk.kv_count);
        let last = i + 1 == chunks.len();
        let reads = ctx.scoped("running the forward pass", || {
            let mut sub = Submission::new(ctx);
            let vx = upload_variants(&mut sub, vd, limit)?;
            let params = sub.uniform(&Params::new(p, chunk, vd))?;
            let qb = chunk_input(&mut sub, "q", q, (sq * d, eb), (q0, nq))?;
            let kb = chunk_input(&mut sub, "k", k, (sk * d, eb), (kv0, nkv))?;
            let vb = chunk_input(&mut sub, "v", v, (sk * dv, eb), (kv0, nkv))?;
            let ob = sub.output(nq * sq * dv);
            let lb = sub.output(nq * sq);
            // The simple kernel's extra binding: the screen's flag (its
            // contents unread where the simple kernel is the plan's own).
            let flag = sub.scratch(4);
            let bindings = [
                params.binding(),
                qb.binding(),
                kb.binding(),
                vb.binding(),
                ob.binding(),
                lb.binding(),
                flag.binding(),
            ];
            let own = if key.kernel.tier() == Tier::Simple {
                7
            } else {
                6
            };
            let group = bind(ctx, &pipeline, &bindings[..own], Some(&vx));
            if simple.is_some() {
                screen::reset_flag(ctx, &mut sub, &flag, screened_on_host);
                if !screened_on_host {
                    let f16 = p.dtype == DType::F16;
                    screen::screen(ctx, &mut sub, f16, [&qb, &kb, &vb], &flag)?;
                }
            }
            sub.dispatch(&pipeline, &group, (x, nq as u32), key.kernel.name());
            if let Some((simple_pipeline, xs)) = &simple {
                let simple_group = bind(ctx, simple_pipeline, &bindings, Some(&vx));
                let name = Kernel::forward(Tier::Simple).name();
                sub.dispatch(simple_pipeline, &simple_group, (*xs, nq as u32), name);
            }
            let mut reads = Vec::new();
            out.collect(
                ctx,
                &mut sub,
                &ob,
                q0 * sq * dv,
                nq * sq * dv,
                false,
                &mut reads,
            )?;
            lse.collect(ctx, &mut sub, &lb, q0 * sq, nq * sq, false, &mut reads)?;
            if last {
                out.finish_on_device(ctx, &mut sub, p.dtype, p.out_shape())?;
                lse.finish_on_device(ctx, &mut sub, DType::F32, p.lse_shape())?;
            }
            if i == 0 {
                timing::record_host("prepare", prepared);
            }
            let reads: Vec<(&Pooled, usize)> = reads.iter().map(|(b, n)| (&**b, *n)).collect();
            sub.submit(&reads)
        })?;
        let mut reads = reads.into_iter();
        out.place(q0 * sq * dv, false, &mut reads);
        lse.place(q0 * sq, false, &mut reads);
    }
    Ok(ForwardOutput {
        out: out.into_array(p.dtype)?,
        lse: lse.into_array(DType::F32)?,
    })
}
