//! Validation of `sum_widened`: parts of one shape, each float16, bfloat16
//! or float32, summed in float32 and rounded once to float16, bfloat16 or
//! float32.

use super::*;

/// A validated `sum_widened`: `parts` arrays of `shape` (`len` elements),
/// summed left to right in float32 and returned as `dtype`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SumProblem {
    pub parts: usize,
    pub len: usize,
    /// The parts' shape, which is the sum's.
    pub shape: Vec<usize>,
    pub dtype: DType,
}

/// The dtypes a sum in float32 takes and gives: float64 would need a
/// float64 sum, which NumPy already adds at memory speed.
fn widened(argument: &str, dtype: &str) -> Result<DType> {
    match DType::from_numpy_name(dtype) {
        Some(d @ (DType::F16 | DType::BF16 | DType::F32)) => Ok(d),
        _ => Err(Error::DType {
            argument: argument.to_string(),
            dtype: dtype.to_string(),
            reason: "sum_widened sums float16, bfloat16 and float32 in float32".to_string(),
        }),
    }
}

/// Validates the arguments of `sum_widened`: at least one part, every part
/// of one shape and of a dtype float32 holds exactly (the dtypes may
/// differ), and a result `dtype` of float16, bfloat16 or float32.
pub fn validate_sum(parts: &[ArrayInfo<'_>], dtype: &str) -> Result<SumProblem> {
    let dtype = widened("dtype", dtype)?;
    let Some(first) = parts.first() else {
        return Err(Error::Shape(
            "parts is an empty sequence: sum_widened needs at least one part".to_string(),
        ));
    };
    for (i, info) in parts.iter().enumerate() {
        widened(&format!("parts[{i}]"), info.dtype)?;
        if info.shape != first.shape {
            return Err(Error::Shape(format!(
                "parts[{i}] has shape {} but parts[0] has shape {}; every part has the sum's \
                 shape",
                shape_str(info.shape),
                shape_str(first.shape)
            )));
        }
    }
    Ok(SumProblem {
        parts: parts.len(),
        len: elements(first.shape, "parts[0]")?,
        shape: first.shape.to_vec(),
        dtype,
    })
}
