//! AVX2 + FMA tile kernels for float32, chosen at run time when the CPU has
//! them (every x86-64 CPU since Haswell / Zen 1). Other machines run the
//! portable kernels in `kernels.rs`, which compute the same function.
//!
//! The products of a tile step are all `C += A·B` with B row-major (its rows
//! contiguous along the output columns): A's elements are broadcast and B's
//! rows streamed, a register block of 4 rows × 16 columns of C held in eight
//! ymm registers across the whole depth loop, FLAME/BLIS style.

#![allow(unsafe_code)]

use std::arch::x86_64::*;
use std::sync::OnceLock;

/// Whether the running CPU has AVX2 and FMA (checked once).
pub fn available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"))
}

/// A strided view of the left operand: element (row `i`, depth `p`) is at
/// `data[i * row_stride + p * depth_stride]`, so that `A` and `Aᵀ` of a
/// row-major matrix are both expressible without copying.
#[derive(Clone, Copy)]
pub struct Lhs<'a> {
    pub data: &'a [f32],
    pub row_stride: usize,
    pub depth_stride: usize,
}

const MR: usize = 4;

/// `c[i*ldc + j] += Σ_p a(i, p) · b[p*ldb + j]` for `i < m`, `j < n`,
/// `p < k`.
///
/// # Panics
/// If a slice is too short for the shape (checked once, up front, so the
/// unchecked accesses inside are in bounds).
#[allow(clippy::too_many_arguments)]
pub fn gemm_acc(
    m: usize,
    n: usize,
    k: usize,
    a: Lhs<'_>,
    b: &[f32],
    ldb: usize,
    c: &mut [f32],
    ldc: usize,
) {
    if m == 0 || n == 0 || k == 0 {
        return;
    }
    let a_last = (m - 1) * a.row_stride + (k - 1) * a.depth_stride;
    assert!(a_last < a.data.len(), "lhs too short");
    assert!((k - 1) * ldb + n <= b.len(), "rhs too short");
    assert!((m - 1) * ldc + n <= c.len(), "output too short");
    assert!(available(), "AVX2/FMA kernel called on a CPU without them");
    // SAFETY: the CPU has AVX2 and FMA (asserted), and every access below
    // stays within the bounds asserted above.
    unsafe { gemm_acc_avx2(m, n, k, a, b.as_ptr(), ldb, c.as_mut_ptr(), ldc) }
}

#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_acc_avx2(
    m: usize,
    n: usize,
    k: usize,
    a: Lhs<'_>,
    b: *const f32,
    ldb: usize,
    c: *mut f32,
    ldc: usize,
) {
    let mut i = 0;
    while i + MR <= m {
        block_rows::<MR>(i, n, k, a, b, ldb, c, ldc);
        i += MR;
    }
    while i < m {
        block_rows::<1>(i, n, k, a, b, ldb, c, ldc);
        i += 1;
    }
}

/// Rows `i0 .. i0 + R` of C, all columns: 16-wide blocks, then an 8-wide
/// block, then scalar columns.
#[target_feature(enable = "avx2,fma")]
#[inline]
#[allow(clippy::too_many_arguments)]
unsafe fn block_rows<const R: usize>(
    i0: usize,
    n: usize,
    k: usize,
    a: Lhs<'_>,
    b: *const f32,
    ldb: usize,
    c: *mut f32,
    ldc: usize,
) {
    let a_ptr = a.data.as_ptr();
    let row = |r: usize| a_ptr.add((i0 + r) * a.row_stride);
    let mut j = 0;
    while j + 16 <= n {
        let mut acc = [[_mm256_setzero_ps(); 2]; R];
        for p in 0..k {
            let b_row = b.add(p * ldb + j);
            let b0 = _mm256_loadu_ps(b_row);
            let b1 = _mm256_loadu_ps(b_row.add(8));
            for (r, acc_r) in acc.iter_mut().enumerate() {
                let x = _mm256_broadcast_ss(&*row(r).add(p * a.depth_stride));
                acc_r[0] = _mm256_fmadd_ps(x, b0, acc_r[0]);
                acc_r[1] = _mm256_fmadd_ps(x, b1, acc_r[1]);
            }
        }
        for (r, acc_r) in acc.iter().enumerate() {
            let out = c.add((i0 + r) * ldc + j);
            _mm256_storeu_ps(out, _mm256_add_ps(_mm256_loadu_ps(out), acc_r[0]));
            _mm256_storeu_ps(
                out.add(8),
                _mm256_add_ps(_mm256_loadu_ps(out.add(8)), acc_r[1]),
            );
        }
        j += 16;
    }
    if j + 8 <= n {
        let mut acc = [_mm256_setzero_ps(); R];
        for p in 0..k {
            let b0 = _mm256_loadu_ps(b.add(p * ldb + j));
            for (r, acc_r) in acc.iter_mut().enumerate() {
                let x = _mm256_broadcast_ss(&*row(r).add(p * a.depth_stride));
                *acc_r = _mm256_fmadd_ps(x, b0, *acc_r);
            }
        }
        for (r, acc_r) in acc.iter().enumerate() {
            let out = c.add((i0 + r) * ldc + j);
            _mm256_storeu_ps(out, _mm256_add_ps(_mm256_loadu_ps(out), *acc_r));
        }
        j += 8;
    }
    while j < n {
        for r in 0..R {
            let mut sum = 0.0f32;
            for p in 0..k {
                sum = (*row(r).add(p * a.depth_stride)).mul_add(*b.add(p * ldb + j), sum);
            }
            *c.add((i0 + r) * ldc + j) += sum;
        }
        j += 1;
    }
}

/// `exp(x)` for 8 lanes: range reduction `x = n·ln2 + r` with `ln2` split
/// in two so `r` stays exact, a degree-6 polynomial for `exp(r)` on
/// `|r| <= ln2/2` (Cephes' coefficients, ~1 ulp), and `2^n` built in the
/// exponent bits. Inputs below -87.3 (including -inf from masks) give
/// exactly 0, so masked scores contribute nothing.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn exp8(x: __m256) -> __m256 {
    let underflow = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(-87.3));
    let x = _mm256_min_ps(x, _mm256_set1_ps(88.3));
    let x = _mm256_max_ps(x, _mm256_set1_ps(-87.3));
    let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
        x,
        _mm256_set1_ps(std::f32::consts::LOG2_E),
    ));
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), x);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
    let mut p = _mm256_set1_ps(1.987_569_1e-4);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.398_199_9e-3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.333_452e-3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.166_579_6e-2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.666_666_5e-1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5));
    let r2 = _mm256_mul_ps(r, r);
    p = _mm256_fmadd_ps(p, r2, _mm256_add_ps(r, _mm256_set1_ps(1.0)));
    let pow2 = _mm256_slli_epi32::<23>(_mm256_add_epi32(
        _mm256_cvtps_epi32(n),
        _mm256_set1_epi32(127),
    ));
    let result = _mm256_mul_ps(p, _mm256_castsi256_ps(pow2));
    _mm256_andnot_ps(underflow, result)
}

#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps::<0b01>(s, s));
    _mm_cvtss_f32(s)
}

#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn hmax(v: __m256) -> f32 {
    let s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_max_ss(s, _mm_shuffle_ps::<0b01>(s, s));
    _mm_cvtss_f32(s)
}

/// The largest element (`-inf` for an empty or fully masked row).
pub fn row_max(x: &[f32]) -> f32 {
    assert!(available());
    // SAFETY: AVX2 is present (asserted); loads stay inside `x`.
    unsafe { row_max_avx2(x) }
}

#[target_feature(enable = "avx2,fma")]
unsafe fn row_max_avx2(x: &[f32]) -> f32 {
    let mut acc = _mm256_set1_ps(f32::NEG_INFINITY);
    let chunks = x.chunks_exact(8);
    let tail = chunks.remainder();
    for chunk in chunks {
        acc = _mm256_max_ps(acc, _mm256_loadu_ps(chunk.as_ptr()));
    }
    tail.iter().fold(hmax(acc), |m, &v| m.max(v))
}

/// `x[i] = exp(x[i] - shift)` (`shift` finite); returns the sum of the new
/// values.
pub fn exp_shifted_sum(x: &mut [f32], shift: f32) -> f32 {
    assert!(available());
    // SAFETY: AVX2/FMA are present (asserted); accesses stay inside `x`.
    unsafe { exp_shifted_sum_avx2(x, shift) }
}

#[target_feature(enable = "avx2,fma")]
unsafe fn exp_shifted_sum_avx2(x: &mut [f32], shift: f32) -> f32 {
    let shift_v = _mm256_set1_ps(shift);
    let mut sum = _mm256_setzero_ps();
    let mut chunks = x.chunks_exact_mut(8);
    for chunk in &mut chunks {
        let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(chunk.as_ptr()), shift_v));
        _mm256_storeu_ps(chunk.as_mut_ptr(), e);
        sum = _mm256_add_ps(sum, e);
    }
    let tail = chunks.into_remainder();
    if !tail.is_empty() {
        // The tail goes through the same lanes, padded with exp(-inf) = 0:
        // element i always lands in lane i % 8, so the sum of a row does not
        // depend on where its tile happens to end (a causal tile ends at the
        // last visible key of its last query row).
        let mut buf = [f32::NEG_INFINITY; 8];
        buf[..tail.len()].copy_from_slice(tail);
        let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(buf.as_ptr()), shift_v));
        _mm256_storeu_ps(buf.as_mut_ptr(), e);
        tail.copy_from_slice(&buf[..tail.len()]);
        sum = _mm256_add_ps(sum, e);
    }
    hsum(sum)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn filled(len: usize, seed: u32) -> Vec<f32> {
        let mut x = seed.wrapping_mul(2654435761).wrapping_add(1);
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                (x as f32 / u32::MAX as f32) - 0.5
            })
            .collect()
    }

    #[test]
    fn gemm_matches_naive_on_ragged_shapes() {
        if !available() {
            return;
        }
        for (m, n, k) in [(1, 1, 1), (5, 23, 7), (4, 16, 64), (9, 40, 3), (64, 64, 64)] {
            let a = filled(m * k, 1);
            let b = filled(k * n, 2);
            let c0 = filled(m * n, 3);
            let mut c = c0.clone();
            gemm_acc(
                m,
                n,
                k,
                Lhs {
                    data: &a,
                    row_stride: k,
                    depth_stride: 1,
                },
                &b,
                n,
                &mut c,
                n,
            );
            // Transposed view of the same data: rows of Aᵀ are columns of A.
            let mut a_t = vec![0.0; k * m];
            for i in 0..m {
                for p in 0..k {
                    a_t[p * m + i] = a[i * k + p];
                }
            }
            let mut c_t = c0.clone();
            gemm_acc(
                m,
                n,
                k,
                Lhs {
                    data: &a_t,
                    row_stride: 1,
                    depth_stride: m,
                },
                &b,
                n,
                &mut c_t,
                n,
            );
            for i in 0..m {
                for j in 0..n {
                    let want: f64 = c0[i * n + j] as f64
                        + (0..k)
                            .map(|p| a[i * k + p] as f64 * b[p * n + j] as f64)
                            .sum::<f64>();
                    assert!(
                        (c[i * n + j] as f64 - want).abs() < 1e-5,
                        "{m}x{n}x{k} at {i},{j}"
                    );
                    assert_eq!(c[i * n + j], c_t[i * n + j]);
                }
            }
        }
    }

    #[test]
    fn exp_is_accurate_and_masks_to_zero() {
        if !available() {
            return;
        }
        let mut x: Vec<f32> = (0..1001).map(|i| -90.0 + i as f32 * 0.09).collect();
        x.push(f32::NEG_INFINITY);
        let original = x.clone();
        let sum = exp_shifted_sum(&mut x, 0.0);
        for (&e, &v) in x.iter().zip(&original) {
            let want = (v as f64).exp();
            if v < -87.3 {
                assert_eq!(e, 0.0);
            } else {
                assert!(
                    ((e as f64) - want).abs() <= 4.0 * f32::EPSILON as f64 * want,
                    "exp({v})"
                );
            }
        }
        let want: f64 = original
            .iter()
            .filter(|&&v| v >= -87.3)
            .map(|&v| (v as f64).exp())
            .sum();
        assert!((sum as f64 - want).abs() < 1e-5 * want);
        assert_eq!(row_max(&original), original[1000]);
        assert_eq!(row_max(&[f32::NEG_INFINITY; 3]), f32::NEG_INFINITY);
    }
}
