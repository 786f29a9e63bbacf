//! The CPU backend: FlashAttention-2's tiled forward and recomputing
//! backward, parallel over (batch·head, tile) on the calling thread and
//! helper threads (`runtime/parallel.rs`).
//!
//! Every output element is produced by exactly one task, in an order that
//! depends neither on scheduling nor on the thread count (only the query
//! tile height follows the thread count, and no sum runs across query
//! rows in a way that depends on it), so results are bitwise reproducible.

pub mod decode;
pub mod element;
mod kernels;
pub mod merge;
pub mod real;
pub mod scores;
#[cfg(target_arch = "x86_64")]
mod simd;
pub mod softmax;
pub mod sum;
pub mod tiles;

mod backward;
mod forward;
mod rows;
mod scratch;
mod threads;

use crate::array::{Buffer, Slice};
use crate::error::Result;
use crate::output::{BackendGradients, ForwardOutput};
use crate::problem::{DType, Problem};
use crate::variants::VariantArrays;
use element::{Element, PackInput, Packing};
use scores::ScoreRules;

use crate::runtime::buffers;
use backward::{backward_typed, BackwardInputs};
use forward::forward_typed;
use threads::run_on_pool;
pub use threads::{num_threads, simd_kernels, MAX_THREADS, NUM_THREADS_ENV};

/// Forward pass on the CPU.
pub fn forward(
    problem: &Problem,
    q: Slice<'_>,
    k: Slice<'_>,
    v: Slice<'_>,
    variants: &VariantArrays<'_>,
) -> Result<ForwardOutput> {
    match problem.dtype {
        DType::F64 => forward_as::<f64>(problem, q, k, v, variants),
        DType::F32 => forward_as::<f32>(problem, q, k, v, variants),
        DType::F16 | DType::BF16 => {
            let result = forward_as::<f32>(problem, q, k, v, variants)?;
            Ok(ForwardOutput {
                out: narrow(result.out, problem.dtype),
                lse: result.lse,
            })
        }
    }
}

/// Backward pass on the CPU, from `[do, q, k, v, o, lse]`.
pub fn backward(
    problem: &Problem,
    inputs: [Slice<'_>; 6],
    variants: &VariantArrays<'_>,
) -> Result<BackendGradients> {
    match problem.dtype {
        DType::F64 => backward_as::<f64>(problem, inputs, variants),
        DType::F32 => backward_as::<f32>(problem, inputs, variants),
        DType::F16 | DType::BF16 => {
            let g = backward_as::<f32>(problem, inputs, variants)?;
            let dtype = problem.dtype;
            Ok(BackendGradients {
                dq: narrow(g.dq, dtype),
                dk: narrow(g.dk, dtype),
                dv: narrow(g.dv, dtype),
                d_scores: g.d_scores,
            })
        }
    }
}

/// A float32 result rounded (to nearest, ties to even) to the float16 or
/// bfloat16 `dtype` it was computed for; any other buffer as it is.
pub(crate) fn narrow(buffer: Buffer, dtype: DType) -> Buffer {
    match (buffer, dtype) {
        (Buffer::F32(v), DType::F16) => {
            Buffer::F16(v.into_iter().map(half::f16::from_f32).collect())
        }
        (Buffer::F32(v), DType::BF16) => {
            Buffer::BF16(v.into_iter().map(half::bf16::from_f32).collect())
        }
        (other, _) => other,
    }
}

fn forward_as<T: Element>(
    problem: &Problem,
    q: Slice<'_>,
    k: Slice<'_>,
    v: Slice<'_>,
    variants: &VariantArrays<'_>,
) -> Result<ForwardOutput> {
    if problem.out_len() == 0 && problem.lse_len() == 0 {
        // Nothing to compute, and an empty array's other dimensions may
        // be any size: no tile arithmetic on them.
        return Ok(ForwardOutput {
            out: T::into_buffer(Vec::new()),
            lse: T::into_buffer(Vec::new()),
        });
    }
    let (q, k, v) = (T::view(q), T::view(k), T::view(v));
    let (out, lse) = run_on_pool(problem, std::mem::size_of::<T>(), |tiles| {
        let rules = ScoreRules::<T>::new(problem, variants);
        forward_typed(problem, &rules, tiles, &q, &k, &v)
    })??;
    Ok(ForwardOutput {
        out: T::into_buffer(out),
        lse: T::into_buffer(lse),
    })
}

fn backward_as<T: Element>(
    problem: &Problem,
    arrays: [Slice<'_>; 6],
    variants: &VariantArrays<'_>,
) -> Result<BackendGradients> {
    if problem.batch == 0 || problem.seq_q == 0 || problem.seq_k == 0 {
        // No (query, key) pair: every gradient is zero. An empty array's
        // other dimensions may be any size, so no tile arithmetic on them.
        return Ok(BackendGradients {
            dq: T::into_buffer(buffers::try_zeros(problem.q_len(), "dq")?),
            dk: T::into_buffer(buffers::try_zeros(problem.k_len(), "dk")?),
            dv: T::into_buffer(buffers::try_zeros(problem.v_len(), "dv")?),
            d_scores: problem.return_dmask.then(|| T::into_buffer(Vec::new())),
        });
    }
    let [d_out, q, k, v, out, lse] = arrays.map(T::view);
    let (dq, dk, dv, d_scores) = run_on_pool(problem, std::mem::size_of::<T>(), |tiles| {
        let rules = ScoreRules::<T>::new(problem, variants);
        let kv_heads = problem.batch * problem.heads_kv;
        let (seq_k, d, dv) = (problem.seq_k, problem.head_dim, problem.value_dim);
        let input = |x, cols, packing| PackInput {
            x,
            heads: kv_heads,
            rows: seq_k,
            cols,
            packing,
        };
        let [k_packed, v_packed, k_row_panels] = T::pack_inputs([
            input(&k, d, Packing::Transposed),
            input(&v, dv, Packing::Transposed),
            input(&k, d, Packing::Rows),
        ])?;
        let inputs = BackwardInputs {
            d_out: &d_out,
            q: &q,
            k: &k,
            k_packed: k_packed.as_deref(),
            v_packed: v_packed.as_deref(),
            k_row_panels: k_row_panels.as_deref(),
            v: &v,
            out: &out,
            lse: &lse,
        };
        backward_typed(problem, &rules, tiles, &inputs)
    })??;
    Ok(BackendGradients {
        dq: T::into_buffer(dq),
        dk: T::into_buffer(dk),
        dv: T::into_buffer(dv),
        d_scores: d_scores.map(T::into_buffer),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;
    use crate::interrupt;

    #[test]
    fn an_interrupted_call_returns_no_result_and_the_next_call_computes() {
        use crate::problem::{validate_backward, validate_forward, ArrayInfo, Options};
        use std::cell::Cell;
        use std::rc::Rc;
        use std::time::Duration;
        let shape = [1, 2, 512, 32];
        let lse_shape = [1, 2, 512];
        let info = |shape| ArrayInfo::new(shape, "float64");
        let options = Options::default();
        let problem = validate_forward(info(&shape), info(&shape), info(&shape), &options).unwrap();
        let x: Vec<f64> = (0..problem.q_len()).map(|i| (i % 7) as f64 * 0.1).collect();
        let x = Slice::F64(&x);
        let none = VariantArrays::default();
        let forward_call = || forward(&problem, x, x, x, &none);
        let asked = Rc::new(Cell::new(0));
        let stop_at_once = |f: &dyn Fn() -> bool| {
            let counter = asked.clone();
            interrupt::with_check_every(
                Duration::ZERO,
                move || {
                    counter.set(counter.get() + 1);
                    true
                },
                f,
            )
        };
        let interrupted = stop_at_once(&|| forward_call() == Err(Error::Interrupted));
        assert!(interrupted);
        let done = forward_call().unwrap();
        let (Buffer::F64(out), Buffer::F64(lse)) = (&done.out, &done.lse) else {
            unreachable!()
        };

        let problem = validate_backward(
            info(&shape),
            info(&shape),
            info(&shape),
            info(&shape),
            info(&shape),
            info(&lse_shape),
            &options,
        )
        .unwrap();
        let inputs = [x, x, x, x, Slice::F64(out), Slice::F64(lse)];
        let backward_call = || backward(&problem, inputs, &none);
        let interrupted = stop_at_once(&|| backward_call() == Err(Error::Interrupted));
        assert!(interrupted);
        assert_eq!(asked.get(), 2, "asked once per call");
        assert!(backward_call().is_ok());
        // A check that lets the call go on changes nothing.
        let checked = interrupt::with_check_every(Duration::ZERO, || false, forward_call);
        assert_eq!(checked.unwrap(), done);
    }
}
