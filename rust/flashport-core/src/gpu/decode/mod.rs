//! attention_with_kvcache on the GPU: not yet (the CPU computes it).
use crate::{Array, Error, ForwardOutput, Input, KvCacheProblem, Placement, Result, VariantArrays};

pub fn attention_with_kvcache(
    _problem: &KvCacheProblem,
    _inputs: [Input<'_>; 3],
    _variants: &VariantArrays<'_>,
    _outputs: Placement,
) -> Result<ForwardOutput<Array>> {
    Err(Error::BackendUnavailable(
        "attention_with_kvcache does not run on the GPU yet; use device=\"cpu\"".into(),
    ))
}
