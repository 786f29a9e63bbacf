//! Merging attention states on the CPU: rows in parallel, each row's
//! parts in order (see [`crate::merge`] for the arithmetic and the rules
//! for empty and invalid rows).

use std::borrow::Cow;

use super::element::Element;
use super::threads::run_with;
use super::{narrow, num_threads};
use crate::array::Slice;
use crate::error::Result;
use crate::output::ForwardOutput;
use crate::problem::{DType, MergeProblem, PartInputs};
use crate::runtime::parallel;

/// Values per task (rows × parts × d_v): enough to outweigh handing a
/// task to another thread, small enough to spread a few thousand rows.
const TASK_VALUES: usize = 1 << 15;

/// Merges the states of `outs` and `lses` (host slices, one per part or
/// one holding every part).
pub fn merge_states(
    problem: &MergeProblem,
    outs: PartInputs<'_, Slice<'_>>,
    lses: PartInputs<'_, Slice<'_>>,
) -> Result<ForwardOutput> {
    match problem.dtype {
        DType::F64 => merge_as::<f64>(problem, outs, lses),
        DType::F32 => merge_as::<f32>(problem, outs, lses),
        DType::F16 | DType::BF16 => {
            let merged = merge_as::<f32>(problem, outs, lses)?;
            Ok(ForwardOutput {
                out: narrow(merged.out, problem.dtype),
                lse: merged.lse,
            })
        }
    }
}

/// The parts of one argument viewed in the compute type.
struct Viewed<'a, T: Clone> {
    arrays: Vec<Cow<'a, [T]>>,
    part_len: usize,
}

impl<'a, T: Element> Viewed<'a, T> {
    fn new(parts: PartInputs<'_, Slice<'a>>) -> Self {
        Viewed {
            arrays: parts.arrays().iter().map(|s| T::view(*s)).collect(),
            part_len: parts.part_len(),
        }
    }

    /// Elements `range` of part `p`.
    fn part(&self, p: usize, range: std::ops::Range<usize>) -> &[T] {
        match self.arrays.as_slice() {
            [all] => &all[p * self.part_len..][range],
            each => &each[p][range],
        }
    }
}

fn merge_as<T: Element>(
    problem: &MergeProblem,
    outs: PartInputs<'_, Slice<'_>>,
    lses: PartInputs<'_, Slice<'_>>,
) -> Result<ForwardOutput> {
    let (rows, dv, parts) = (problem.rows, problem.value_dim, problem.parts);
    let outs = Viewed::<T>::new(outs);
    let lses = Viewed::<T>::new(lses);
    let mut out = crate::runtime::buffers::try_zeros(rows * dv, "the merged out")?;
    let mut lse = crate::runtime::buffers::try_zeros(rows, "the merged lse")?;
    let block = (TASK_VALUES / (parts * dv).max(1)).max(1);
    let mut tasks = Vec::with_capacity(rows.div_ceil(block));
    let (mut out_rest, mut lse_rest) = (out.as_mut_slice(), lse.as_mut_slice());
    for first in (0..rows).step_by(block) {
        let n = block.min(rows - first);
        let (o, o_rest) = std::mem::take(&mut out_rest).split_at_mut(n * dv);
        let (l, l_rest) = std::mem::take(&mut lse_rest).split_at_mut(n);
        tasks.push((first, o, l));
        (out_rest, lse_rest) = (o_rest, l_rest);
    }
    run_with(num_threads()?, || {
        parallel::for_each(tasks, |(first, out, lse)| {
            let mut weights = vec![T::ZERO; parts];
            for (r, (out_row, lse_row)) in out.chunks_mut(dv.max(1)).zip(lse).enumerate() {
                let row = first + r;
                *lse_row = merge_row(
                    |p| lses.part(p, row..row + 1)[0],
                    |p| outs.part(p, row * dv..(row + 1) * dv),
                    &mut weights,
                    &mut out_row[..dv],
                );
            }
        })
    })??;
    Ok(ForwardOutput {
        out: T::into_buffer(out),
        lse: T::into_buffer(lse),
    })
}

/// One row: its merged output into `out` and its merged lse returned,
/// from each part's lse and output row. `weights` is scratch, one per part.
pub(super) fn merge_row<'r, T: Element>(
    lse_of: impl Fn(usize) -> T,
    out_of: impl Fn(usize) -> &'r [T],
    weights: &mut [T],
    out: &mut [T],
) -> T {
    let mut max = T::NEG_INFINITY;
    let mut infinite = false;
    for p in 0..weights.len() {
        let x = lse_of(p);
        // A NaN lse makes the union's NaN, else a +inf one its +inf (the
        // lse of attention that saw a NaN or +inf score); o is NaN.
        if x.is_nan() {
            out.fill(T::NAN);
            return T::NAN;
        }
        infinite |= x == T::INFINITY;
        max = max.max(x);
    }
    if infinite {
        out.fill(T::NAN);
        return T::INFINITY;
    }
    out.fill(T::ZERO);
    if max == T::NEG_INFINITY {
        // Every part is empty: so is the union.
        return T::NEG_INFINITY;
    }
    // Relative to the largest lse, so no exponential overflows and at
    // least one term is 1; exp(-inf - max) = 0 for an empty part.
    let mut sum = T::ZERO;
    for (p, w) in weights.iter_mut().enumerate() {
        *w = (lse_of(p) - max).exp();
        sum += *w;
    }
    for (p, &w) in weights.iter().enumerate() {
        let w = w / sum;
        // An empty part is not read: its output may be anything, NaN
        // included. Any other is, even where its weight underflows to 0:
        // a NaN in its output (a NaN value its keys held) makes the
        // union's NaN, as attention over the union would be.
        if lse_of(p) != T::NEG_INFINITY {
            for (o, &x) in out.iter_mut().zip(out_of(p)) {
                *o += w * x;
            }
        }
    }
    max + sum.ln()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(lses: &[f64], outs: &[[f64; 2]]) -> ([f64; 2], f64) {
        let mut weights = vec![0.0; lses.len()];
        let mut out = [7.0; 2];
        let lse = merge_row(|p| lses[p], |p| &outs[p][..], &mut weights, &mut out);
        (out, lse)
    }

    #[test]
    fn empty_parts_contribute_nothing_and_all_empty_is_zero() {
        let inf = f64::INFINITY;
        let nan = f64::NAN;
        // An empty part's output is not read, whatever it holds.
        let (out, lse) = row(
            &[-inf, 2.0_f64.ln(), -inf],
            &[[nan; 2], [3.0, -1.0], [inf; 2]],
        );
        assert_eq!(out, [3.0, -1.0]);
        assert!((lse - 2.0_f64.ln()).abs() < 1e-15);
        let (out, lse) = row(&[-inf, -inf], &[[nan; 2], [1.0; 2]]);
        assert_eq!((out, lse), ([0.0; 2], -inf));
        assert!(out.iter().all(|x| x.is_sign_positive()));
    }

    #[test]
    fn weights_are_the_softmax_of_the_lses() {
        // lse = ln 1 and ln 3: weights 1/4 and 3/4, merged lse ln 4.
        let (out, lse) = row(&[0.0, 3.0_f64.ln()], &[[4.0, 0.0], [0.0, 8.0]]);
        assert!((out[0] - 1.0).abs() < 1e-15 && (out[1] - 6.0).abs() < 1e-15);
        assert!((lse - 4.0_f64.ln()).abs() < 1e-15);
        // Far apart: no overflow, the small part vanishes.
        let (out, lse) = row(&[1000.0, 0.0], &[[1.0, 2.0], [5.0, 5.0]]);
        assert_eq!((out, lse), ([1.0, 2.0], 1000.0));
    }

    #[test]
    fn nan_or_plus_infinity_makes_the_row_nan_or_infinite() {
        let (inf, nan) = (f64::INFINITY, f64::NAN);
        for (lses, want) in [([0.0, nan], nan), ([inf, 0.0], inf), ([nan, inf], nan)] {
            let (out, lse) = row(&lses, &[[1.0; 2], [1.0; 2]]);
            assert!(out.iter().all(|x| x.is_nan()));
            assert!(lse == want || (lse.is_nan() && want.is_nan()));
        }
        // A part of negligible weight is read: its NaN reaches the union.
        let (out, lse) = row(&[1000.0, 0.0], &[[1.0, 2.0], [nan, 5.0]]);
        assert!(out[0].is_nan() && out[1] == 2.0 && lse == 1000.0);
    }
}
