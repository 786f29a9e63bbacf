//! The small dense products of one tile step, written so that the inner
//! loop runs over contiguous memory and the compiler can vectorise it.
//!
//! Shapes are given in rows × columns; every matrix is row-major and
//! contiguous.

use super::element::Element;

/// `y += a * x`
#[inline(always)]
pub fn axpy<T: Element>(y: &mut [T], a: T, x: &[T]) {
    for (y, &x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

/// Copies the `rows × cols` matrix `src` into `dst` transposed
/// (`cols × rows`), so that a later product can stream over rows of `src`
/// with unit stride.
pub fn transpose_into<T: Element>(src: &[T], rows: usize, cols: usize, dst: &mut [T]) {
    if cols == 0 {
        return;
    }
    for (r, row) in src.chunks_exact(cols).take(rows).enumerate() {
        for (c, &x) in row.iter().enumerate() {
            dst[c * rows + r] = x;
        }
    }
}

/// `c += a · b` with `a` `m × k`, `b` `k × n`, `c` `m × n`.
pub fn matmul_acc<T: Element>(a: &[T], b: &[T], c: &mut [T], m: usize, k: usize, n: usize) {
    if k == 0 || n == 0 {
        return;
    }
    for (a_row, c_row) in a.chunks_exact(k).zip(c.chunks_exact_mut(n)).take(m) {
        for (&a_ik, b_row) in a_row.iter().zip(b.chunks_exact(n)) {
            axpy(c_row, a_ik, b_row);
        }
    }
}

/// `c += aᵀ · b` with `a` `m × k`, `b` `m × n`, `c` `k × n`.
pub fn matmul_t_acc<T: Element>(a: &[T], b: &[T], c: &mut [T], m: usize, k: usize, n: usize) {
    if k == 0 || n == 0 {
        return;
    }
    for (a_row, b_row) in a.chunks_exact(k).zip(b.chunks_exact(n)).take(m) {
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
        matmul_acc(&a, &b, &mut c, m, k, n);
        matmul_acc(&a, &b, &mut c, m, k, n);
        assert!(c
            .iter()
            .zip(&want)
            .all(|(x, y)| (x - 2.0 * y).abs() < 1e-12));

        let mut c = vec![0.0; m * n];
        matmul_acc(&a, &b, &mut c, m, k, n);
        assert!(c.iter().zip(&want).all(|(x, y)| (x - y).abs() < 1e-12));

        let mut a_t = vec![0.0; k * m];
        transpose_into(&a, m, k, &mut a_t);
        let mut c = vec![0.0; m * n];
        matmul_t_acc(&a_t, &b, &mut c, k, m, n);
        assert!(c.iter().zip(&want).all(|(x, y)| (x - y).abs() < 1e-12));
    }
}
