//! Host side of the checks: random inputs, the float64 reference and the
//! error measure.

/// SplitMix64: a fixed seed gives the same inputs on every machine, so an
/// error reported on one adapter can be reproduced on another.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1): never zero-filled, so a kernel that skips a
    /// product or a tile cannot pass the check by accident.
    pub fn uniform(&mut self) -> f32 {
        let unit = (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
        2.0 * unit - 1.0
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// C = A B for row-major square matrices of side `n`, in float64.
pub fn gemm_f64(a: &[f64], b: &[f64], n: usize) -> Vec<f64> {
    let mut c = vec![0.0; n * n];
    for i in 0..n {
        let row = &mut c[i * n..(i + 1) * n];
        for k in 0..n {
            let aik = a[i * n + k];
            let b_row = &b[k * n..(k + 1) * n];
            for (cij, bkj) in row.iter_mut().zip(b_row) {
                *cij += aik * bkj;
            }
        }
    }
    c
}

/// One element of A B, accumulated in float64.
pub fn dot(a: &[f32], b: &[f32], n: usize, i: usize, j: usize) -> f64 {
    (0..n)
        .map(|k| a[i * n + k] as f64 * b[k * n + j] as f64)
        .sum()
}

/// ||got - want||_F / ||want||_F over the pairs given; infinite where any
/// value is not finite (a NaN-poisoned output the kernel never wrote).
pub fn relative_error(pairs: impl Iterator<Item = (f32, f64)>) -> f64 {
    let mut diff = 0.0;
    let mut norm = 0.0;
    for (got, want) in pairs {
        if !got.is_finite() {
            return f64::INFINITY;
        }
        diff += (got as f64 - want).powi(2);
        norm += want * want;
    }
    if norm == 0.0 {
        return if diff == 0.0 { 0.0 } else { f64::INFINITY };
    }
    (diff / norm).sqrt()
}

pub fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        values[n / 2]
    } else {
        0.5 * (values[n / 2 - 1] + values[n / 2])
    }
}

/// `s` as a JSON string literal.
pub fn json_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for ch in s.chars() {
        match ch {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// A finite number as JSON, anything else as null.
pub fn json_number(x: Option<f64>, decimals: usize) -> String {
    match x {
        Some(v) if v.is_finite() => format!("{v:.decimals$}"),
        _ => "null".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reference_gemm_matches_dots() {
        let n = 7;
        let mut rng = Rng::new(3);
        let a: Vec<f32> = (0..n * n).map(|_| rng.uniform()).collect();
        let b: Vec<f32> = (0..n * n).map(|_| rng.uniform()).collect();
        let wide = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<f64>>();
        let c = gemm_f64(&wide(&a), &wide(&b), n);
        for i in 0..n {
            for j in 0..n {
                assert!((c[i * n + j] - dot(&a, &b, n, i, j)).abs() < 1e-12);
            }
        }
    }

    #[test]
    fn uniform_stays_in_range_and_is_not_constant() {
        let mut rng = Rng::new(1);
        let xs: Vec<f32> = (0..1000).map(|_| rng.uniform()).collect();
        assert!(xs.iter().all(|x| (-1.0..1.0).contains(x)));
        assert!(xs.iter().any(|&x| x < -0.5) && xs.iter().any(|&x| x > 0.5));
    }

    #[test]
    fn error_flags_unwritten_outputs() {
        assert_eq!(relative_error([(f32::NAN, 1.0)].into_iter()), f64::INFINITY);
        assert_eq!(relative_error([(2.0, 2.0)].into_iter()), 0.0);
        let e = relative_error([(1.1, 1.0), (0.0, 0.0)].into_iter());
        assert!((e - 0.1).abs() < 1e-6);
    }

    #[test]
    fn json_escapes() {
        assert_eq!(json_string("a\"b\\c\n"), "\"a\\\"b\\\\c\\n\"");
        assert_eq!(json_number(Some(1.23456), 2), "1.23");
        assert_eq!(json_number(None, 2), "null");
        assert_eq!(json_number(Some(f64::NAN), 2), "null");
    }
}
