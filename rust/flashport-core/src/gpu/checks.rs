//! What this backend cannot run, each an error naming the argument: the
//! dtypes it does not compute in and sequences past its row offsets. Below
//! the inputs and the device arrays, which both refuse the same dtypes.

use super::context::Context;
use crate::error::{Error, Result};
use crate::problem::{DType, Problem};

/// The error for float64 data offered to the GPU, naming the argument.
pub(crate) fn float64_error(argument: &str) -> Error {
    Error::DType {
        argument: argument.to_string(),
        dtype: "float64".to_string(),
        reason: "the GPU backend computes in float32 or float16; float64 runs on \
                 device=\"cpu\" (or cast the inputs to float32)"
            .to_string(),
    }
}

/// The error for float16 data on an adapter that cannot unpack it.
pub(crate) fn float16_error(ctx: &Context, argument: &str) -> Error {
    Error::DType {
        argument: argument.to_string(),
        dtype: "float16".to_string(),
        reason: format!(
            "the GPU adapter {} cannot unpack float16 in shaders; cast the inputs to \
             float32 or use device=\"cpu\"",
            ctx.adapter.name
        ),
    }
}

/// The GPU computes in float32 (float16 inputs widened as they load).
pub(crate) fn check_dtype(problem: &Problem) -> Result<()> {
    if problem.dtype == DType::F64 {
        return Err(float64_error("q"));
    }
    Ok(())
}

pub(crate) fn check_f16(ctx: &Context, problem: &Problem) -> Result<()> {
    if problem.dtype == DType::F16 && !ctx.f16_inputs {
        return Err(float16_error(ctx, "q"));
    }
    Ok(())
}

/// Row offsets in the kernels are `i32` sums of two sequence positions.
pub(crate) fn check_sizes(problem: &Problem) -> Result<()> {
    let limit = i32::MAX as usize / 2;
    if problem.seq_q > limit || problem.seq_k > limit {
        return Err(Error::TooLarge(format!(
            "sequences longer than {limit} are not supported on the GPU; use device=\"cpu\""
        )));
    }
    Ok(())
}
