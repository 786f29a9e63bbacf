//! Merging attention states on the GPU (see [`crate::merge`]).

use crate::merge::PartInputs;
use crate::{Array, Error, ForwardOutput, Input, MergeProblem, Placement, Result};

/// Merges the states of `outs` and `lses` on the GPU.
pub fn merge_states(
    _problem: &MergeProblem,
    _outs: PartInputs<'_, Input<'_>>,
    _lses: PartInputs<'_, Input<'_>>,
    _outputs: Placement,
) -> Result<ForwardOutput<Array>> {
    Err(Error::BackendUnavailable(
        "merge_states runs on the CPU only so far; use device=\"cpu\"".to_string(),
    ))
}
