//! The main operation's entry points: the forward and backward pass of a
//! validated [`Problem`], checked against its arrays, then run on the
//! device [`crate::device`] chooses. The variant gradients both backends
//! share (the sinks', the mask's) are added here, on the host.

use crate::array::{check_len, Array, Buffer, Input, Placement, Slice};
use crate::device::{on_host, resolve, Device};
use crate::error::{Error, Result};
use crate::output::{ForwardOutput, Gradients};
use crate::problem::Problem;
use crate::variants::{self, VariantArrays};
use crate::{cpu, gpu};

/// A host slice of an input, read back from the device if it is there.
enum HostView<'a> {
    Borrowed(Slice<'a>),
    Read(Buffer),
}

impl<'a> HostView<'a> {
    fn of(input: Input<'a>) -> Result<Self> {
        Ok(match input {
            Input::Host(s) => HostView::Borrowed(s),
            Input::Device(t) => HostView::Read(t.read()?),
        })
    }
    fn slice(&self) -> Slice<'_> {
        match self {
            HostView::Borrowed(s) => *s,
            HostView::Read(b) => b.as_slice(),
        }
    }
}

/// Runs the forward pass of a validated problem.
pub fn attention(
    device: Device,
    problem: &Problem,
    q: Slice<'_>,
    k: Slice<'_>,
    v: Slice<'_>,
    variants: &VariantArrays<'_>,
) -> Result<ForwardOutput> {
    attention_arrays(
        device,
        problem,
        [q.into(), k.into(), v.into()],
        variants,
        Placement::Host,
    )?
    .into_host()
}

/// Runs the forward pass of a validated problem on inputs that may be
/// device tensors, leaving the outputs where `outputs` says. Device inputs
/// or outputs run on the GPU (`device` may then be `Gpu` or `Auto`).
pub fn attention_arrays(
    device: Device,
    problem: &Problem,
    [q, k, v]: [Input<'_>; 3],
    variants: &VariantArrays<'_>,
    outputs: Placement,
) -> Result<ForwardOutput<Array>> {
    check_len("q", &q, problem.q_len(), problem.dtype)?;
    check_len("k", &k, problem.k_len(), problem.dtype)?;
    check_len("v", &v, problem.v_len(), problem.dtype)?;
    variants.check(problem)?;
    let named = [("q", q), ("k", k), ("v", v)];
    match resolve(device, || device.resolve(problem), &named, outputs)? {
        Device::Gpu(g) => gpu::forward_arrays(g, problem, [q, k, v], variants, outputs),
        _ => {
            let r = cpu::forward(
                problem,
                on_host("q", q)?,
                on_host("k", k)?,
                on_host("v", v)?,
                variants,
            )?;
            Ok(ForwardOutput {
                out: Array::Host(r.out),
                lse: Array::Host(r.lse),
            })
        }
    }
}

/// Runs the backward pass of a validated problem, recomputing the
/// attention probabilities from `lse`.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward(
    device: Device,
    problem: &Problem,
    d_out: Slice<'_>,
    q: Slice<'_>,
    k: Slice<'_>,
    v: Slice<'_>,
    out: Slice<'_>,
    lse: Slice<'_>,
    variants: &VariantArrays<'_>,
) -> Result<Gradients> {
    attention_backward_arrays(
        device,
        problem,
        [d_out, q, k, v, out, lse].map(Input::Host),
        variants,
        Placement::Host,
    )?
    .into_host()
}

/// The backward pass on inputs `[do, q, k, v, o, lse]` that may be device
/// tensors, leaving `dq`, `dk` and `dv` where `outputs` says (see
/// [`attention_arrays`]). With sinks, `do`, `o` and `lse` are read back
/// from the device for the sinks' gradient, which the host computes.
pub fn attention_backward_arrays(
    device: Device,
    problem: &Problem,
    inputs: [Input<'_>; 6],
    variants: &VariantArrays<'_>,
    outputs: Placement,
) -> Result<Gradients<Array>> {
    let [d_out, q, k, v, out, lse] = inputs;
    check_len("do", &d_out, problem.out_len(), problem.dtype)?;
    check_len("q", &q, problem.q_len(), problem.dtype)?;
    check_len("k", &k, problem.k_len(), problem.dtype)?;
    check_len("v", &v, problem.v_len(), problem.dtype)?;
    check_len("o", &out, problem.out_len(), problem.dtype)?;
    if lse.len() != problem.lse_len() || lse.dtype().is_half() {
        return Err(Error::Shape(format!(
            "lse holds {} {} elements but the problem needs {} float32 or float64",
            lse.len(),
            lse.dtype().numpy_name(),
            problem.lse_len()
        )));
    }
    variants.check(problem)?;
    let named = [
        ("do", d_out),
        ("q", q),
        ("k", k),
        ("v", v),
        ("o", out),
        ("lse", lse),
    ];
    let grads = match resolve(device, || device.resolve(problem), &named, outputs)? {
        Device::Gpu(g) => gpu::backward_arrays(g, problem, inputs, variants, outputs)?,
        _ => {
            let [d_out, q, k, v, out, lse] = named.map(|(name, input)| on_host(name, input));
            cpu::backward(problem, [d_out?, q?, k?, v?, out?, lse?], variants)?.into_arrays()
        }
    };
    let dmask = match grads.d_scores {
        Some(Buffer::F32(full)) => Some(Buffer::F32(variants::reduce_to_mask(problem, &full))),
        Some(Buffer::F64(full)) => Some(Buffer::F64(variants::reduce_to_mask(problem, &full))),
        _ => None,
    };
    let dsinks = match variants.sinks {
        Some(sinks) => {
            // The host computes it in float64 from do, o and lse.
            let (d_out, out, lse) = (HostView::of(d_out)?, HostView::of(out)?, HostView::of(lse)?);
            Some(variants::sink_gradient(
                problem,
                &d_out.slice(),
                &out.slice(),
                &lse.slice(),
                sinks,
            ))
        }
        None => None,
    };
    Ok(Gradients {
        dq: grads.dq,
        dk: grads.dk,
        dv: grads.dv,
        dsinks,
        dmask,
    })
}
