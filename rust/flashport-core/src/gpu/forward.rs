//! The forward pass on the GPU: one dispatch of the selected kernel per
//! chunk of heads, its outputs read back or kept on the device.

use std::sync::Arc;
use std::time::Instant;

use super::assemble::{check_device_outputs, empty_output, finish_outputs, Sink};
use super::chunks::{self, binding_limit};
use super::context::Context;
use super::dispatch::{bind, dispatch, grid, submit_and_read, uniform, upload_variants};
use super::inputs::{check_dtype, check_f16, check_sizes, chunk_input, source, Source};
use super::params::VariantData;
use super::run::with_inputs;
use super::select::select_forward;
use super::timing::{self, Timer};
use super::transfer::output;
use crate::overrides::{self, Overrides};
use crate::{Array, DType, ForwardOutput, Input, Placement, Problem, Result, Slice, VariantArrays};

/// The forward pass on host inputs, outputs read back.
pub fn forward(
    problem: &Problem,
    q: Slice<'_>,
    k: Slice<'_>,
    v: Slice<'_>,
    variants: &VariantArrays<'_>,
) -> Result<ForwardOutput> {
    forward_arrays(
        problem,
        [q.into(), k.into(), v.into()],
        variants,
        Placement::Host,
    )?
    .into_host()
}

/// The forward pass on host or device inputs, its outputs left where
/// `outputs` says.
pub fn forward_arrays(
    problem: &Problem,
    [q, k, v]: [Input<'_>; 3],
    variants: &VariantArrays<'_>,
    outputs: Placement,
) -> Result<ForwardOutput<Array>> {
    check_dtype(problem)?;
    check_sizes(problem)?;
    let sources = [source("q", q)?, source("k", k)?, source("v", v)?];
    let vd = VariantData::new(problem, variants)?;
    let named = [("q", sources[0]), ("k", sources[1]), ("v", sources[2])];
    let overrides = overrides::current();
    with_inputs("running the forward pass", &named, |ctx| {
        forward_on(ctx, problem, sources, &vd, outputs, &overrides)
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
    if (p.out_len() == 0 && p.lse_len() == 0) || p.seq_k == 0 {
        return ctx.scoped("making the outputs", || {
            Ok(ForwardOutput {
                out: empty_output(ctx, outputs, p.dtype, p.out_shape(), 0.0),
                lse: empty_output(ctx, outputs, DType::F32, p.lse_shape(), f32::NEG_INFINITY),
            })
        });
    }
    check_device_outputs(ctx, outputs, &[("o", p.out_len()), ("lse", p.lse_len())])?;
    let mut out = Sink::new(outputs, p.out_len(), 0.0);
    let mut lse = Sink::new(outputs, p.lse_len(), f32::NEG_INFINITY);
    let (d, dv, sq, sk) = (p.head_dim, p.value_dim, p.seq_q, p.seq_k);
    let eb = if p.dtype == DType::F16 { 2 } else { 4 };
    let key = select_forward(p, ctx.caps, overrides).forward;
    timing::start_call();
    let x = grid(sq, key.tiles.q_rows, ctx, "the forward pass")?;
    let limit = binding_limit(ctx, overrides);
    let chunks = chunks::plan(p, limit, ctx.limits.max_compute_workgroups_per_dimension)?;
    let pipeline = ctx.pipeline(key)?;
    let vx = ctx.scoped("uploading the variants", || upload_variants(ctx, vd, limit))?;
    let g = p.group_size();
    for chunk in &chunks {
        let (q0, nq) = (chunk.q0(g), chunk.q_count());
        let (kv0, nkv) = (chunk.kv0, chunk.kv_count);
        let reads = ctx.scoped("running the forward pass", || {
            let params = uniform(ctx, p, chunk, vd)?;
            let mut encoder = ctx.device.create_command_encoder(&Default::default());
            let t_up = Instant::now();
            let mut up = false;
            let enc = &mut encoder;
            let qb = chunk_input(ctx, enc, "q", q, sq * d, eb, q0, nq, &mut up)?;
            let kb = chunk_input(ctx, enc, "k", k, sk * d, eb, kv0, nkv, &mut up)?;
            let vb = chunk_input(ctx, enc, "v", v, sk * dv, eb, kv0, nkv, &mut up)?;
            if up {
                timing::record_host("upload", t_up);
            }
            let ob = output(ctx, "out", nq * sq * dv);
            let lb = output(ctx, "lse", nq * sq);
            let group = bind(
                ctx,
                &pipeline,
                &[&params, &qb, &kb, &vb, &ob, &lb],
                Some(&vx),
            );
            let mut timer = Timer::new(ctx);
            dispatch(
                &mut encoder,
                &pipeline,
                &group,
                x,
                nq as u32,
                timer.as_mut().map(|t| (t, key.kernel.name())),
            );
            let mut reads = Vec::new();
            let enc = &mut encoder;
            out.collect(ctx, enc, &ob, q0 * sq * dv, nq * sq * dv, false, &mut reads)?;
            lse.collect(ctx, enc, &lb, q0 * sq, nq * sq, false, &mut reads)?;
            submit_and_read(ctx, encoder, &reads, timer.as_ref())
        })?;
        let mut reads = reads.into_iter();
        out.place(q0 * sq * dv, false, &mut reads);
        lse.place(q0 * sq, false, &mut reads);
    }
    let [out, lse] = ctx.scoped("keeping the outputs on the device", || {
        finish_outputs(
            ctx,
            [
                (out, p.dtype, p.out_shape()),
                (lse, DType::F32, p.lse_shape()),
            ],
        )
    })?;
    Ok(ForwardOutput { out, lse })
}
