//! Inputs the caller broadcast — `np.broadcast_to` and friends give an axis
//! of many elements a stride of 0 — that the kernels can read once instead
//! of having them copied out in full: a `(seq_q, seq_k)` mask broadcast
//! from `(seq_k,)` is the `(1, seq_k)` mask the kernels already broadcast,
//! and keys and values repeated over their head axis are one key/value
//! head shared by every query head (MQA). Reading them in place costs
//! nothing where the copy could cost more memory than the machine has.
//!
//! Only what gives the same result is read once: a mask whose gradient is
//! asked for (`return_dmask`) has one gradient entry per element of the
//! caller's shape, and so do keys and values in the backward, so those are
//! read as given.

use crate::problem::Problem;

/// The axes of an array of `shape` with `strides` (in any unit) along
/// which one slice repeats: a stride of 0 over more than one element.
pub fn repeated_axes(shape: &[usize], strides: &[isize]) -> Vec<bool> {
    shape
        .iter()
        .zip(strides)
        .map(|(&len, &stride)| len > 1 && stride == 0)
        .collect()
}

/// Which repeated axes the binding reads only the first slice of, by the
/// caller's axis numbers.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ReadOnce {
    /// The mask's axes (empty without a mask).
    pub mask: Vec<bool>,
    /// The axes of `k` and of `v` (the head axis, when they are read as
    /// one head; else none).
    pub kv: Vec<bool>,
}

/// The problem as the kernels see it when the repeated axes of the mask
/// and of `k` and `v` (from [`repeated_axes`], in the caller's axes) are
/// read once, and which axes those are. `backward` is true for
/// `attention_backward`, whose key and value gradients follow the
/// caller's heads.
pub fn read_once(
    problem: &Problem,
    mask: Option<&[bool]>,
    k: &[bool],
    v: &[bool],
    backward: bool,
) -> (Problem, ReadOnce) {
    let mut seen = *problem;
    let mut once = ReadOnce::default();
    if let (Some(spec), Some(axes), false) = (&mut seen.mask, mask, problem.return_dmask) {
        let offset = 4 - spec.ndim;
        for (axis, &repeated) in axes.iter().enumerate() {
            if repeated {
                spec.dims[offset + axis] = 1;
            }
        }
        once.mask = axes.to_vec();
    }
    // The caller's head axis: (batch, heads, seq, d) or (heads, seq, d).
    let head_axis = match problem.ndim {
        4 => Some(1),
        3 => Some(0),
        _ => None,
    };
    if let Some(axis) = head_axis {
        let repeated = |axes: &[bool]| axes.get(axis).copied().unwrap_or(false);
        if !backward && problem.varlen.is_none() && repeated(k) && repeated(v) {
            seen.heads_kv = 1;
            once.kv = (0..problem.ndim).map(|a| a == axis).collect();
        }
    }
    (seen, once)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::problem::{validate_forward, ArrayInfo, DType, MaskDType, Options, VariantOptions};

    fn problem(mask: Option<&[usize]>, return_dmask: bool) -> Problem {
        let options = Options::from(VariantOptions {
            mask: mask.map(|shape| ArrayInfo::new(shape, "bool")),
            ..VariantOptions::default()
        });
        let mut p = validate_forward(
            ArrayInfo::new(&[2, 4, 5, 8], "float32"),
            ArrayInfo::new(&[2, 4, 7, 8], "float32"),
            ArrayInfo::new(&[2, 4, 7, 3], "float32"),
            &options,
        )
        .unwrap();
        p.return_dmask = return_dmask;
        p
    }

    #[test]
    fn repeated_axes_are_stride_zero_over_more_than_one() {
        assert_eq!(
            repeated_axes(&[3, 1, 4, 5], &[0, 0, 5, 1]),
            [true, false, false, false]
        );
        assert_eq!(repeated_axes(&[], &[]), Vec::<bool>::new());
    }

    #[test]
    fn a_repeated_mask_axis_is_read_as_one() {
        let p = problem(Some(&[5, 7]), false);
        let (seen, once) = read_once(&p, Some(&[true, false]), &[false; 4], &[false; 4], false);
        let spec = seen.mask.unwrap();
        assert_eq!(spec.dims, [1, 1, 1, 7]);
        assert_eq!(spec.ndim, 2);
        assert_eq!(spec.dtype, MaskDType::Bool);
        assert_eq!(once.mask, [true, false]);
        assert_eq!(seen.heads_kv, 4);
    }

    #[test]
    fn a_mask_whose_gradient_is_wanted_is_read_whole() {
        let p = problem(Some(&[5, 7]), true);
        let (seen, once) = read_once(&p, Some(&[true, false]), &[false; 4], &[false; 4], true);
        assert_eq!(seen.mask.unwrap().dims, [1, 1, 5, 7]);
        assert!(once.mask.is_empty());
    }

    #[test]
    fn keys_and_values_repeated_over_heads_are_one_head_forward_only() {
        let p = problem(None, false);
        let heads = [false, true, false, false];
        let (seen, once) = read_once(&p, None, &heads, &heads, false);
        assert_eq!((seen.heads_kv, seen.heads_q), (1, 4));
        assert_eq!(once.kv, [false, true, false, false]);
        assert_eq!(seen.dtype, DType::F32);
        // Only k, or the backward: as given.
        let (seen, once) = read_once(&p, None, &heads, &[false; 4], false);
        assert_eq!((seen.heads_kv, once.kv.is_empty()), (4, true));
        let (seen, once) = read_once(&p, None, &heads, &heads, true);
        assert_eq!((seen.heads_kv, once.kv.is_empty()), (4, true));
        // A repeated batch axis is not a head axis.
        let batch = [true, false, false, false];
        let (seen, _) = read_once(&p, None, &batch, &batch, false);
        assert_eq!(seen.heads_kv, 4);
    }
}
