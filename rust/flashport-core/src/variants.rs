//! Attention variants, the parts every backend shares: the array data the
//! variant keywords bring, the dropout generator, the mask's block map,
//! and the gradients that need no tile loop (sinks, the mask reduction).
//!
//! # The score, exactly
//!
//! For batch `b`, query head `h`, query row `i`, key `j`, and
//! `off = q_offset - k_offset` (the global positions of query row 0 and of
//! key 0; by default `seq_k - seq_q`, the bottom-right alignment of
//! `causal`):
//!
//! ```text
//! u    = scale · q[b,h,i] · k[b,h/g,j]
//! t    = softcap · tanh(u / softcap)              (t = u without softcap)
//! s    = t - slope[b,h] · |i + off - j| + mask[b,h,i,j]
//! s    = -inf where causal (j > i + off), the window
//!        (j < i + off - left or j > i + off + right) or a boolean mask
//!        (False) hides the key
//! lse  = log(Σ_j exp(s_j) + exp(sink[h]))         (no sink term without sinks)
//! P    = exp(s - lse)                              (0 where lse = -inf)
//! Z    = keep[b,h,i,j] / (1 - p)                   (Z = 1 without dropout)
//! o    = Σ_j P_j · Z_j · v[b,h/g,j]
//! ```
//!
//! and the backward, with `D = Σ_c do[c] · o[c]`:
//!
//! ```text
//! dP   = Z · (do · v_j)
//! dS   = P · (dP - D)                  = d loss / d s  (the float mask's gradient)
//! dU   = dS · (1 - (t / softcap)²)     (dU = dS without softcap)
//! dq   = scale · Σ_j dU_j k_j,   dk_j = scale · Σ_i dU_ij q_i,   dv_j = Σ_i P_ij Z_ij do_i
//! dsink[h] = -Σ_(b,i) exp(sink[h] - lse[b,h,i]) · D[b,h,i]
//! ```
//!
//! `keep` comes from Philox4x32-10 ([`philox4x32_10`]) keyed by the seed:
//! see [`DropoutMask`]. Nothing of it is stored between the passes.
//!
//! Only causal, the window and ALiBi use positions. The mask and dropout
//! are indexed by the local `(i, j)`, whatever the offsets: a mask array
//! has the call's own shape, and dropout's counter is the element's place
//! in this call's arrays, so a problem cut into key blocks draws another
//! dropout mask than the whole.

// Adding a variant: these places, for a keyword every operation takes
// (where one does not, skip its lines and refuse the keyword there).
//
// python/flashport/
//   _attention.py         _variants: the keyword, its off value the default;
//                         attention, attention_backward: the keyword in the
//                         signature and its overloads, the call, the docstring
//   _varlen.py, _kvcache.py, _cache.py      the same for their operations
//   reference.py          the float64 oracle
//   torch/_sdpa.py, dask/_api.py, dask/_tasks.py   where they offer it
// rust/flashport-py/src/
//   variants.rs           VariantArgs: the field, its line in options()
//                         (an array: metas, HeldVariants, variant_arrays)
// rust/flashport-core/src/
//   problem/variants.rs   VariantOptions' field, validate_variants, variant_names
//   problem/mod.rs        the Problem field that records it, off in Sizes::problem
//   problem/varlen.rs, problem/kvcache.rs   the refusal, where not taken
//   variants.rs           the score above (an array: VariantArrays, its checks)
//   cpu/scores.rs         ScoreRules (cpu/backward.rs: a gradient beyond dS)
//   gpu/select.rs         Variants, variants_of, the tiers that lack it
//   gpu/params.rs         Params' field (gpu/decode/mod.rs: DecodeUniform's)
//   gpu/shaders.rs        its override (gpu/cm2.rs, gpu/pipelines.rs: its
//                         cooperative-matrix-2 constant)
// shaders/ (not yet one score function)
//   lib/variants.wgsl, lib/common.wgsl      the override; Params, score()
//   decode/shared.wgsl, decode/decode.wgsl, gen/decode_subgroup.wgsl.in
//                                           decoding's uniform and scores
//   cm2/common.glsl       then scripts/cm2.sh
// Tests: tests/test_variants.py against the oracle on every backend,
// tests/test_fuzz_api.py, rust/flashport-core/tests/fuzz_validation.rs.

use std::ops::Range;

use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;

use crate::array::Slice;
use crate::error::{Error, Result};
use crate::problem::{DType, Dropout, KvCacheProblem, MaskDType, Problem};

/// The boolean or float data of a mask argument, contiguous, in the
/// caller's (unbroadcast) shape.
#[derive(Debug, Clone, Copy)]
pub enum MaskData<'a> {
    Bool(&'a [bool]),
    Float(Slice<'a>),
}

/// The arrays that the variant keywords bring, as validated in the
/// problem's `mask`, `alibi_per_batch` and `sinks` fields.
#[derive(Debug, Clone, Copy, Default)]
pub struct VariantArrays<'a> {
    pub mask: Option<MaskData<'a>>,
    /// `(heads_q,)` or `(batch, heads_q)` slopes.
    pub alibi_slopes: Option<&'a [f64]>,
    /// `(heads_q,)` sink logits.
    pub sinks: Option<&'a [f64]>,
    /// The sequences of a packed batch (`Problem::varlen`).
    pub segments: Option<&'a crate::problem::Segments>,
}

impl VariantArrays<'_> {
    /// Checks that the data matches what validation recorded.
    pub fn check(&self, problem: &Problem) -> Result<()> {
        let mismatch = |what: &str| {
            Err(Error::Shape(format!(
                "{what} does not match the validated problem"
            )))
        };
        match (&problem.mask, &self.mask) {
            (None, None) => {}
            (Some(spec), Some(data)) => {
                let (len, is_bool) = match data {
                    MaskData::Bool(b) => (b.len(), true),
                    MaskData::Float(f) => (f.len(), false),
                };
                if len != spec.len() || is_bool != (spec.dtype == MaskDType::Bool) {
                    return mismatch("mask");
                }
            }
            _ => return mismatch("mask"),
        }
        match (problem.varlen, self.segments) {
            (None, None) => {}
            (Some(_), Some(segments)) => segments.check(problem)?,
            _ => return mismatch("cu_seqlens"),
        }
        let slopes_len = match problem.alibi_per_batch {
            None => None,
            Some(true) => Some(slope_groups(problem) * problem.heads_q),
            Some(false) => Some(problem.heads_q),
        };
        if slopes_len != self.alibi_slopes.map(<[f64]>::len) {
            return mismatch("alibi_slopes");
        }
        let sinks_len = problem.sinks.then_some(problem.heads_q);
        if sinks_len != self.sinks.map(<[f64]>::len) {
            return mismatch("sinks");
        }
        Ok(())
    }

    /// Checks the arrays of an `attention_with_kvcache` call against its
    /// problem: no mask (the cache's lengths are the mask), slopes and
    /// sinks of the validated sizes.
    pub(crate) fn check_kvcache(&self, problem: &KvCacheProblem) -> Result<()> {
        let a = &problem.attention;
        let slopes = match a.alibi_per_batch {
            None => None,
            Some(true) => Some(a.batch * a.heads_q),
            Some(false) => Some(a.heads_q),
        };
        let sinks = a.sinks.then_some(a.heads_q);
        if self.mask.is_some()
            || slopes != self.alibi_slopes.map(<[f64]>::len)
            || sinks != self.sinks.map(<[f64]>::len)
        {
            return Err(Error::Shape(
                "the variant arrays do not match the validated problem".to_string(),
            ));
        }
        Ok(())
    }
}

// Philox4x32 constants (Salmon et al., "Parallel random numbers: as easy as
// 1, 2, 3", SC 2011), the generator cuRAND and PyTorch use for dropout.
const PHILOX_M0: u32 = 0xD251_1F53;
const PHILOX_M1: u32 = 0xCD9E_8D57;
const PHILOX_W0: u32 = 0x9E37_79B9;
const PHILOX_W1: u32 = 0xBB67_AE85;

/// Philox4x32 with 10 rounds: four random 32-bit words from a 128-bit
/// counter and a 64-bit key. A pure function of its arguments, which is
/// what lets the backward (and another backend) regenerate the forward's
/// dropout mask instead of storing it.
pub fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let (mut c, mut k) = (counter, key);
    for round in 0..10 {
        if round > 0 {
            k = [k[0].wrapping_add(PHILOX_W0), k[1].wrapping_add(PHILOX_W1)];
        }
        let p0 = u64::from(PHILOX_M0) * u64::from(c[0]);
        let p1 = u64::from(PHILOX_M1) * u64::from(c[2]);
        c = [
            (p1 >> 32) as u32 ^ c[1] ^ k[0],
            p1 as u32,
            (p0 >> 32) as u32 ^ c[3] ^ k[1],
            p0 as u32,
        ];
    }
    c
}

/// The dropout mask of one call, regenerated wherever it is needed.
///
/// The score `(b, h, i, j)` (flat head `bh = b·heads_q + h`) is kept when
/// word `j mod 4` of `philox4x32_10([j / 4, i, bh, 0], [seed_lo, seed_hi])`
/// is at least `threshold = floor(p · 2³²)`, so one generator call serves
/// four neighbouring keys and the kept fraction is `1 - threshold / 2³²`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DropoutMask {
    pub key: [u32; 2],
    pub threshold: u32,
}

impl DropoutMask {
    pub fn new(dropout: Dropout) -> Self {
        // p < 1, so p · 2³² < 2³² and the product is exact in f64.
        let threshold = (dropout.p * 4_294_967_296.0).floor() as u32;
        DropoutMask {
            key: [dropout.seed as u32, (dropout.seed >> 32) as u32],
            threshold,
        }
    }

    /// Whether score `(bh, row, key)` is kept.
    pub fn keeps(&self, bh: usize, row: usize, key: usize) -> bool {
        let words = philox4x32_10([(key / 4) as u32, row as u32, bh as u32, 0], self.key);
        words[key % 4] >= self.threshold
    }

    /// Calls `f(offset, kept)` for each key of `keys` in row `row` of flat
    /// head `bh`, `offset` counting from `keys.start`.
    pub fn for_each(
        &self,
        bh: usize,
        row: usize,
        keys: Range<usize>,
        mut f: impl FnMut(usize, bool),
    ) {
        let mut key = keys.start;
        while key < keys.end {
            let group = key / 4;
            let words = philox4x32_10([group as u32, row as u32, bh as u32, 0], self.key);
            let group_end = ((group + 1) * 4).min(keys.end);
            for j in key..group_end {
                f(j - keys.start, words[j % 4] >= self.threshold);
            }
            key = group_end;
        }
    }
}

/// The element types a mask is converted to (and the base of the CPU
/// kernels' element trait).
pub trait MaskScalar: Copy + Send + Sync + PartialEq + 'static {
    const ZERO: Self;
    const NEG_INFINITY: Self;
    fn from_f64(x: f64) -> Self;
}

impl MaskScalar for f32 {
    const ZERO: Self = 0.0;
    const NEG_INFINITY: Self = f32::NEG_INFINITY;
    #[inline(always)]
    fn from_f64(x: f64) -> Self {
        x as f32
    }
}

impl MaskScalar for f64 {
    const ZERO: Self = 0.0;
    const NEG_INFINITY: Self = f64::NEG_INFINITY;
    #[inline(always)]
    fn from_f64(x: f64) -> Self {
        x
    }
}

/// Rows and keys of the mask's block map: the granularity at which tiles
/// that a mask removes entirely are found and skipped.
pub const MASK_BLOCK: usize = 16;

/// Element strides of a contiguous array of extents `dims`, with 0 where
/// an extent is 1, so that indexing with the full problem's indices
/// broadcasts.
pub fn broadcast_strides(dims: [usize; 4]) -> [usize; 4] {
    let mut strides = [0; 4];
    let mut stride = 1;
    for axis in (0..4).rev() {
        strides[axis] = if dims[axis] == 1 { 0 } else { stride };
        stride *= dims[axis];
    }
    strides
}

/// Where a mask's values lie and which of its blocks hold anything
/// visible: the part of a mask that does not depend on how its values are
/// stored.
#[derive(Debug, Clone)]
pub struct MaskLayout {
    /// Canonical `(batch, heads_q, seq_q, seq_k)` extents of the values;
    /// 1 where the mask broadcasts.
    pub dims: [usize; 4],
    /// Element strides of the four dimensions, 0 where the mask broadcasts.
    pub strides: [usize; 4],
    /// Per (mask batch, mask head, row block, key block): 1 when some value
    /// of the block is visible (not `-inf`, not `False`).
    pub blocks: Vec<u8>,
    /// Row and key block counts of the map.
    pub block_counts: [usize; 2],
}

impl MaskLayout {
    /// Maps the [`MASK_BLOCK`]² blocks of `values` (the mask in its own
    /// shape `dims`), in parallel (`parallel::install`): for a long
    /// sequence this pass reads `seq_q × seq_k` values and must stay small
    /// next to the attention it serves.
    pub fn new<V: Sync>(
        dims: [usize; 4],
        values: &[V],
        visible: impl Fn(&V) -> bool + Sync,
    ) -> Self {
        let strides = broadcast_strides(dims);
        let block_counts = [
            dims[2].div_ceil(MASK_BLOCK).max(1),
            dims[3].div_ceil(MASK_BLOCK).max(1),
        ];
        let mut blocks = vec![0u8; dims[0] * dims[1] * block_counts[0] * block_counts[1]];
        let (rows, row_len) = (dims[2], dims[3]);
        if row_len > 0 {
            // One line of the map per (plane, block of rows).
            crate::runtime::parallel::install(|| {
                blocks
                    .par_chunks_mut(block_counts[1])
                    .enumerate()
                    .for_each(|(line_index, line)| {
                        let (plane, block_row) =
                            (line_index / block_counts[0], line_index % block_counts[0]);
                        let first = block_row * MASK_BLOCK;
                        for row in first..(first + MASK_BLOCK).min(rows) {
                            let start = (plane * rows + row) * row_len;
                            let row_values = &values[start..start + row_len];
                            for (flag, chunk) in line.iter_mut().zip(row_values.chunks(MASK_BLOCK))
                            {
                                if *flag == 0 && chunk.iter().any(&visible) {
                                    *flag = 1;
                                }
                            }
                        }
                    })
            });
        }
        MaskLayout {
            dims,
            strides,
            blocks,
            block_counts,
        }
    }

    /// Offset of the first value of `(batch, head, row)`.
    pub fn row_offset(&self, batch: usize, head: usize, row: usize) -> usize {
        batch * self.strides[0] + head * self.strides[1] + row * self.strides[2]
    }

    /// Whether any score of `rows × keys` of `(batch, head)` survives the
    /// mask; `false` lets a kernel skip the tile.
    pub fn any_visible(
        &self,
        batch: usize,
        head: usize,
        rows: &Range<usize>,
        keys: &Range<usize>,
    ) -> bool {
        if rows.is_empty() || keys.is_empty() {
            return false;
        }
        let plane = (batch.min(self.dims[0] - 1) * self.dims[1] + head.min(self.dims[1] - 1))
            * self.block_counts[0]
            * self.block_counts[1];
        let block_range = |r: &Range<usize>, axis: usize| {
            if self.dims[axis] == 1 {
                0..1
            } else {
                r.start / MASK_BLOCK..(r.end - 1) / MASK_BLOCK + 1
            }
        };
        let (row_blocks, key_blocks) = (block_range(rows, 2), block_range(keys, 3));
        row_blocks.into_iter().any(|rb| {
            let line = &self.blocks[plane + rb * self.block_counts[1]..];
            key_blocks.clone().any(|kb| line[kb] != 0)
        })
    }
}

/// A mask as the GPU kernels use it: additive values (a boolean mask
/// becomes 0 / -inf) in its own shape, with its [`MaskLayout`].
#[derive(Debug, Clone)]
pub struct AdditiveMask<T> {
    pub values: Vec<T>,
    pub dims: [usize; 4],
    pub strides: [usize; 4],
    pub blocks: Vec<u8>,
    pub block_counts: [usize; 2],
}

impl<T: MaskScalar> AdditiveMask<T> {
    /// Converts the mask (in parallel, `parallel::install`) and maps
    /// its blocks.
    pub fn new(problem: &Problem, data: MaskData<'_>) -> Option<Self> {
        let spec = problem.mask?;
        let values: Vec<T> = crate::runtime::parallel::install(|| match data {
            MaskData::Bool(b) => b
                .par_iter()
                .map(|&keep| if keep { T::ZERO } else { T::NEG_INFINITY })
                .collect(),
            MaskData::Float(Slice::F16(x)) => {
                x.par_iter().map(|v| T::from_f64(v.to_f64())).collect()
            }
            MaskData::Float(Slice::BF16(x)) => {
                x.par_iter().map(|v| T::from_f64(v.to_f64())).collect()
            }
            MaskData::Float(Slice::F32(x)) => {
                x.par_iter().map(|&v| T::from_f64(v.into())).collect()
            }
            MaskData::Float(Slice::F64(x)) => x.par_iter().map(|&v| T::from_f64(v)).collect(),
        });
        let layout = MaskLayout::new(spec.dims, &values, |&v| v != T::NEG_INFINITY);
        Some(AdditiveMask {
            values,
            dims: layout.dims,
            strides: layout.strides,
            blocks: layout.blocks,
            block_counts: layout.block_counts,
        })
    }
}

/// ALiBi slopes expanded to one per flat `(batch, query head)` (for a packed
/// batch, per `(sequence, query head)`).
pub fn slopes_per_head(problem: &Problem, slopes: &[f64]) -> Vec<f64> {
    match problem.alibi_per_batch {
        Some(true) => slopes.to_vec(),
        _ => (0..slope_groups(problem))
            .flat_map(|_| slopes.iter().copied())
            .collect(),
    }
}

/// What per-batch slopes are per: the batch, or a packed batch's
/// sequences (flash-attn's `(batch, heads)` slopes of varlen calls), each
/// with `heads_q` slopes.
pub fn slope_groups(problem: &Problem) -> usize {
    problem.varlen.map_or(problem.batch, |v| v.sequences)
}

fn read_f64(s: &Slice<'_>, i: usize) -> f64 {
    match s {
        Slice::F16(x) => x[i].to_f64(),
        Slice::BF16(x) => x[i].to_f64(),
        Slice::F32(x) => x[i].into(),
        Slice::F64(x) => x[i],
    }
}

/// `dsink[h] = -Σ_(b,i) exp(sink[h] - lse[b,h,i]) · D[b,h,i]` with
/// `D = rowsum(do ∘ o)`, in float64 and in a fixed order: the sink's
/// probability times the gradient of the softmax normaliser (the sink adds
/// nothing to the output itself). A row whose lse is `-inf` (no key)
/// adds nothing; one whose lse or D is NaN or infinite makes the head's
/// gradient NaN (docs/design.md#non-finite-inputs).
pub fn sink_gradient(
    problem: &Problem,
    d_out: &Slice<'_>,
    out: &Slice<'_>,
    lse: &Slice<'_>,
    sinks: &[f64],
) -> Vec<f64> {
    let dv = problem.value_dim;
    // One head a task, each summing its rows in the order of the serial
    // loop (batch, then row): the same bits on any number of threads. The
    // rows' elements are widened a row at a time (one match on the dtype a
    // row, not one an element): at (4, 16, 4096, 64) the element-wise loop
    // on one thread took most of a 295 ms backward.
    crate::runtime::parallel::install(|| {
        (0..problem.heads_q)
            .into_par_iter()
            .map(|h| {
                let (mut a, mut b) = (vec![0.0; dv], vec![0.0; dv]);
                let mut g = 0.0;
                for batch in 0..problem.batch {
                    for i in 0..problem.seq_q {
                        let row = (batch * problem.heads_q + h) * problem.seq_q + i;
                        let row_lse = read_f64(lse, row);
                        if row_lse == f64::NEG_INFINITY {
                            continue;
                        }
                        widen(d_out, row * dv, &mut a);
                        widen(out, row * dv, &mut b);
                        let delta: f64 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
                        g -= match row_lse.is_finite() && delta.is_finite() {
                            true => (sinks[h] - row_lse).exp() * delta,
                            false => f64::NAN,
                        };
                    }
                }
                g
            })
            .collect()
    })
}

/// `into.len()` elements of `s` from `start`, as float64.
fn widen(s: &Slice<'_>, start: usize, into: &mut [f64]) {
    let range = start..start + into.len();
    match s {
        // half's slice conversions use the CPU's F16C instructions where
        // it has them; `to_f64` an element at a time did not (exact either
        // way).
        Slice::F16(x) => x[range].convert_to_f64_slice(into),
        Slice::BF16(x) => x[range].convert_to_f64_slice(into),
        Slice::F32(x) => into
            .iter_mut()
            .zip(&x[range])
            .for_each(|(o, &v)| *o = v.into()),
        Slice::F64(x) => into.copy_from_slice(&x[range]),
    }
}

/// Sums a full `(batch, heads_q, seq_q, seq_k)` score gradient over the
/// mask's broadcast dimensions, in a fixed order: the float mask's
/// gradient in the mask's own shape.
pub fn reduce_to_mask<T: Copy + std::ops::AddAssign + Default>(
    problem: &Problem,
    full: &[T],
) -> Vec<T> {
    let Some(spec) = problem.mask else {
        return Vec::new();
    };
    if spec.dims == [problem.batch, problem.heads_q, problem.seq_q, problem.seq_k] {
        return full.to_vec();
    }
    let strides = broadcast_strides(spec.dims);
    let mut reduced = vec![T::default(); spec.len()];
    let (seq_q, seq_k) = (problem.seq_q, problem.seq_k);
    for (plane, values) in full.chunks(seq_q * seq_k).enumerate() {
        let (b, h) = (plane / problem.heads_q, plane % problem.heads_q);
        for (i, row) in values.chunks(seq_k).enumerate() {
            let base = b * strides[0] + h * strides[1] + i * strides[2];
            for (j, &x) in row.iter().enumerate() {
                reduced[base + j * strides[3]] += x;
            }
        }
    }
    reduced
}

/// The dtype in which the mask's gradient is returned: the mask's own.
pub fn mask_gradient_dtype(problem: &Problem) -> Option<DType> {
    match problem.mask?.dtype {
        MaskDType::Float(d) => Some(d),
        MaskDType::Bool => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn philox_matches_the_random123_known_answers() {
        // kat_vectors of Random123 1.09, philox4x32 with 10 rounds.
        assert_eq!(
            philox4x32_10([0, 0, 0, 0], [0, 0]),
            [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8]
        );
        assert_eq!(
            philox4x32_10([u32::MAX; 4], [u32::MAX; 2]),
            [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd]
        );
        assert_eq!(
            philox4x32_10(
                [0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344],
                [0xa409_3822, 0x299f_31d0]
            ),
            [0xd16c_fe09, 0x94fd_cceb, 0x5001_e420, 0x2412_6ea1]
        );
    }

    #[test]
    fn dropout_keeps_about_one_minus_p_and_groups_agree_with_single_calls() {
        let mask = DropoutMask::new(Dropout {
            p: 0.3,
            seed: 12345,
        });
        let mut kept = 0usize;
        let mut seen = 0usize;
        for row in 0..64 {
            mask.for_each(3, row, 5..1029, |offset, keep| {
                assert_eq!(keep, mask.keeps(3, row, 5 + offset));
                kept += keep as usize;
                seen += 1;
            });
        }
        let fraction = kept as f64 / seen as f64;
        // 65536 Bernoulli(0.7) draws: sd = 0.0018; 5 sd either side.
        assert!((fraction - 0.7).abs() < 0.009, "{fraction}");
    }
}
