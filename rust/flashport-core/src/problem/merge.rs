//! Validation of `merge_states`: parts of one shape and dtype, each with
//! its log-sum-exp.

use super::*;

/// One argument of `merge_states`: an array with a leading parts axis, or
/// one array per part.
#[derive(Debug, Clone, Copy)]
pub enum Parts<'a> {
    Stacked(ArrayInfo<'a>),
    Each(&'a [ArrayInfo<'a>]),
}

impl<'a> Parts<'a> {
    /// The number of parts and the distinct ones to check, each with its
    /// name for messages (`outs[2]`, or `outs` when stacked): a stacked
    /// array's parts all have one shape and dtype, so it is one part to
    /// check however many it holds (a broadcast view may hold more than
    /// memory could list). An error naming `argument` when there is no
    /// part.
    fn split(self, argument: &str) -> Result<(usize, Vec<(String, ArrayInfo<'a>)>)> {
        match self {
            // Something that is not an array of floats at all (a string, a
            // generator: NumPy makes them 0-d arrays) is a dtype error, as
            // the docstring says, before its shape is looked at.
            Parts::Stacked(info) if info.shape.is_empty() => {
                dtype_of(argument, &info)?;
                Err(Error::Shape(format!(
                    "{argument} has shape (): no parts along its first axis; \
                     merge_states needs at least one"
                )))
            }
            Parts::Stacked(info) => match info.shape.split_first() {
                Some((&count, part)) if count > 0 => Ok((
                    count,
                    vec![(argument.to_string(), ArrayInfo::new(part, info.dtype))],
                )),
                _ => Err(Error::Shape(format!(
                    "{argument} has shape {}: no parts along its first axis; \
                     merge_states needs at least one",
                    shape_str(info.shape)
                ))),
            },
            Parts::Each([]) => Err(Error::Shape(format!(
                "{argument} is an empty sequence: merge_states needs at least one part"
            ))),
            Parts::Each(infos) => Ok((
                infos.len(),
                infos
                    .iter()
                    .enumerate()
                    .map(|(i, info)| (format!("{argument}[{i}]"), *info))
                    .collect(),
            )),
        }
    }
}

/// A validated `merge_states`: `parts` attention states, each an output of
/// `rows × value_dim` (rows = every dimension but the last, flattened) and
/// a log-sum-exp per row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MergeProblem {
    pub parts: usize,
    pub rows: usize,
    pub value_dim: usize,
    /// The outputs' dtype; the log-sum-exps are `dtype.lse_dtype()`.
    pub dtype: DType,
    /// The shape of one part's output, which is the merged output's.
    pub out_shape: Vec<usize>,
}

impl MergeProblem {
    pub fn out_len(&self) -> usize {
        self.rows * self.value_dim
    }
    pub fn lse_shape(&self) -> Vec<usize> {
        self.out_shape[..self.out_shape.len() - 1].to_vec()
    }
}

/// Validates the arguments of `merge_states`: every part's output has one
/// shape `(..., seq_q, d_v)` and one float dtype, and its log-sum-exp has
/// that shape without `d_v`, in the dtype `attention` returns it in.
pub fn validate_merge(outs: Parts<'_>, lses: Parts<'_>) -> Result<MergeProblem> {
    let (parts, out_parts) = outs.split("outs")?;
    let (lse_count, lse_parts) = lses.split("lses")?;
    if parts != lse_count {
        return Err(Error::Shape(format!(
            "outs has {parts} parts but lses has {lse_count}; each part is one (out, lse) pair"
        )));
    }
    let (first_name, first) = &out_parts[0];
    let dtype = dtype_of(first_name, first)?;
    let Some((&value_dim, lead)) = first.shape.split_last().filter(|(_, l)| !l.is_empty()) else {
        let what = match outs {
            Parts::Stacked(_) => "(parts, ..., seq_q, d_v)",
            Parts::Each(_) => "(..., seq_q, d_v)",
        };
        return Err(Error::Shape(format!(
            "{first_name} has a part of shape {}; expected {what}",
            shape_str(first.shape)
        )));
    };
    for (name, info) in &out_parts[1..] {
        if dtype_of(name, info)? != dtype {
            return Err(Error::DType {
                argument: name.clone(),
                dtype: info.dtype.to_string(),
                reason: format!(
                    "{first_name} has dtype {}; every part's out must share one dtype",
                    first.dtype
                ),
            });
        }
        if info.shape != first.shape {
            return Err(Error::Shape(format!(
                "{name} has shape {} but {first_name} has shape {}; every part's out has the \
                 merged output's shape",
                shape_str(info.shape),
                shape_str(first.shape)
            )));
        }
    }
    let lse_dtype = dtype.lse_dtype().numpy_name();
    for (name, info) in &lse_parts {
        if info.dtype != lse_dtype {
            return Err(Error::DType {
                argument: name.clone(),
                dtype: info.dtype.to_string(),
                reason: format!(
                    "the log-sum-exps of {} outs are {lse_dtype} (float64 only for float64 \
                     outs), as flashport.attention returns them",
                    dtype.numpy_name()
                ),
            });
        }
        if info.shape != lead {
            return Err(Error::Shape(format!(
                "{name} has shape {} but the outs' parts have shape {}, whose log-sum-exps \
                 have shape {}",
                shape_str(info.shape),
                shape_str(first.shape),
                shape_str(lead)
            )));
        }
    }
    // The merged output, like each part, fits in memory's address range.
    elements(first.shape, first_name)?;
    Ok(MergeProblem {
        parts,
        rows: elements(lead, first_name)?,
        value_dim,
        dtype,
        out_shape: first.shape.to_vec(),
    })
}

/// The parts of one merge argument as given: one array per part, or one
/// array holding every part (a leading parts axis).
#[derive(Debug, Clone, Copy)]
pub struct PartInputs<'a, A> {
    arrays: &'a [A],
    part_len: usize,
}

impl<'a, A: Copy> PartInputs<'a, A> {
    pub fn new(arrays: &'a [A], part_len: usize) -> Self {
        PartInputs { arrays, part_len }
    }
    pub fn arrays(&self) -> &'a [A] {
        self.arrays
    }
    /// Elements of one part.
    pub fn part_len(&self) -> usize {
        self.part_len
    }
    /// Part `p`: the array that holds it, and the part's index in it.
    pub fn part(&self, p: usize) -> (A, usize) {
        match self.arrays {
            [all] => (*all, p),
            each => (each[p], 0),
        }
    }
}
