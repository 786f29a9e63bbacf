//! A call's outputs: assembled in host memory from the chunks' readbacks
//! (float16 rounded on the host), or kept on the device as new device
//! arrays.

use std::sync::Arc;

use super::context::Context;
use super::device_array;
use super::device_array::DeviceArray;
use super::pool::Pooled;
use super::transfer::Submission;
use crate::array::{Array, Buffer, Placement};
use crate::error::{Error, Result};
use crate::problem::DType;

/// Host results in the output's dtype (float16 rounded here).
pub(crate) fn to_buffer(values: Vec<f32>, dtype: DType) -> Buffer {
    match dtype {
        DType::F16 => Buffer::F16(round_to_half(&values)),
        DType::BF16 => Buffer::BF16(round_to_half(&values)),
        _ => Buffer::F32(values),
    }
}

/// Elements per task of the host's float32 → float16 rounding.
const ROUND_CHUNK: usize = 1 << 18;

/// `values` rounded to float16 or bfloat16 (nearest, ties to even), by
/// slices (F16C where the CPU has it, for float16) on several threads. Element by element on one
/// thread this was most of a float16 call's end-to-end time: on the H100
/// machine a (4,16,4096,64) forward took 107 ms NumPy to NumPy against
/// 36 ms in float32, for a 13.6 ms kernel.
pub(crate) fn round_to_half<H>(values: &[f32]) -> Vec<H>
where
    H: Copy + Default + Send + Sync,
    [H]: half::slice::HalfFloatSliceExt,
{
    use half::slice::HalfFloatSliceExt;
    use rayon::prelude::*;
    let mut out = Vec::with_capacity(values.len());
    let spare = crate::runtime::buffers::spare(&mut out, values.len());
    if values.len() <= ROUND_CHUNK {
        // One chunk: on this thread, not handed to a pool thread.
        crate::runtime::buffers::zero_init(spare).convert_from_f32_slice(values);
    } else {
        // Not rayon's global pool: a forked child would wait on its threads.
        crate::runtime::parallel::install(|| {
            spare
                .par_chunks_mut(ROUND_CHUNK)
                .zip(values.par_chunks(ROUND_CHUNK))
                .for_each(|(dst, src)| {
                    crate::runtime::buffers::zero_init(dst).convert_from_f32_slice(src);
                })
        });
    }
    // SAFETY: the chunks cover all `values.len()` elements, each
    // initialised above.
    unsafe { out.set_len(values.len()) };
    out
}

/// An output assembled from the chunks' results. When one chunk covers it
/// all (the usual case) its readback becomes the output as it is: copying
/// it into a zero-filled array cost a pass over fresh memory per output.
pub(crate) struct Assembled {
    len: usize,
    fill: f32,
    data: Option<Vec<f32>>,
}

impl Assembled {
    pub fn new(len: usize, fill: f32) -> Self {
        Assembled {
            len,
            fill,
            data: None,
        }
    }

    /// The whole output, filled with `fill` where no chunk wrote yet.
    fn slot(&mut self) -> &mut Vec<f32> {
        let (len, fill) = (self.len, self.fill);
        self.data.get_or_insert_with(|| vec![fill; len])
    }

    /// Puts one chunk's result at `offset`.
    pub fn put(&mut self, offset: usize, part: Vec<f32>) {
        if self.data.is_none() && offset == 0 && part.len() == self.len {
            self.data = Some(part);
        } else {
            self.slot()[offset..offset + part.len()].copy_from_slice(&part);
        }
    }

    /// Adds one chunk's result to the one at `offset` (the pieces of a GQA
    /// group cut across chunks, summed in chunk order so the result is
    /// still reproducible).
    fn add(&mut self, offset: usize, part: &[f32]) {
        let rows = &mut self.slot()[offset..offset + part.len()];
        rows.iter_mut().zip(part).for_each(|(a, b)| *a += b);
    }

    pub fn into_vec(mut self) -> Vec<f32> {
        std::mem::take(self.slot())
    }
}

/// One output of a call: assembled in host memory from the chunks'
/// readbacks, or kept on the device (and finally a device array).
pub(crate) enum Sink {
    Host(Assembled),
    Device(device_array::Resident),
    Done(DeviceArray),
}

impl Sink {
    pub fn new(outputs: Placement, len: usize, fill: f32) -> Self {
        match outputs {
            Placement::Host => Sink::Host(Assembled::new(len, fill)),
            Placement::Device => Sink::Device(device_array::Resident::new(len)),
        }
    }

    /// Records the commands that keep a chunk's `n` results (at element
    /// `offset`, added to what is there when `add`) on the device; a host
    /// sink asks for the buffer to be read back into `reads` instead.
    #[allow(clippy::too_many_arguments)]
    pub fn collect(
        &mut self,
        ctx: &Context,
        sub: &mut Submission<'_>,
        part: &Arc<Pooled>,
        offset: usize,
        n: usize,
        add: bool,
        reads: &mut Vec<(Arc<Pooled>, usize)>,
    ) -> Result<()> {
        match self {
            Sink::Host(_) => reads.push((part.clone(), n)),
            Sink::Device(r) if add => r.add(ctx, sub, offset, part, n)?,
            Sink::Device(r) => r.put(sub, offset, part, n),
            Sink::Done(_) => return Err(Error::Gpu("an output was finished twice".into())),
        }
        Ok(())
    }

    /// Places a chunk's readback (the next of `reads`) into a host sink.
    pub fn place(&mut self, offset: usize, add: bool, reads: &mut std::vec::IntoIter<Vec<f32>>) {
        if let Sink::Host(a) = self {
            let part = reads.next().unwrap_or_default();
            if add {
                a.add(offset, &part);
            } else {
                a.put(offset, part);
            }
        }
    }

    /// Records the last commands of a device output (its rounding to
    /// `dtype`) in `sub`, the call's last submission.
    pub fn finish_on_device(
        &mut self,
        ctx: &Arc<Context>,
        sub: &mut Submission<'_>,
        dtype: DType,
        shape: Vec<usize>,
    ) -> Result<()> {
        if let Sink::Device(r) = self {
            let r = std::mem::replace(r, device_array::Resident::new(0));
            *self = Sink::Done(r.finish(ctx, sub, dtype, shape)?);
        }
        Ok(())
    }

    /// The output, once the call's last submission is done: host values
    /// rounded to `dtype`, or the device array.
    pub fn into_array(self, dtype: DType) -> Result<Array> {
        match self {
            Sink::Host(a) => Ok(Array::Host(to_buffer(a.into_vec(), dtype))),
            Sink::Done(array) => Ok(Array::Device(array)),
            Sink::Device(_) => Err(Error::Gpu("a device output was never finished".into())),
        }
    }
}

/// Outputs kept on the device are assembled in float32 buffers of their
/// whole size (float16 ones rounded afterwards), which must fit one GPU
/// buffer even where the chunks' bindings are smaller.
pub(crate) fn check_device_outputs(
    ctx: &Context,
    outputs: Placement,
    lens: &[(&str, usize)],
) -> Result<()> {
    if outputs == Placement::Host {
        return Ok(());
    }
    let max = ctx.limits.max_buffer_size;
    match lens.iter().find(|(_, len)| 4 * *len as u64 > max) {
        Some((name, len)) => Err(Error::TooLarge(format!(
            "keeping {name} on the GPU needs a buffer of {} bytes, more than the {max} of the \
             GPU {}; pass NumPy arrays to have the results read back chunk by chunk",
            4 * *len as u64,
            ctx.adapter.name
        ))),
        None => Ok(()),
    }
}

/// An output of an empty problem, filled with `fill`, where `outputs`
/// says (a device one written before `sub`'s work).
pub(crate) fn empty_output(
    ctx: &Arc<Context>,
    sub: &mut Submission<'_>,
    outputs: Placement,
    dtype: DType,
    shape: Vec<usize>,
    fill: f32,
) -> Result<Array> {
    Ok(match outputs {
        Placement::Host => {
            let len = shape.iter().product();
            Array::Host(to_buffer(vec![fill; len], dtype))
        }
        Placement::Device => Array::Device(device_array::filled(ctx, sub, dtype, shape, fill)?),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The threaded slice rounding gives the bits of `f16::from_f32`
    /// element by element, across chunk boundaries and for ties,
    /// subnormals, overflow, infinities and NaN.
    #[test]
    fn host_half_rounding_matches_elementwise() {
        let specials = [
            0.0f32,
            -0.0,
            1.0 + f32::EPSILON,
            // Halfway between two float16 values: ties go to even.
            1.0 + 1.0 / 2048.0,
            1.0 + 3.0 / 2048.0,
            65504.0,
            65520.0,
            1e-7,
            -6.0e-8,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
        ];
        let mut state = 0x2545_f491_u32;
        let values: Vec<f32> = (0..2 * ROUND_CHUNK + 77)
            .map(|i| {
                state ^= state << 13;
                state ^= state >> 17;
                state ^= state << 5;
                let x = f32::from_bits(state);
                if i % 3 == 0 {
                    specials[i % specials.len()]
                } else if x.is_finite() {
                    // Mostly within float16's range.
                    x.clamp(-7.0e4, 7.0e4)
                } else {
                    x
                }
            })
            .collect();
        let brain: Vec<half::bf16> = round_to_half(&values);
        for (i, (&got, &x)) in brain.iter().zip(&values).enumerate() {
            let want = half::bf16::from_f32(x);
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "element {i}: {x:e} rounded to bfloat16 {got}, want {want}"
            );
        }
        let rounded: Vec<half::f16> = round_to_half(&values);
        assert_eq!(rounded.len(), values.len());
        for (i, (&got, &x)) in rounded.iter().zip(&values).enumerate() {
            let want = half::f16::from_f32(x);
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "element {i}: {x:e} rounded to {got} ({:#06x}), want {want} ({:#06x})",
                got.to_bits(),
                want.to_bits()
            );
        }
    }
}
