//! bfloat16 on the GPU. WGSL has no bfloat16 type, and the kernels read
//! float32 or float16; so a bfloat16 call's host inputs are widened to
//! float32 here (one host copy of each: the GPU computes in float32 in any
//! case), the call runs as the same problem in float32, and its outputs
//! other than lse are rounded back to bfloat16 on the host. The GPU keeps no
//! bfloat16 arrays, so such a call's results are always read back.

use super::assemble::to_buffer;
use crate::array::{Array, Buffer, Input, Placement, Slice};
use crate::error::{Error, Result};
use crate::problem::DType;

/// A bfloat16 call's inputs with float32 copies of its bfloat16 ones.
pub(crate) struct Widened {
    copies: Vec<Option<Vec<f32>>>,
}

impl Widened {
    /// Widens the bfloat16 arrays among `named` (other dtypes, such as
    /// lse, stay as they are). Device outputs are refused, naming the
    /// device array that asked for them: a bfloat16 call returns NumPy
    /// arrays.
    pub fn new(named: &[(&str, Input<'_>)], outputs: Placement) -> Result<Self> {
        if outputs == Placement::Device {
            let name = named
                .iter()
                .find(|(_, input)| input.is_device())
                .map_or("outputs", |(name, _)| name);
            return Err(device_error(name));
        }
        let copies = named
            .iter()
            .map(|(_, input)| match input {
                Input::Host(Slice::BF16(x)) => Some(widen(x)),
                _ => None,
            })
            .collect();
        Ok(Widened { copies })
    }

    /// `inputs` (the ones given to [`Widened::new`], in order) with each
    /// bfloat16 array replaced by its float32 copy.
    pub fn inputs<'a, const N: usize>(&'a self, inputs: [Input<'a>; N]) -> [Input<'a>; N] {
        let mut i = 0;
        inputs.map(|input| {
            let copy = self.copies.get(i).and_then(Option::as_ref);
            i += 1;
            copy.map_or(input, |c| Input::Host(Slice::F32(c)))
        })
    }

    /// Like [`Widened::inputs`], for a list of any length.
    pub fn list<'a>(&'a self, inputs: &[Input<'a>]) -> Vec<Input<'a>> {
        inputs
            .iter()
            .zip(&self.copies)
            .map(|(&input, copy)| copy.as_ref().map_or(input, |c| Input::Host(Slice::F32(c))))
            .collect()
    }
}

/// The error for a bfloat16 call whose results would stay on the GPU.
pub(crate) fn device_error(argument: &str) -> Error {
    Error::Value {
        argument: argument.to_string(),
        value: "a device array".to_string(),
        reason: "a bfloat16 call's results are NumPy arrays (the GPU keeps float32 and \
                 float16 arrays, not bfloat16); pass NumPy arrays (a device array's .numpy())"
            .to_string(),
    }
}

fn widen(x: &[half::bf16]) -> Vec<f32> {
    use half::slice::HalfFloatSliceExt;
    x.to_f32_vec()
}

/// A float32 result of the widened call rounded to bfloat16.
pub(crate) fn narrow(array: Array) -> Result<Array> {
    match array {
        Array::Host(Buffer::F32(v)) => Ok(Array::Host(to_buffer(v, DType::BF16))),
        Array::Host(other) => Ok(Array::Host(other)),
        Array::Device(_) => Err(device_error("outputs")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn widens_bfloat16_and_leaves_the_rest() {
        let q = [half::bf16::from_f32(1.5), half::bf16::from_f32(-0.25)];
        let lse = [3.0f32];
        let inputs = [Input::Host(Slice::BF16(&q)), Input::Host(Slice::F32(&lse))];
        let w = Widened::new(&[("q", inputs[0]), ("lse", inputs[1])], Placement::Host).unwrap();
        let [wq, wl] = w.inputs(inputs);
        let (Input::Host(Slice::F32(wq)), Input::Host(Slice::F32(wl))) = (wq, wl) else {
            panic!("not float32: {wq:?} {wl:?}");
        };
        assert_eq!(wq, &[1.5, -0.25]);
        assert_eq!(wl.as_ptr(), lse.as_ptr(), "lse is not copied");
        assert_eq!(w.list(&inputs)[0].dtype(), DType::F32);
    }

    #[test]
    fn device_outputs_are_refused() {
        let q = [half::bf16::from_f32(1.0)];
        let err = Widened::new(&[("q", Input::Host(Slice::BF16(&q)))], Placement::Device)
            .err()
            .unwrap();
        assert!(err.to_string().contains("bfloat16"), "{err}");
    }

    #[test]
    fn narrows_to_nearest_even() {
        // 1 + 2^-8 lies halfway between bfloat16's 1 and 1 + 2^-7.
        let values = vec![1.0 + 1.0 / 256.0, 1.0 + 3.0 / 256.0, f32::NEG_INFINITY];
        let Array::Host(Buffer::BF16(b)) = narrow(Array::Host(Buffer::F32(values))).unwrap() else {
            panic!("not bfloat16");
        };
        let got: Vec<f32> = b.iter().map(|x| x.to_f32()).collect();
        assert_eq!(got, [1.0, 1.0 + 4.0 / 256.0, f32::NEG_INFINITY]);
    }
}
