//! The small dense products of one tile step, written so that the inner
//! loop runs over contiguous memory and the compiler can vectorise it.
//!
//! Shapes are given in rows × columns; every matrix is row-major and
//! contiguous.

use super::real::Real;

/// `y += a * x`
#[inline(always)]
pub fn axpy<T: Real>(y: &mut [T], a: T, x: &[T]) {
    for (y, &x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

/// Number of independent partial sums of a dot product. Splitting the sum
/// keeps its rounding error close to that of a BLAS dot kernel (sequential
/// accumulation over a head dimension of 256 loses several bits in
/// float32, and a peaked softmax turns score errors into output errors), and
/// the lanes map onto SIMD registers.
const DOT_LANES: usize = 8;

/// `a · b` over `DOT_LANES` partial sums, added pairwise at the end: the
/// same order on every call, so the result is reproducible.
#[inline(always)]
pub fn dot<T: Real>(a: &[T], b: &[T]) -> T {
    let mut lanes = [T::ZERO; DOT_LANES];
    let (a_chunks, b_chunks) = (a.chunks_exact(DOT_LANES), b.chunks_exact(DOT_LANES));
    let (a_tail, b_tail) = (a_chunks.remainder(), b_chunks.remainder());
    for (x, y) in a_chunks.zip(b_chunks) {
        for l in 0..DOT_LANES {
            lanes[l] += x[l] * y[l];
        }
    }
    for (l, (&x, &y)) in a_tail.iter().zip(b_tail).enumerate() {
        lanes[l] += x * y;
    }
    let mut width = DOT_LANES;
    while width > 1 {
        width /= 2;
        for l in 0..width {
            lanes[l] += lanes[l + width];
        }
    }
    lanes[0]
}

/// `c = a · bᵀ` with `a` `m × k`, `b` `n × k`, `c` `m × n` (rows `ldc`
/// apart): every element a [`dot`] of two contiguous rows.
#[allow(clippy::too_many_arguments)]
pub fn matmul_nt<T: Real>(a: &[T], b: &[T], c: &mut [T], ldc: usize, m: usize, k: usize, n: usize) {
    if n == 0 {
        return;
    }
    for i in 0..m {
        let c_row = &mut c[i * ldc..i * ldc + n];
        if k == 0 {
            c_row.fill(T::ZERO);
            continue;
        }
        let a_row = &a[i * k..(i + 1) * k];
        for (c, b_row) in c_row.iter_mut().zip(b.chunks_exact(k)) {
            *c = dot(a_row, b_row);
        }
    }
}

/// Copies the `rows × cols` matrix `src` into `dst` transposed
/// (`cols × rows`), so that a later product can stream over rows of `src`
/// with unit stride.
#[cfg(test)]
pub fn transpose_into<T: Real>(src: &[T], rows: usize, cols: usize, dst: &mut [T]) {
    if cols == 0 {
        return;
    }
    for (r, row) in src.chunks_exact(cols).take(rows).enumerate() {
        for (c, &x) in row.iter().enumerate() {
            dst[c * rows + r] = x;
        }
    }
}

/// Whether every element is finite (neither NaN nor an infinity): an OR
/// over the whole slice, without an early exit, so that it vectorises; the
/// checks of docs/design.md#non-finite-inputs pass over every task's
/// outputs with it.
pub fn all_finite<T: Real>(x: &[T]) -> bool {
    !x.iter().fold(false, |bad, v| bad | !v.is_finite())
}

/// The largest element; `-inf` for an empty row.
pub fn row_max<T: Real>(x: &[T]) -> T {
    x.iter().fold(T::NEG_INFINITY, |a, &b| a.max(b))
}

/// `x = exp(x - shift)` elementwise; returns the sum.
pub fn exp_shifted_sum<T: Real>(x: &mut [T], shift: T) -> T {
    let mut sum = T::ZERO;
    for v in x.iter_mut() {
        *v = (*v - shift).exp();
        sum += *v;
    }
    sum
}

/// `c += a · b` with `a` `m × k` (rows `lda` apart), `b` `k × n`, `c`
/// `m × n`.
#[allow(clippy::too_many_arguments)]
pub fn matmul_acc<T: Real>(
    a: &[T],
    lda: usize,
    b: &[T],
    c: &mut [T],
    m: usize,
    k: usize,
    n: usize,
) {
    if k == 0 || n == 0 {
        return;
    }
    for (i, c_row) in c.chunks_exact_mut(n).take(m).enumerate() {
        let a_row = &a[i * lda..i * lda + k];
        for (&a_ik, b_row) in a_row.iter().zip(b.chunks_exact(n)) {
            axpy(c_row, a_ik, b_row);
        }
    }
}

/// `c += aᵀ · b` with `a` `m × k` (rows `lda` apart), `b` `m × n`, `c`
/// `k × n`.
#[allow(clippy::too_many_arguments)]
pub fn matmul_t_acc<T: Real>(
    a: &[T],
    lda: usize,
    b: &[T],
    c: &mut [T],
    m: usize,
    k: usize,
    n: usize,
) {
    if k == 0 || n == 0 {
        return;
    }
    for (i, b_row) in b.chunks_exact(n).take(m).enumerate() {
        let a_row = &a[i * lda..i * lda + k];
        for (&a_ik, c_row) in a_row.iter().zip(c.chunks_exact_mut(n)) {
            axpy(c_row, a_ik, b_row);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(a: &[f64], b: &[f64], m: usize, k: usize, n: usize) -> Vec<f64> {
        let mut c = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                c[i * n + j] = (0..k).map(|p| a[i * k + p] * b[p * n + j]).sum();
            }
        }
        c
    }

    fn filled(len: usize, seed: u64) -> Vec<f64> {
        let mut x = seed;
        (0..len)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (x >> 11) as f64 / (1u64 << 53) as f64 - 0.5
            })
            .collect()
    }

    #[test]
    fn products_match_naive() {
        let (m, k, n) = (5, 7, 3);
        let a = filled(m * k, 1);
        let b = filled(k * n, 2);
        let want = naive(&a, &b, m, k, n);

        let mut c = vec![0.0; m * n];
        matmul_acc(&a, k, &b, &mut c, m, k, n);
        matmul_acc(&a, k, &b, &mut c, m, k, n);
        assert!(c
            .iter()
            .zip(&want)
            .all(|(x, y)| (x - 2.0 * y).abs() < 1e-12));

        let mut c = vec![0.0; m * n];
        matmul_acc(&a, k, &b, &mut c, m, k, n);
        assert!(c.iter().zip(&want).all(|(x, y)| (x - y).abs() < 1e-12));

        let mut b_t = vec![0.0; n * k];
        transpose_into(&b, k, n, &mut b_t);
        let mut c = vec![5.0; m * n];
        matmul_nt(&a, &b_t, &mut c, n, m, k, n);
        assert!(c.iter().zip(&want).all(|(x, y)| (x - y).abs() < 1e-12));

        let mut a_t = vec![0.0; k * m];
        transpose_into(&a, m, k, &mut a_t);
        let mut c = vec![0.0; m * n];
        matmul_t_acc(&a_t, m, &b, &mut c, k, m, n);
        assert!(c.iter().zip(&want).all(|(x, y)| (x - y).abs() < 1e-12));
    }

    /// Rows further apart than their length (padding marked with NaN, which
    /// would spread into any result that read it) give the same bits.
    #[test]
    fn strided_products_match_contiguous() {
        let (m, k, n, pad) = (5, 7, 3, 4);
        let (a, b) = (filled(m * k, 3), filled(k * n, 4));
        let strided = |x: &[f64], rows: usize, cols: usize| {
            let mut out = vec![f64::NAN; rows * (cols + pad)];
            for (r, row) in x.chunks_exact(cols).enumerate() {
                out[r * (cols + pad)..r * (cols + pad) + cols].copy_from_slice(row);
            }
            out
        };
        let a_wide = strided(&a, m, k);

        let (mut c, mut c_wide) = (vec![0.5; m * n], vec![0.5; m * n]);
        matmul_acc(&a, k, &b, &mut c, m, k, n);
        matmul_acc(&a_wide, k + pad, &b, &mut c_wide, m, k, n);
        assert_eq!(c, c_wide);

        let b_rows = filled(m * n, 5);
        let (mut c, mut c_wide) = (vec![0.5; k * n], vec![0.5; k * n]);
        matmul_t_acc(&a, k, &b_rows, &mut c, m, k, n);
        matmul_t_acc(&a_wide, k + pad, &b_rows, &mut c_wide, m, k, n);
        assert_eq!(c, c_wide);

        let b_t = filled(n * k, 6);
        let mut c = vec![0.0; m * n];
        let mut c_wide = strided(&vec![0.0; m * n], m, n);
        matmul_nt(&a, &b_t, &mut c, n, m, k, n);
        matmul_nt(&a, &b_t, &mut c_wide, n + pad, m, k, n);
        for (row, wide) in c.chunks_exact(n).zip(c_wide.chunks_exact(n + pad)) {
            assert_eq!(row, &wide[..n]);
            assert!(wide[n..].iter().all(|x| x.is_nan()), "padding written");
        }
    }
}
