//! Sums of same-shaped arrays widened to float32: `flashport.dask`'s
//! gradient sums, which NumPy made in separate passes over whole arrays
//! (each float16 part cast to float32 at about 1.5 ns an element, then
//! added, then the total cast back), here in one pass over blocks that
//! stay in L1, on the call's threads.
//!
//! The result is bit for bit NumPy's `np.add(p0, p1, dtype=float32)`,
//! `+= p2`, …, `.astype(dtype)` on x86 (tests/test_dask_sums.py compares
//! them), with one exception that NumPy itself does not keep:
//!
//! - parts are widened exactly and added left to right in float32, and the
//!   total is rounded once, to nearest with ties to even;
//! - float16 is rounded by the hardware's conversion (F16C) or `half`'s,
//!   which NumPy's software rounding agrees with on every finite value,
//!   infinity and quiet NaN; bfloat16 as `ml_dtypes` rounds it, which
//!   keeps a NaN's sign but not its payload (`half` keeps both);
//! - the exception: where two NaNs meet in one add, x86 returns its first
//!   operand's (quieted), and NumPy's AVX-512 loop passes the running
//!   total first in its body but second in its last partial group of 16,
//!   so which payload an element keeps depends on where it falls. Here the
//!   total's NaN always stays, wherever the element is and whatever the
//!   compiler does with `+` (which promises no payload): see [`add`].
//!
//! A sum's NaNs are quiet, as the adds leave them. One part alone is not
//! added: a signaling NaN in it may come out quiet, where NumPy's cast
//! keeps it signaling (`flashport.dask` casts a lone part with NumPy).

use std::mem::MaybeUninit;
use std::ops::Range;

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use super::num_threads;
use super::threads::run_with;
use crate::array::{Buffer, Slice};
use crate::error::{Error, Result};
use crate::problem::{DType, SumProblem};
use crate::runtime::{buffers, parallel};

/// Elements a task sums: enough to outweigh handing it to another thread
/// (a few microseconds), small enough to share a few MiB out evenly.
const TASK: usize = 1 << 16;
/// Elements summed at a time: the float32 total and one widened part
/// (16 KiB) stay in L1 while every part is added in.
const BLOCK: usize = 2048;

/// One part as the sum reads it.
#[derive(Clone, Copy)]
enum Part<'a> {
    F16(&'a [f16]),
    BF16(&'a [bf16]),
    F32(&'a [f32]),
}

impl Part<'_> {
    /// Elements `range` widened (exactly) into `dst`; `VECTOR`: with the
    /// AVX2 and F16C kernels (see [`sum_task`]).
    #[inline(always)]
    fn widen<const VECTOR: bool>(self, range: Range<usize>, dst: &mut [f32]) {
        match self {
            Part::F16(x) => {
                #[cfg(target_arch = "x86_64")]
                if VECTOR {
                    // SAFETY: VECTOR only where the CPU has them.
                    return unsafe { f16c::widen(&x[range], dst) };
                }
                x[range].convert_to_f32_slice(dst)
            }
            Part::BF16(x) => x[range].convert_to_f32_slice(dst),
            Part::F32(x) => dst.copy_from_slice(&x[range]),
        }
    }
}

/// The dtypes a sum is returned in, each rounded from the float32 total.
trait Rounded: Copy + Default + Send {
    /// `total` rounded into `out`; `VECTOR` as for [`Part::widen`].
    fn round<const VECTOR: bool>(total: &[f32], out: &mut [Self]);
}

impl Rounded for f16 {
    #[inline(always)]
    fn round<const VECTOR: bool>(total: &[f32], out: &mut [f16]) {
        #[cfg(target_arch = "x86_64")]
        if VECTOR {
            // SAFETY: VECTOR only where the CPU has them.
            return unsafe { f16c::narrow(total, out) };
        }
        out.convert_from_f32_slice(total)
    }
}

impl Rounded for bf16 {
    /// As `ml_dtypes` rounds: to nearest, ties to even (`half`'s
    /// rounding), and a NaN to the quiet NaN of its sign.
    #[inline(always)]
    fn round<const VECTOR: bool>(total: &[f32], out: &mut [bf16]) {
        for (o, &x) in out.iter_mut().zip(total) {
            *o = if x.is_nan() {
                bf16::from_bits((x.to_bits() >> 16) as u16 & 0x8000 | 0x7fc0)
            } else {
                bf16::from_f32(x)
            };
        }
    }
}

impl Rounded for f32 {
    #[inline(always)]
    fn round<const VECTOR: bool>(total: &[f32], out: &mut [f32]) {
        out.copy_from_slice(total)
    }
}

/// Where [`sum_widened_into`] writes the sum: memory of the sum's dtype
/// and length, initialised or not (every element is written), such as a
/// NumPy array just made for it.
pub enum SumOut<'a> {
    F16(&'a mut [MaybeUninit<f16>]),
    BF16(&'a mut [MaybeUninit<bf16>]),
    F32(&'a mut [MaybeUninit<f32>]),
}

/// `parts[0] + parts[1] + …` in float32, rounded once to `problem.dtype`
/// (see the module's comment for the rounding and NaNs), in a new buffer.
/// The parts are only read; each must have the validated length, and a
/// float16, bfloat16 or float32 dtype.
pub fn sum_widened(problem: &SumProblem, parts: &[Slice<'_>]) -> Result<Buffer> {
    fn new<T>(len: usize) -> Result<Vec<T>> {
        buffers::try_with_capacity(len, "the sum")
    }
    let len = problem.len;
    let mut buffer = match problem.dtype {
        DType::F16 => Buffer::F16(new(len)?),
        DType::BF16 => Buffer::BF16(new(len)?),
        DType::F32 => Buffer::F32(new(len)?),
        DType::F64 => return Err(not_widened("dtype", DType::F64)),
    };
    let out = match &mut buffer {
        Buffer::F16(v) => SumOut::F16(buffers::spare(v, len)),
        Buffer::BF16(v) => SumOut::BF16(buffers::spare(v, len)),
        Buffer::F32(v) => SumOut::F32(buffers::spare(v, len)),
        Buffer::F64(_) => unreachable!("refused above"),
    };
    sum_widened_into(problem, parts, out)?;
    // SAFETY: `sum_widened_into` returned no error, so it wrote all `len`
    // elements of the spare capacity, which `new` reserved.
    unsafe {
        match &mut buffer {
            Buffer::F16(v) => v.set_len(len),
            Buffer::BF16(v) => v.set_len(len),
            Buffer::F32(v) => v.set_len(len),
            Buffer::F64(_) => unreachable!("refused above"),
        }
    }
    Ok(buffer)
}

/// [`sum_widened`] written into `out`, which must be of the problem's
/// dtype and length. Every element of `out` is written unless this
/// returns an error (a call interrupted, or arguments that disagree with
/// the problem, refused before anything is written).
pub fn sum_widened_into(problem: &SumProblem, parts: &[Slice<'_>], out: SumOut<'_>) -> Result<()> {
    if parts.len() != problem.parts {
        return Err(Error::Shape(format!(
            "sum_widened was given {} parts but the problem was validated for {}",
            parts.len(),
            problem.parts
        )));
    }
    let parts = parts
        .iter()
        .enumerate()
        .map(|(i, &s)| {
            if s.len() != problem.len {
                return Err(Error::Shape(format!(
                    "parts[{i}] holds {} elements but the problem was validated for {}",
                    s.len(),
                    problem.len
                )));
            }
            match s {
                Slice::F16(x) => Ok(Part::F16(x)),
                Slice::BF16(x) => Ok(Part::BF16(x)),
                Slice::F32(x) => Ok(Part::F32(x)),
                Slice::F64(_) => Err(not_widened(&format!("parts[{i}]"), DType::F64)),
            }
        })
        .collect::<Result<Vec<_>>>()?;
    let (dtype, len) = match &out {
        SumOut::F16(o) => (DType::F16, o.len()),
        SumOut::BF16(o) => (DType::BF16, o.len()),
        SumOut::F32(o) => (DType::F32, o.len()),
    };
    if (dtype, len) != (problem.dtype, problem.len) {
        return Err(Error::Shape(format!(
            "the sum's output holds {len} {} elements but the problem needs {} {}",
            dtype.numpy_name(),
            problem.len,
            problem.dtype.numpy_name()
        )));
    }
    let vector = vector_path();
    match out {
        SumOut::F16(out) => sum_as(&parts, out, vector),
        SumOut::BF16(out) => sum_as(&parts, out, vector),
        SumOut::F32(out) => sum_as(&parts, out, vector),
    }
}

fn not_widened(argument: &str, dtype: DType) -> Error {
    Error::DType {
        argument: argument.to_string(),
        dtype: dtype.numpy_name().to_string(),
        reason: "sum_widened sums float16, bfloat16 and float32 in float32".to_string(),
    }
}

/// The sum of `parts` into `out`, a task of [`TASK`] elements at a time
/// on the call's threads; `vector`: with [`sum_task_avx2`] (only where
/// [`vector_path`] says).
fn sum_as<O: Rounded>(parts: &[Part<'_>], out: &mut [MaybeUninit<O>], vector: bool) -> Result<()> {
    let Some((&first, rest)) = parts.split_first() else {
        return Err(Error::Shape(
            "sum_widened needs at least one part".to_string(),
        ));
    };
    // Memory not yet touched is faulted in by the tasks that own it, on
    // every thread at once.
    let tasks: Vec<(usize, &mut [MaybeUninit<O>])> = out
        .chunks_mut(TASK)
        .enumerate()
        .map(|(t, dst)| (t * TASK, dst))
        .collect();
    run_with(num_threads()?, || {
        parallel::for_each(tasks, |(start, dst)| {
            #[cfg(target_arch = "x86_64")]
            if vector {
                // SAFETY: the CPU has AVX2 and F16C (`vector_path`).
                return unsafe { sum_task_avx2(first, rest, start, dst) };
            }
            let _ = vector;
            sum_task::<O, false>(first, rest, start, dst)
        })
    })?
}

/// Whether the sums run [`sum_task_avx2`]: on x86-64 with AVX2 and F16C,
/// unless the overrides ask for the portable kernels.
fn vector_path() -> bool {
    #[cfg(target_arch = "x86_64")]
    if !crate::overrides::current().portable_cpu {
        return is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c");
    }
    false
}

/// [`sum_task`] compiled for AVX2 and F16C.
///
/// # Safety
///
/// The CPU must have AVX2 and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn sum_task_avx2<O: Rounded>(
    first: Part<'_>,
    rest: &[Part<'_>],
    start: usize,
    dst: &mut [MaybeUninit<O>],
) {
    sum_task::<O, true>(first, rest, start, dst)
}

/// One task: elements `start..start + dst.len()` of the parts summed into
/// `dst`, a block at a time, every part added into the block's total
/// while it sits in L1.
///
/// `VECTOR`: compiled into [`sum_task_avx2`], with float16 converted 8
/// lanes at a time by F16C's instructions in the loops. The portable
/// build converts through `half`'s slice conversion, which uses the same
/// instructions but calls a function for every 8 elements: the sum of two
/// float16 parts of 16M elements on one thread took 11.9 ms that way,
/// 6.9 ms this way.
#[inline(always)]
fn sum_task<O: Rounded, const VECTOR: bool>(
    first: Part<'_>,
    rest: &[Part<'_>],
    start: usize,
    dst: &mut [MaybeUninit<O>],
) {
    let (mut total, mut widened) = ([0f32; BLOCK], [0f32; BLOCK]);
    for (b, dst) in dst.chunks_mut(BLOCK).enumerate() {
        let n = dst.len();
        let range = start + b * BLOCK..start + b * BLOCK + n;
        let total = &mut total[..n];
        first.widen::<VECTOR>(range.clone(), total);
        for &part in rest {
            match part {
                Part::F32(x) => add(total, &x[range.clone()]),
                _ => {
                    part.widen::<VECTOR>(range.clone(), &mut widened[..n]);
                    add(total, &widened[..n]);
                }
            }
        }
        O::round::<VECTOR>(total, buffers::zero_init(dst));
    }
}

/// `total += x`, elementwise, where a NaN total stays itself (quieted) as
/// on x86 with the total as the first operand; a NaN `x` or an invalid
/// add (inf − inf) gives the hardware's NaN either way.
#[inline(always)]
fn add(total: &mut [f32], x: &[f32]) {
    for (t, &x) in total.iter_mut().zip(x) {
        let sum = *t + x;
        *t = if t.is_nan() {
            f32::from_bits(t.to_bits() | 0x0040_0000)
        } else {
            sum
        };
    }
}

/// float16 ↔ float32 8 lanes at a time with F16C, the instructions
/// `half`'s slice conversions use, in a loop of their own; the few
/// elements past the last 8 through `half`.
#[cfg(target_arch = "x86_64")]
mod f16c {
    use std::arch::x86_64::*;

    use half::f16;

    /// # Safety
    ///
    /// The CPU must have F16C and AVX.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn widen(src: &[f16], dst: &mut [f32]) {
        let (src, dst) = (&src[..dst.len()], &mut dst[..src.len()]);
        let lanes = src.len() / 8 * 8;
        for i in (0..lanes).step_by(8) {
            let h = _mm_loadu_si128(src.as_ptr().add(i).cast());
            _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
        }
        for (d, s) in dst[lanes..].iter_mut().zip(&src[lanes..]) {
            *d = s.to_f32();
        }
    }

    /// Rounded to nearest, ties to even.
    ///
    /// # Safety
    ///
    /// The CPU must have F16C and AVX.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn narrow(src: &[f32], dst: &mut [f16]) {
        let (src, dst) = (&src[..dst.len()], &mut dst[..src.len()]);
        let lanes = src.len() / 8 * 8;
        for i in (0..lanes).step_by(8) {
            let x = _mm256_loadu_ps(src.as_ptr().add(i));
            let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x);
            _mm_storeu_si128(dst.as_mut_ptr().add(i).cast(), h);
        }
        for (d, &s) in dst[lanes..].iter_mut().zip(&src[lanes..]) {
            *d = f16::from_f32(s);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::problem::{validate_sum, ArrayInfo};

    /// NumPy's formula, element by element: each part widened, added
    /// left to right with the total as the first operand (its NaN wins),
    /// the total rounded once by `round`.
    fn reference(parts: &[Vec<f32>], round: impl Fn(f32) -> u32) -> Vec<u32> {
        let quiet = |x: f32| f32::from_bits(x.to_bits() | 0x0040_0000);
        let mut total = parts[0].clone();
        for p in &parts[1..] {
            for (t, &x) in total.iter_mut().zip(p) {
                *t = match (t.is_nan(), x.is_nan()) {
                    (true, _) => quiet(*t),
                    (false, true) => quiet(x),
                    _ => *t + x,
                };
            }
        }
        total.into_iter().map(round).collect()
    }

    /// float32 to bfloat16 as `ml_dtypes` rounds, written out.
    fn ml_dtypes_bf16(x: f32) -> u32 {
        let b = x.to_bits();
        match x.is_nan() {
            true => b >> 16 & 0x8000 | 0x7fc0,
            false => b.wrapping_add(0x7fff + (b >> 16 & 1)) >> 16,
        }
    }

    /// The sum into a new vector of `O`, as bits.
    fn sum_bits<O: Rounded>(parts: &[Part<'_>], vector: bool, bits: fn(O) -> u32) -> Vec<u32> {
        let len = match parts[0] {
            Part::F16(x) => x.len(),
            Part::BF16(x) => x.len(),
            Part::F32(x) => x.len(),
        };
        let mut out = vec![MaybeUninit::<O>::uninit(); len];
        sum_as(parts, &mut out, vector).unwrap();
        // SAFETY: sum_as returned no error: every element is written.
        out.iter()
            .map(|o| bits(unsafe { o.assume_init() }))
            .collect()
    }

    /// Values from every class: normal, subnormal (float16's and
    /// bfloat16's too), ±0, ±inf, quiet NaNs of several payloads and
    /// signs, and sums that overflow float16.
    fn values(len: usize, seed: u32) -> Vec<f32> {
        let mut state = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
        (0..len)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 17;
                state ^= state << 5;
                let unit = (state >> 8) as f32 / 16_777_216.0 - 0.5;
                match state % 16 {
                    0 => f32::NAN,
                    1 => -f32::from_bits(0x7fc0_2000 | (state >> 20) << 13),
                    2 => f32::INFINITY,
                    3 => f32::NEG_INFINITY,
                    4 => -0.0,
                    5 => 0.0,
                    6 => f32::from_bits(state >> 9), // float32 subnormal
                    7 => 3e-6 * unit,                // float16 subnormal
                    8 => 130_000.0 * unit,
                    _ => 3.0 * unit,
                }
            })
            .collect()
    }

    #[test]
    fn sums_are_the_widened_sum_rounded_once_on_both_paths() {
        let paths: &[bool] = match vector_path() {
            true => &[false, true],
            false => &[false],
        };
        for len in [0, 1, 7, 9, BLOCK + 3, TASK + BLOCK + 5] {
            for count in 1..=5 {
                let parts: Vec<Vec<f32>> = (0..count).map(|p| values(len, p as u32)).collect();
                let f16s: Vec<Vec<f16>> = parts
                    .iter()
                    .map(|p| p.iter().map(|&x| f16::from_f32(x)).collect())
                    .collect();
                let bf16s: Vec<Vec<bf16>> = parts
                    .iter()
                    .map(|p| p.iter().map(|&x| bf16::from_f32(x)).collect())
                    .collect();
                // Mixed: part p float16, bfloat16 or float32 by p % 3.
                let given: Vec<Part<'_>> = (0..count)
                    .map(|p| match p % 3 {
                        0 => Part::F16(&f16s[p]),
                        1 => Part::F32(&parts[p]),
                        _ => Part::BF16(&bf16s[p]),
                    })
                    .collect();
                let exact: Vec<Vec<f32>> = (0..count)
                    .map(|p| match p % 3 {
                        0 => f16s[p].iter().map(|x| x.to_f32()).collect(),
                        1 => parts[p].clone(),
                        _ => bf16s[p].iter().map(|x| x.to_f32()).collect(),
                    })
                    .collect();
                let half = |x: f32| f16::from_f32(x).to_bits() as u32;
                for &vector in paths {
                    let what = format!("{count} parts of {len}, vector {vector}");
                    assert_eq!(
                        sum_bits::<f16>(&given, vector, |x| x.to_bits() as u32),
                        reference(&exact, half),
                        "float16, {what}"
                    );
                    assert_eq!(
                        sum_bits::<bf16>(&given, vector, |x| x.to_bits() as u32),
                        reference(&exact, ml_dtypes_bf16),
                        "bfloat16, {what}"
                    );
                    // A lone part is not added: its NaNs as the
                    // conversion leaves them.
                    if count > 1 {
                        assert_eq!(
                            sum_bits::<f32>(&given, vector, f32::to_bits),
                            reference(&exact, f32::to_bits),
                            "float32, {what}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn bfloat16_rounds_to_nearest_even_and_nans_to_the_quiet_nan_of_their_sign() {
        let cases: [(u32, u16); 8] = [
            (0x3f80_8000, 0x3f80), // a tie, to even (down)
            (0x3f81_8000, 0x3f82), // a tie, to even (up)
            (0x3f80_8001, 0x3f81),
            (0x7f7f_ffff, 0x7f80), // the largest float32 rounds to inf
            (0x0000_8001, 0x0001), // a subnormal, rounded up
            (0x8000_0000, 0x8000),
            (0x7fc0_1234, 0x7fc0),
            (0xffa0_0001, 0xffc0),
        ];
        let total: Vec<f32> = cases.iter().map(|&(x, _)| f32::from_bits(x)).collect();
        let mut out = vec![bf16::ZERO; cases.len()];
        bf16::round::<false>(&total, &mut out);
        for (&(x, want), got) in cases.iter().zip(out) {
            assert_eq!(got.to_bits(), want, "{x:#010x}");
        }
    }

    #[test]
    fn a_nan_total_keeps_its_payload_whatever_is_added() {
        let first = f32::from_bits(0x7fc0_0001);
        let mut total = vec![first, 1.0, f32::INFINITY];
        add(
            &mut total,
            &[
                f32::from_bits(0x7fc0_0002),
                f32::from_bits(0xffc0_0003),
                1.0,
            ],
        );
        let bits: Vec<u32> = total.iter().map(|x| x.to_bits()).collect();
        assert_eq!(bits, [0x7fc0_0001, 0xffc0_0003, 0x7f80_0000]);
    }

    fn problem(parts: usize, len: usize, dtype: &str) -> SumProblem {
        let shape = [len];
        let infos = vec![ArrayInfo::new(&shape, "float32"); parts];
        validate_sum(&infos, dtype).unwrap()
    }

    #[test]
    fn parts_that_disagree_with_the_problem_are_errors() {
        let x = [1.0f32; 4];
        let p = problem(2, 4, "float16");
        let short = [1.0f32; 3];
        assert!(matches!(
            sum_widened(&p, &[Slice::F32(&x)]),
            Err(Error::Shape(_))
        ));
        assert!(matches!(
            sum_widened(&p, &[Slice::F32(&x), Slice::F32(&short)]),
            Err(Error::Shape(m)) if m.contains("parts[1] holds 3")
        ));
        let wide = [1.0f64; 4];
        assert!(matches!(
            sum_widened(&p, &[Slice::F32(&x), Slice::F64(&wide)]),
            Err(Error::DType { argument, .. }) if argument == "parts[1]"
        ));
        let mut out = [MaybeUninit::new(0.0f32); 4];
        assert!(matches!(
            sum_widened_into(&p, &[Slice::F32(&x), Slice::F32(&x)], SumOut::F32(&mut out)),
            Err(Error::Shape(m)) if m.contains("4 float32 elements but the problem needs 4 float16")
        ));
    }
}
