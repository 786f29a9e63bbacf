//! The backward pass on the GPU: the pre-pass (D = rowsum(dO∘O), the
//! `delta` of each query row), then dQ over query tiles and dK/dV over key
//! tiles, per chunk of heads, in one submission.

use std::sync::Arc;
use std::time::Instant;

use super::adapters::Gpu;
use super::assemble::{check_device_outputs, empty_output, Assembled, Sink};
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
use super::select::{check_loop_limit, select_backward, simple_backward};
use super::transfer::Submission;
use super::{screen, timing};
use crate::array::{Array, Buffer, Input, Placement, Slice};
use crate::error::{Error, Result};
use crate::output::BackendGradients;
use crate::overrides::{self, Overrides};
use crate::problem::{DType, Problem};
use crate::variants::VariantArrays;

/// The backward pass on host inputs `[do, q, k, v, o, lse]`, gradients
/// read back.
pub fn backward(
    problem: &Problem,
    inputs: [Slice<'_>; 6],
    variants: &VariantArrays<'_>,
) -> Result<BackendGradients> {
    backward_arrays(
        Gpu::Best,
        problem,
        inputs.map(Input::Host),
        variants,
        Placement::Host,
    )?
    .into_host()
}

/// The backward pass on host or device inputs `[do, q, k, v, o, lse]`,
/// on `gpu` (or where the device inputs are), `dq`, `dk` and `dv` left
/// where `outputs` says (the score gradient, for
/// the mask's, is always read back: the host reduces it).
pub fn backward_arrays(
    gpu: Gpu,
    problem: &Problem,
    inputs: [Input<'_>; 6],
    variants: &VariantArrays<'_>,
    outputs: Placement,
) -> Result<BackendGradients<Array>> {
    let [d_out, q, k, v, out, lse] = inputs;
    if problem.dtype == DType::BF16 {
        let named = [
            ("do", d_out),
            ("q", q),
            ("k", k),
            ("v", v),
            ("o", out),
            ("lse", lse),
        ];
        let wide = Widened::new(&named, outputs)?;
        let wide_problem = Problem {
            dtype: DType::F32,
            ..*problem
        };
        let g = backward_arrays(gpu, &wide_problem, wide.inputs(inputs), variants, outputs)?;
        return Ok(BackendGradients {
            dq: narrow(g.dq)?,
            dk: narrow(g.dk)?,
            dv: narrow(g.dv)?,
            d_scores: g.d_scores,
        });
    }
    check_dtype(problem)?;
    check_sizes(problem)?;
    let lse_f32: Vec<f32>;
    let lse = match lse {
        Input::Host(Slice::F32(x)) => Source::Host(bytemuck::cast_slice(x)),
        Input::Host(Slice::F64(x)) => {
            lse_f32 = x.iter().map(|&l| l as f32).collect();
            Source::Host(bytemuck::cast_slice(&lse_f32))
        }
        Input::Device(t) if t.dtype() == DType::F32 => Source::Device(t),
        other => {
            return Err(Error::DType {
                argument: "lse".to_string(),
                dtype: other.dtype().numpy_name().to_string(),
                reason: "lse must be float32 or float64 (as returned by attention)".to_string(),
            })
        }
    };
    let inputs = BackwardInputs {
        d_out: source("do", d_out)?,
        q: source("q", q)?,
        k: source("k", k)?,
        v: source("v", v)?,
        out: source("o", out)?,
        lse,
    };
    let vd = VariantData::new(problem, variants)?;
    let named = [
        ("do", inputs.d_out),
        ("q", inputs.q),
        ("k", inputs.k),
        ("v", inputs.v),
        ("o", inputs.out),
        ("lse", inputs.lse),
    ];
    let overrides = overrides::current();
    with_inputs("running the backward pass", gpu, &named, |ctx| {
        backward_on(ctx, problem, &inputs, &vd, outputs, &overrides)
    })
}

struct BackwardInputs<'a> {
    d_out: Source<'a>,
    q: Source<'a>,
    k: Source<'a>,
    v: Source<'a>,
    out: Source<'a>,
    /// float32.
    lse: Source<'a>,
}

fn backward_on(
    ctx: &Arc<Context>,
    p: &Problem,
    x: &BackwardInputs<'_>,
    vd: &VariantData,
    outputs: Placement,
    overrides: &Overrides,
) -> Result<BackendGradients<Array>> {
    check_f16(ctx, p)?;
    // d_out, q, k, v, (lse, D), two outputs, and vx.
    const STORAGE_BUFFERS: u32 = 8;
    if ctx.limits.max_storage_buffers_per_shader_stage < STORAGE_BUFFERS {
        return Err(Error::BackendUnavailable(format!(
            "the GPU backward binds {STORAGE_BUFFERS} storage buffers, more than the {} of \
             the adapter {}; use device=\"cpu\"",
            ctx.limits.max_storage_buffers_per_shader_stage, ctx.adapter.name
        )));
    }
    let scores_len = p.batch * p.heads_q * p.seq_q * p.seq_k;
    timing::start_call();
    if p.batch == 0 || p.seq_q == 0 || p.seq_k == 0 {
        return ctx.scoped("making the outputs", || {
            let mut sub = Submission::new(ctx);
            let grads = BackendGradients {
                dq: empty_output(ctx, &mut sub, outputs, p.dtype, p.q_shape(), 0.0)?,
                dk: empty_output(ctx, &mut sub, outputs, p.dtype, p.k_shape(), 0.0)?,
                dv: empty_output(ctx, &mut sub, outputs, p.dtype, p.v_shape(), 0.0)?,
                d_scores: p.return_dmask.then(|| Buffer::F32(vec![0.0; scores_len])),
            };
            sub.submit(&[])?;
            Ok(grads)
        });
    }
    check_device_outputs(
        ctx,
        outputs,
        &[("dq", p.q_len()), ("dk", p.k_len()), ("dv", p.v_len())],
    )?;
    let prepared = Instant::now();
    let mut dq = Sink::new(outputs, p.q_len(), 0.0);
    let mut dk = Sink::new(outputs, p.k_len(), 0.0);
    let mut dv_all = Sink::new(outputs, p.v_len(), 0.0);
    // Read back whatever the placement: the host reduces it to the mask's
    // shape.
    let mut d_scores = p.return_dmask.then(|| Assembled::new(scores_len, 0.0));
    let (d, dv, sq, sk) = (p.head_dim, p.value_dim, p.seq_q, p.seq_k);
    let eb = if p.dtype == DType::F16 { 2 } else { 4 };
    let plan = select_backward(p, ctx.caps, overrides);
    let (kp, kq, kkv) = (plan.preprocess, plan.dq, plan.dkdv);
    check_loop_limit(p, ctx.caps, &[kp, kq, kkv])?;
    let xp = grid(sq, kp.tiles.workgroup, ctx, "the backward pre-pass")?;
    let xq = grid(sq, kq.tiles.q_rows, ctx, "the dQ pass")?;
    let xkv = grid(sk, kkv.tiles.k_rows, ctx, "the dK/dV pass")?;
    // The simple kernels behind the screen (src/gpu/screen.rs), where they
    // are needed and their grids fit.
    let simple = match simple_backward(p, ctx.caps, overrides, &plan) {
        Some((sq_key, skv_key)) => {
            let grids = (
                grid(sq, sq_key.tiles.q_rows, ctx, "the dQ pass"),
                grid(sk, skv_key.tiles.k_rows, ctx, "the dK/dV pass"),
            );
            match grids {
                (Ok(xsq), Ok(xskv)) => {
                    Some(((ctx.pipeline(sq_key)?, xsq), (ctx.pipeline(skv_key)?, xskv)))
                }
                _ => None,
            }
        }
        None => None,
    };
    let screened_on_host = vd.screened(p);
    // q, k and v uploaded by `to_device` and found clean need no screen
    // (do, o and lse are the pre-pass's to test).
    let clean = [&x.q, &x.k, &x.v].iter().all(|s| s.known_clean());
    let limit = binding_limit(ctx, overrides);
    let chunks = chunks::plan(p, limit, ctx.limits.max_compute_workgroups_per_dimension)?;
    let (pre, dq_pipe, dkdv_pipe) = (ctx.pipeline(kp)?, ctx.pipeline(kq)?, ctx.pipeline(kkv)?);
    let g = p.group_size();
    let (sq_sk, dmask) = (sq * sk, p.return_dmask);
    for (i, chunk) in chunks.iter().enumerate() {
        let (q0, nq) = (chunk.q0(g), chunk.q_count());
        let (kv0, nkv) = (chunk.kv0, chunk.kv_count);
        let last = i + 1 == chunks.len();
        // A group cut into pieces: its pieces are summed in order, so the
        // result is still reproducible.
        let add = chunk.g0 != 0;
        let reads = ctx.scoped("running the backward pass", || {
            let mut sub = Submission::new(ctx);
            let vx = upload_variants(&mut sub, vd, limit)?;
            let params = sub.uniform(&Params::new(p, chunk, vd))?;
            let qs = (q0, nq);
            let kvs = (kv0, nkv);
            let dob = chunk_input(&mut sub, "do", x.d_out, (sq * dv, eb), qs)?;
            let ob = chunk_input(&mut sub, "o", x.out, (sq * dv, eb), qs)?;
            let qb = chunk_input(&mut sub, "q", x.q, (sq * d, eb), qs)?;
            let kb = chunk_input(&mut sub, "k", x.k, (sk * d, eb), kvs)?;
            let vb = chunk_input(&mut sub, "v", x.v, (sk * dv, eb), kvs)?;
            let lb = chunk_input(&mut sub, "lse", x.lse, (sq, 4), qs)?;
            // (lse, D) per query row, written by the pre-pass, then the
            // screen's flag (the last word).
            let stats = sub.output(2 * nq * sq + 2);
            let dqb = sub.output(nq * sq * d);
            let dkb = sub.output(nkv * sk * d);
            let dvb = sub.output(nkv * sk * dv);
            let dsb = if dmask {
                sub.output(nq * sq_sk)
            } else {
                // A one-word stand-in for the binding the pipeline names.
                sub.scratch(4)
            };
            let g_pre = bind(
                ctx,
                &pre,
                &[
                    params.binding(),
                    dob.binding(),
                    ob.binding(),
                    lb.binding(),
                    stats.binding(),
                ],
                None,
            );
            let common = [
                params.binding(),
                dob.binding(),
                qb.binding(),
                kb.binding(),
                vb.binding(),
                stats.binding(),
            ];
            let mut dq_bindings = common.to_vec();
            dq_bindings.extend([dqb.binding(), dsb.binding()]);
            let mut kv_bindings = common.to_vec();
            kv_bindings.extend([dkb.binding(), dvb.binding()]);
            let g_dq = bind(ctx, &dq_pipe, &dq_bindings, Some(&vx));
            let g_kv = bind(ctx, &dkdv_pipe, &kv_bindings, Some(&vx));
            // Raised by the pre-pass and the screen, read by the simple
            // kernels behind the fast ones.
            screen::reset_flag(ctx, &mut sub, &stats, screened_on_host);
            sub.dispatch(&pre, &g_pre, (xp, nq as u32), "backward_preprocess");
            if simple.is_some() && !screened_on_host && !clean {
                let f16 = p.dtype == DType::F16;
                screen::screen(ctx, &mut sub, f16, [&qb, &kb, &vb], &stats)?;
            }
            sub.dispatch(&dq_pipe, &g_dq, (xq, nq as u32), kq.kernel.name());
            sub.dispatch(&dkdv_pipe, &g_kv, (xkv, nkv as u32), kkv.kernel.name());
            if let Some(((sdq, xsq), (skv, xskv))) = &simple {
                let sg_dq = bind(ctx, sdq, &dq_bindings, Some(&vx));
                let sg_kv = bind(ctx, skv, &kv_bindings, Some(&vx));
                let (dq_name, kv_name) = (
                    Kernel::dq(Tier::Simple).name(),
                    Kernel::dkdv(Tier::Simple).name(),
                );
                sub.dispatch(sdq, &sg_dq, (*xsq, nq as u32), dq_name);
                sub.dispatch(skv, &sg_kv, (*xskv, nkv as u32), kv_name);
            }
            let mut reads = Vec::new();
            let (k_off, v_off) = (kv0 * sk * d, kv0 * sk * dv);
            let s = &mut sub;
            dq.collect(ctx, s, &dqb, q0 * sq * d, nq * sq * d, false, &mut reads)?;
            dk.collect(ctx, s, &dkb, k_off, nkv * sk * d, add, &mut reads)?;
            dv_all.collect(ctx, s, &dvb, v_off, nkv * sk * dv, add, &mut reads)?;
            if dmask {
                reads.push((dsb.clone(), nq * sq_sk));
            }
            if last {
                dq.finish_on_device(ctx, s, p.dtype, p.q_shape())?;
                dk.finish_on_device(ctx, s, p.dtype, p.k_shape())?;
                dv_all.finish_on_device(ctx, s, p.dtype, p.v_shape())?;
            }
            if i == 0 {
                timing::record_host("prepare", prepared);
            }
            let reads: Vec<(&Pooled, usize)> = reads.iter().map(|(b, n)| (&**b, *n)).collect();
            sub.submit(&reads)
        })?;
        let mut reads = reads.into_iter();
        dq.place(q0 * sq * d, false, &mut reads);
        dk.place(kv0 * sk * d, add, &mut reads);
        dv_all.place(kv0 * sk * dv, add, &mut reads);
        if let Some(all) = d_scores.as_mut() {
            all.put(q0 * sq_sk, reads.next().unwrap_or_default());
        }
    }
    Ok(BackendGradients {
        dq: dq.into_array(p.dtype)?,
        dk: dk.into_array(p.dtype)?,
        dv: dv_all.into_array(p.dtype)?,
        d_scores: d_scores.map(|s| Buffer::F32(s.into_vec())),
    })
}
