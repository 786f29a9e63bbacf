//! Packed batches of variable-length sequences, flash-attn's varlen layout:
//! `q (total_q, heads_q, d)`, `k (total_k, heads_kv, d)`, `v (total_k,
//! heads_kv, d_v)` with the prefix sums `cu_seqlens_q`, `cu_seqlens_k`.
//!
//! The kernels of both backends run the batch as one head-major problem
//! (`batch = 1`, `seq = total`, [`crate::problem::Varlen`]) whose rows and
//! keys are cut into **segments**: row `r` of sequence `b` sees only keys
//! in `cu_k[b]..cu_k[b + 1]`, causal and windows aligned bottom-right
//! within the sequence and ALiBi distances measured there too. The
//! [`Segments`], which validation makes, give each row its visible keys
//! (the CPU's tile loops and the GPU's row table read them), so no work
//! crosses a sequence except in tiles that straddle two (see
//! docs/design.md#variable-length-batches).
//!
//! This module runs such a batch: it moves the packed arrays into the
//! kernels' head-major layout and the results back (a copy on the host for
//! host arrays, a transpose pass on the GPU for device arrays) around the
//! main operation's dispatch.

use rayon::prelude::*;

use crate::problem::Segments;

use crate::array::{Array, Buffer, Input, Placement, Slice};
use crate::attention::{attention_arrays, attention_backward_arrays};
use crate::device::Device;
use crate::error::Result;
use crate::gpu::DeviceArray;
use crate::output::{ForwardOutput, Gradients};
use crate::problem::Problem;
use crate::variants::VariantArrays;

/// `x` of shape `(a, b, w)` as `(b, a, w)`: the packed `(total, heads,
/// dim)` layout to the kernels' `(heads, total, dim)` and back.
pub fn swap_leading<T: Copy + Send + Sync>(x: &[T], [a, b, w]: [usize; 3]) -> Vec<T> {
    debug_assert_eq!(x.len(), a * b * w);
    let mut out = Vec::with_capacity(x.len());
    if x.is_empty() {
        return out;
    }
    // Each task writes rows of the output: the reads are strided, the
    // writes sequential (the first touch of fresh pages is the larger cost).
    crate::runtime::buffers::spare(&mut out, x.len())
        .par_chunks_mut(w * a.max(1))
        .enumerate()
        .for_each(|(j, block)| {
            for (i, row) in block.chunks_exact_mut(w).enumerate() {
                let from = (i * b + j) * w;
                for (o, &v) in row.iter_mut().zip(&x[from..from + w]) {
                    o.write(v);
                }
            }
        });
    // SAFETY: the blocks cover all `x.len()` elements, each written above.
    unsafe { out.set_len(x.len()) };
    out
}

fn swap_slice(x: Slice<'_>, dims: [usize; 3]) -> Buffer {
    match x {
        Slice::F16(x) => Buffer::F16(swap_leading(x, dims)),
        Slice::BF16(x) => Buffer::BF16(swap_leading(x, dims)),
        Slice::F32(x) => Buffer::F32(swap_leading(x, dims)),
        Slice::F64(x) => Buffer::F64(swap_leading(x, dims)),
    }
}

/// An input in the kernels' layout: a host copy, or a device array
/// transposed on the GPU.
enum HeadMajor<'a> {
    Host(Buffer),
    Device(DeviceArray),
    /// An input the kernels take as it is (the lse).
    Same(Input<'a>),
}

impl HeadMajor<'_> {
    fn input(&self) -> Input<'_> {
        match self {
            HeadMajor::Host(b) => Input::Host(b.as_slice()),
            HeadMajor::Device(t) => Input::Device(t),
            HeadMajor::Same(i) => *i,
        }
    }
}

/// The packed inputs `(name, input, (total, heads, dim))` in the kernels'
/// layout, device ones transposed in one GPU submission.
fn to_head_major<'a>(inputs: &[(&str, Input<'a>, [usize; 3])]) -> Result<Vec<HeadMajor<'a>>> {
    let on_device: Vec<(&str, &DeviceArray, [usize; 3])> = inputs
        .iter()
        .filter_map(|&(name, input, dims)| match input {
            Input::Device(t) => Some((name, t, dims)),
            Input::Host(_) => None,
        })
        .collect();
    let mut moved = crate::gpu::swap_leading(&on_device)?.into_iter();
    Ok(inputs
        .iter()
        .map(|&(_, input, dims)| match input {
            Input::Host(s) => HeadMajor::Host(swap_slice(s, dims)),
            Input::Device(_) => HeadMajor::Device(moved.next().expect("one per device input")),
        })
        .collect())
}

/// Results `(name, array, (heads, total, dim))` back in the packed layout.
fn to_packed(results: Vec<(&str, Array, [usize; 3])>) -> Result<Vec<Array>> {
    let on_device: Vec<(&str, &DeviceArray, [usize; 3])> = results
        .iter()
        .filter_map(|(name, array, dims)| match array {
            Array::Device(t) => Some((*name, t, *dims)),
            Array::Host(_) => None,
        })
        .collect();
    let mut moved = crate::gpu::swap_leading(&on_device)?.into_iter();
    Ok(results
        .into_iter()
        .map(|(_, array, dims)| match array {
            Array::Host(b) => Array::Host(swap_slice(b.as_slice(), dims)),
            Array::Device(_) => Array::Device(moved.next().expect("one per device result")),
        })
        .collect())
}

/// Output of [`attention_varlen_arrays`]: `out (total_q, heads_q, d_v)`
/// and `lse (heads_q, total_q)`, flash-attn's layouts.
pub type VarlenOutput<A = Buffer> = ForwardOutput<A>;

/// The forward pass of a packed batch on host arrays.
pub fn attention_varlen(
    device: Device,
    problem: &Problem,
    segments: &Segments,
    [q, k, v]: [Slice<'_>; 3],
    variants: &VariantArrays<'_>,
) -> Result<ForwardOutput> {
    attention_varlen_arrays(
        device,
        problem,
        segments,
        [q.into(), k.into(), v.into()],
        variants,
        Placement::Host,
    )?
    .into_host()
}

/// The forward pass of a packed batch (validated by
/// [`crate::problem::validate_varlen_forward`]) on packed inputs that may
/// be device arrays, outputs left where `outputs` says.
pub fn attention_varlen_arrays(
    device: Device,
    problem: &Problem,
    segments: &Segments,
    [q, k, v]: [Input<'_>; 3],
    variants: &VariantArrays<'_>,
    outputs: Placement,
) -> Result<ForwardOutput<Array>> {
    segments.check(problem)?;
    let p = problem;
    let inputs = to_head_major(&[
        ("q", q, [p.seq_q, p.heads_q, p.head_dim]),
        ("k", k, [p.seq_k, p.heads_kv, p.head_dim]),
        ("v", v, [p.seq_k, p.heads_kv, p.value_dim]),
    ])?;
    let variants = VariantArrays {
        segments: Some(segments),
        ..*variants
    };
    let r = attention_arrays(
        device,
        problem,
        [inputs[0].input(), inputs[1].input(), inputs[2].input()],
        &variants,
        outputs,
    )?;
    let [out] = <[Array; 1]>::try_from(to_packed(vec![(
        "o",
        r.out,
        [p.heads_q, p.seq_q, p.value_dim],
    )])?)
    .expect("one result");
    Ok(ForwardOutput { out, lse: r.lse })
}

/// The backward pass of a packed batch on host arrays.
pub fn attention_varlen_backward(
    device: Device,
    problem: &Problem,
    segments: &Segments,
    inputs: [Slice<'_>; 6],
    variants: &VariantArrays<'_>,
) -> Result<Gradients> {
    attention_varlen_backward_arrays(
        device,
        problem,
        segments,
        inputs.map(Input::Host),
        variants,
        Placement::Host,
    )?
    .into_host()
}

/// The backward pass of a packed batch on packed `[do, q, k, v, o, lse]`
/// (`lse` as the forward returns it, `(heads_q, total_q)`): `dq`, `dk`,
/// `dv` in the packed layout of `q`, `k`, `v`, where `outputs` says.
pub fn attention_varlen_backward_arrays(
    device: Device,
    problem: &Problem,
    segments: &Segments,
    [d_out, q, k, v, out, lse]: [Input<'_>; 6],
    variants: &VariantArrays<'_>,
    outputs: Placement,
) -> Result<Gradients<Array>> {
    segments.check(problem)?;
    let p = problem;
    let rows_q = |dim| [p.seq_q, p.heads_q, dim];
    let mut inputs = to_head_major(&[
        ("do", d_out, rows_q(p.value_dim)),
        ("q", q, rows_q(p.head_dim)),
        ("k", k, [p.seq_k, p.heads_kv, p.head_dim]),
        ("v", v, [p.seq_k, p.heads_kv, p.value_dim]),
        ("o", out, rows_q(p.value_dim)),
    ])?;
    inputs.push(HeadMajor::Same(lse));
    let variants = VariantArrays {
        segments: Some(segments),
        ..*variants
    };
    let g = attention_backward_arrays(
        device,
        problem,
        [0, 1, 2, 3, 4, 5].map(|i| inputs[i].input()),
        &variants,
        outputs,
    )?;
    let packed = to_packed(vec![
        ("dq", g.dq, [p.heads_q, p.seq_q, p.head_dim]),
        ("dk", g.dk, [p.heads_kv, p.seq_k, p.head_dim]),
        ("dv", g.dv, [p.heads_kv, p.seq_k, p.value_dim]),
    ])?;
    let [dq, dk, dv] = <[Array; 3]>::try_from(packed).expect("three results");
    Ok(Gradients {
        dq,
        dk,
        dv,
        dsinks: g.dsinks,
        dmask: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn swapping_the_leading_axes_twice_is_the_identity() {
        let x: Vec<u32> = (0..2 * 3 * 5).collect();
        let y = swap_leading(&x, [2, 3, 5]);
        assert_eq!(&y[..5], &x[..5]);
        assert_eq!(&y[5..10], &x[15..20]);
        assert_eq!(swap_leading(&y, [3, 2, 5]), x);
        assert!(swap_leading::<u32>(&[], [0, 3, 5]).is_empty());
        assert!(swap_leading::<u32>(&[], [4, 3, 0]).is_empty());
    }
}
