//! Merging attention states: the attention over the union of several key
//! sets from each set's output and log-sum-exp, on the CPU or the GPU.
//!
//! # The arithmetic
//!
//! For one row with parts `i = 0..n`, outputs `o_i` and log-sum-exps
//! `lse_i` (natural log), with `m = max_i lse_i`:
//!
//! ```text
//! s   = Σ_i exp(lse_i - m)              (parts in order)
//! lse = m + ln(s)                       = ln Σ_i exp(lse_i)
//! o   = Σ_i (exp(lse_i - m) / s) · o_i  = Σ_i exp(lse_i - lse) · o_i
//! ```
//!
//! the sum starting from 0 and taking the parts in order, so the result is
//! bitwise reproducible on each backend. Relative to `m` no exponential
//! overflows, and the weights are not rounded through `lse`.
//!
//! - A part with `lse_i = -inf` saw no key: its weight is 0 and its output
//!   is not read. Every other part's is, even where its weight underflows
//!   to 0: a NaN in it makes the row's `o` NaN there, as attention over
//!   the union would be (docs/design.md#non-finite-inputs).
//! - A row whose every part is empty is empty: `o = 0`, `lse = -inf`,
//!   never NaN.
//! - A NaN `lse_i` makes the row's `lse` NaN, else a `+inf` one makes it
//!   `+inf` (the lse of attention that saw a NaN or `+inf` score); the
//!   row's `o` is NaN either way. (FA2 writes `+inf` for an empty row:
//!   map it to `-inf` first.)

use crate::array::{Array, Input, Placement, Slice};
use crate::device::{resolve, Device};
use crate::error::{Error, Result};
use crate::output::ForwardOutput;
use crate::problem::{DType, MergeProblem, PartInputs};
use crate::{cpu, gpu};

/// The inputs of one argument checked against the problem: one per part,
/// or one with every part, of the validated lengths and dtype.
fn checked<'a>(
    argument: &str,
    arrays: &'a [Input<'a>],
    parts: usize,
    part_len: usize,
    dtype: DType,
) -> Result<PartInputs<'a, Input<'a>>> {
    let per_array = match arrays.len() {
        1 => parts * part_len,
        n if n == parts => part_len,
        n => {
            return Err(Error::Shape(format!(
                "{argument} has {n} arrays but the problem was validated for {parts} parts"
            )))
        }
    };
    for (i, a) in arrays.iter().enumerate() {
        if a.len() != per_array || a.dtype() != dtype {
            return Err(Error::Shape(format!(
                "{argument}[{i}] holds {} {} elements but the problem needs {per_array} {}",
                a.len(),
                a.dtype().numpy_name(),
                dtype.numpy_name()
            )));
        }
    }
    Ok(PartInputs::new(arrays, part_len))
}

/// Merges the states of `outs` and `lses` (host slices), read back to the
/// host.
pub fn merge_states(
    device: Device,
    problem: &MergeProblem,
    outs: &[Slice<'_>],
    lses: &[Slice<'_>],
) -> Result<ForwardOutput> {
    let outs: Vec<Input<'_>> = outs.iter().map(|&s| s.into()).collect();
    let lses: Vec<Input<'_>> = lses.iter().map(|&s| s.into()).collect();
    merge_states_arrays(device, problem, &outs, &lses, Placement::Host)?.into_host()
}

/// Merges the states of `outs` and `lses`, each one input per part or one
/// holding every part, host or device arrays, leaving the results where
/// `outputs` says. The merge is memory-bound, so `Device::Auto` computes
/// host arrays on the CPU: a copy to a GPU and back would cost more.
pub fn merge_states_arrays(
    device: Device,
    problem: &MergeProblem,
    outs: &[Input<'_>],
    lses: &[Input<'_>],
    outputs: Placement,
) -> Result<ForwardOutput<Array>> {
    let (parts, rows) = (problem.parts, problem.rows);
    let outs = checked("outs", outs, parts, problem.out_len(), problem.dtype)?;
    let lses = checked("lses", lses, parts, rows, problem.dtype.lse_dtype())?;
    let names: Vec<(String, Input<'_>)> = [("outs", outs), ("lses", lses)]
        .iter()
        .flat_map(|(argument, p)| {
            let count = p.arrays().len();
            p.arrays()
                .iter()
                .enumerate()
                .map(move |(i, a)| (part_name(argument, count, i), *a))
        })
        .collect();
    let named: Vec<(&str, Input<'_>)> = names.iter().map(|(n, a)| (n.as_str(), *a)).collect();
    let on_host = || {
        Ok(match device {
            Device::Auto => Device::Cpu,
            concrete => concrete,
        })
    };
    match resolve(device, on_host, &named, outputs)? {
        Device::Gpu(g) => gpu::merge_states(g, problem, outs, lses, outputs),
        _ => {
            let (out_slices, lse_slices) = (host(outs, "outs")?, host(lses, "lses")?);
            let merged = cpu::merge::merge_states(
                problem,
                PartInputs::new(&out_slices, outs.part_len()),
                PartInputs::new(&lse_slices, lses.part_len()),
            )?;
            Ok(ForwardOutput {
                out: Array::Host(merged.out),
                lse: Array::Host(merged.lse),
            })
        }
    }
}

/// `outs[2]` for a part given on its own, `outs` for all in one array.
fn part_name(argument: &str, arrays: usize, i: usize) -> String {
    match arrays {
        1 => argument.to_string(),
        _ => format!("{argument}[{i}]"),
    }
}

/// The host slices of an argument the CPU merges.
fn host<'a>(parts: PartInputs<'a, Input<'a>>, argument: &str) -> Result<Vec<Slice<'a>>> {
    let count = parts.arrays().len();
    parts
        .arrays()
        .iter()
        .enumerate()
        .map(|(i, &a)| crate::device::on_host(&part_name(argument, count, i), a))
        .collect()
}
