//! Packed batches of variable-length sequences, flash-attn's varlen layout:
//! `q (total_q, heads_q, d)`, `k (total_k, heads_kv, d)`, `v (total_k,
//! heads_kv, d_v)` with the prefix sums `cu_seqlens_q`, `cu_seqlens_k`.
//!
//! The kernels of both backends run the batch as one head-major problem
//! (`batch = 1`, `seq = total`, [`crate::problem::Varlen`]) whose rows and
//! keys are cut into **segments**: row `r` of sequence `b` sees only keys
//! in `cu_k[b]..cu_k[b + 1]`, causal and windows aligned bottom-right
//! within the sequence and ALiBi distances measured there too. The
//! [`Segments`] give each row its visible keys (the CPU's tile loops and
//! the GPU's row table read them), so no work crosses a sequence except
//! in tiles that straddle two (see docs/design.md#variable-length-batches).
//!
//! This module also moves the packed arrays into the kernels' head-major
//! layout and the results back: a copy on the host for host arrays, a
//! transpose pass on the GPU for device arrays.

use std::ops::Range;

use rayon::prelude::*;

use crate::{
    attention_arrays, attention_backward_arrays, Array, Buffer, Device, DeviceArray, ForwardOutput,
    Gradients, Input, Placement, Problem, Result, Slice, VariantArrays,
};

/// Where each sequence of a packed batch lies: its rows `cu_q[b]..cu_q[b +
/// 1]` and keys `cu_k[b]..cu_k[b + 1]` (validated prefix sums, see
/// [`crate::problem::validate_varlen_forward`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Segments {
    cu_q: Vec<usize>,
    cu_k: Vec<usize>,
}

/// The rows of one sequence and its keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sequence {
    pub rows: Range<usize>,
    pub keys: Range<usize>,
}

impl Segments {
    /// From validated prefix sums (same length, from 0, non-decreasing).
    pub(crate) fn new(cu_q: Vec<usize>, cu_k: Vec<usize>) -> Self {
        debug_assert!(cu_q.len() == cu_k.len() && !cu_q.is_empty());
        Segments { cu_q, cu_k }
    }

    pub fn sequences(&self) -> usize {
        self.cu_q.len() - 1
    }

    pub fn cu_seqlens_q(&self) -> &[usize] {
        &self.cu_q
    }

    pub fn cu_seqlens_k(&self) -> &[usize] {
        &self.cu_k
    }

    pub fn sequence(&self, b: usize) -> Sequence {
        Sequence {
            rows: self.cu_q[b]..self.cu_q[b + 1],
            keys: self.cu_k[b]..self.cu_k[b + 1],
        }
    }

    /// The sequence that packed row `row` belongs to (empty sequences own
    /// no row).
    pub fn sequence_of_row(&self, row: usize) -> usize {
        self.cu_q.partition_point(|&c| c <= row) - 1
    }

    /// Sequence `b` as a problem of its own: `p`'s heads, dimensions and
    /// variants, its own lengths and the default (bottom-right) positions.
    fn local(&self, p: &Problem, b: usize) -> Problem {
        let s = self.sequence(b);
        let (seq_q, seq_k) = (s.rows.len(), s.keys.len());
        Problem {
            seq_q,
            seq_k,
            q_offset: seq_k as i64 - seq_q as i64,
            k_offset: 0,
            varlen: None,
            ..*p
        }
    }

    /// Where the diagonal of sequence `b`'s rows lies: row `r` is at the
    /// position of key `r + diagonal(b)` (`cu_k[b + 1] - cu_q[b + 1]`, the
    /// bottom-right alignment within the sequence). ALiBi measures
    /// `|r + diagonal(b) - j|`, the distance within the sequence.
    pub fn diagonal(&self, b: usize) -> i64 {
        self.cu_k[b + 1] as i64 - self.cu_q[b + 1] as i64
    }

    /// The keys packed row `row` sees (causal and the window within its
    /// sequence), as packed key indices: a subrange of its sequence's keys.
    pub fn visible_keys(&self, p: &Problem, row: usize) -> Range<usize> {
        let b = self.sequence_of_row(row);
        let start = self.cu_q[b];
        let local = self.local(p, b).visible_keys(row - start);
        self.cu_k[b] + local.start..self.cu_k[b] + local.end
    }

    /// Every row's visible keys and sequence, computed once per call. Both
    /// ends of the ranges are non-decreasing in the row, across sequences
    /// too: a sequence's keys all lie before the next one's.
    pub fn rows(&self, p: &Problem) -> RowTable {
        let total = self.cu_q[self.sequences()];
        let mut table = RowTable {
            visible: Vec::with_capacity(total),
            sequence: Vec::with_capacity(total),
        };
        for b in 0..self.sequences() {
            let s = self.sequence(b);
            let local = self.local(p, b);
            for i in 0..s.rows.len() {
                let keys = local.visible_keys(i);
                table
                    .visible
                    .push(s.keys.start + keys.start..s.keys.start + keys.end);
                table.sequence.push(b);
            }
        }
        table
    }

    /// The (query, key) pairs the rows see, per head: what the work of a
    /// call follows.
    pub fn visible_pairs(&self, p: &Problem) -> u64 {
        (0..self.sequences())
            .map(|b| {
                let local = self.local(p, b);
                if local.has_range_mask() {
                    (0..local.seq_q)
                        .map(|i| local.visible_keys(i).len() as u64)
                        .sum()
                } else {
                    (local.seq_q * local.seq_k) as u64
                }
            })
            .sum()
    }

    pub(crate) fn check(&self, p: &Problem) -> Result<()> {
        let fits = p.varlen.map(|v| v.sequences) == Some(self.sequences())
            && self.cu_q.last() == Some(&p.seq_q)
            && self.cu_k.last() == Some(&p.seq_k)
            && p.batch == 1;
        if fits {
            Ok(())
        } else {
            Err(crate::Error::Shape(
                "the segments do not match the validated problem".to_string(),
            ))
        }
    }
}

/// Each packed row's visible keys and sequence ([`Segments::rows`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowTable {
    pub visible: Vec<Range<usize>>,
    pub sequence: Vec<usize>,
}

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
    use crate::problem::{validate_varlen_forward, SeqLens};
    use crate::{ArrayInfo, Options};

    fn packed(cu_q: &[i128], cu_k: &[i128], options: Options<'_>) -> (Problem, Segments) {
        let (tq, tk) = (
            *cu_q.last().unwrap() as usize,
            *cu_k.last().unwrap() as usize,
        );
        let shape_q = [cu_q.len()];
        let shape_k = [cu_k.len()];
        validate_varlen_forward(
            ArrayInfo::new(&[tq, 2, 8], "float32"),
            ArrayInfo::new(&[tk, 1, 8], "float32"),
            ArrayInfo::new(&[tk, 1, 4], "float32"),
            SeqLens {
                info: ArrayInfo::new(&shape_q, "int32"),
                values: cu_q,
            },
            SeqLens {
                info: ArrayInfo::new(&shape_k, "int64"),
                values: cu_k,
            },
            &options,
        )
        .unwrap()
    }

    /// Rows see their own sequence's keys only, causal bottom-right within
    /// it, and empty sequences own nothing.
    #[test]
    fn rows_see_their_sequence() {
        let causal = Options {
            causal: true,
            ..Options::default()
        };
        // Sequences: (q 2, k 3), (q 0, k 4), (q 3, k 1), (q 1, k 0).
        let (p, s) = packed(&[0, 2, 2, 5, 6], &[0, 3, 7, 8, 8], causal);
        assert_eq!((p.batch, p.seq_q, p.seq_k), (1, 6, 8));
        assert_eq!(
            (0..6).map(|r| s.sequence_of_row(r)).collect::<Vec<_>>(),
            vec![0, 0, 2, 2, 2, 3]
        );
        let rows = s.rows(&p);
        assert_eq!(rows.visible, vec![0..2, 0..3, 7..7, 7..7, 7..8, 8..8]);
        for r in 0..6 {
            assert_eq!(s.visible_keys(&p, r), rows.visible[r]);
        }
        assert_eq!(p.varlen.unwrap().visible_pairs, 2 + 3 + 1);
        assert_eq!(s.diagonal(2), 8 - 5);
        let (p, s) = packed(&[0, 2, 2, 5, 6], &[0, 3, 7, 8, 8], Options::default());
        assert_eq!(s.rows(&p).visible, vec![0..3, 0..3, 7..8, 7..8, 7..8, 8..8]);
        assert_eq!(p.varlen.unwrap().visible_pairs, 2 * 3 + 3);
        assert!((p.forward_flops() - 9.0 * 2.0 * 2.0 * 12.0).abs() < 1e-9);
    }

    #[test]
    fn windows_stay_within_the_sequence() {
        let window = Options {
            window: Some((1, 0)),
            ..Options::default()
        };
        let (p, s) = packed(&[0, 3, 6], &[0, 3, 8], window);
        // Sequence 1: q 3, k 5: row i's diagonal is key 3 + i + 2.
        assert_eq!(s.rows(&p).visible, vec![0..1, 0..2, 1..3, 4..6, 5..7, 6..8]);
    }

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
