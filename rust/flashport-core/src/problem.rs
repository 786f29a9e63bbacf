//! The attention problem and its validation: the one place where shapes,
//! dtypes and options are checked, for every backend and for both the
//! forward and the backward pass.

use crate::error::{shape_str, Error, Result};

/// The element type a call computes in.
///
/// float16 inputs are computed with float32 accumulation and rounded back
/// to float16 on output.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    F16,
    F32,
    F64,
}

impl DType {
    /// Parses a NumPy dtype name (`numpy.dtype(x).name`).
    pub fn from_numpy_name(name: &str) -> Option<DType> {
        match name {
            "float16" => Some(DType::F16),
            "float32" => Some(DType::F32),
            "float64" => Some(DType::F64),
            _ => None,
        }
    }

    pub fn numpy_name(self) -> &'static str {
        match self {
            DType::F16 => "float16",
            DType::F32 => "float32",
            DType::F64 => "float64",
        }
    }

    /// The dtype of the log-sum-exp output: float64 for float64 inputs so
    /// that a float64 backward keeps full precision, float32 otherwise.
    pub fn lse_dtype(self) -> DType {
        match self {
            DType::F64 => DType::F64,
            DType::F16 | DType::F32 => DType::F32,
        }
    }
}

/// What validation needs to know about one array argument.
#[derive(Debug, Clone, Copy)]
pub struct ArrayInfo<'a> {
    pub shape: &'a [usize],
    /// The NumPy dtype name, e.g. `"float32"` or `"int64"`.
    pub dtype: &'a str,
}

impl<'a> ArrayInfo<'a> {
    pub fn new(shape: &'a [usize], dtype: &'a str) -> Self {
        ArrayInfo { shape, dtype }
    }
}

/// Keyword options shared by the forward and the backward pass.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Options {
    /// Bottom-right aligned causal mask: query `i` sees keys
    /// `j <= i + seq_k - seq_q`.
    pub causal: bool,
    /// Multiplier of `q·kᵀ`; `None` means `1/sqrt(d)`.
    pub scale: Option<f64>,
}

/// A validated attention problem in canonical `(batch, heads, seq, dim)`
/// form. Arrays of 2 or 3 dimensions are viewed with leading sizes of 1.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Problem {
    pub batch: usize,
    pub heads_q: usize,
    pub heads_kv: usize,
    pub seq_q: usize,
    pub seq_k: usize,
    /// Head dimension of q and k.
    pub head_dim: usize,
    /// Head dimension of v and of the output.
    pub value_dim: usize,
    pub scale: f64,
    pub causal: bool,
    pub dtype: DType,
    /// The number of dimensions the caller's arrays have (2, 3 or 4); the
    /// outputs keep it.
    pub ndim: usize,
}

impl Problem {
    /// Query heads that share one key/value head (GQA / MQA group size).
    pub fn group_size(&self) -> usize {
        self.heads_q / self.heads_kv
    }

    /// Bottom-right causal alignment: query `i` sees keys `j <= i + offset`.
    pub fn causal_offset(&self) -> isize {
        self.seq_k as isize - self.seq_q as isize
    }

    /// The keys query row `i` may attend to, as the half-open range
    /// `0..end`. Score modifications that cut a window out of the row
    /// (sliding windows, masks) extend this.
    pub fn visible_key_end(&self, query_row: usize) -> usize {
        if !self.causal {
            return self.seq_k;
        }
        let end = query_row as isize + self.causal_offset() + 1;
        end.clamp(0, self.seq_k as isize) as usize
    }

    pub fn q_len(&self) -> usize {
        self.batch * self.heads_q * self.seq_q * self.head_dim
    }
    pub fn k_len(&self) -> usize {
        self.batch * self.heads_kv * self.seq_k * self.head_dim
    }
    pub fn v_len(&self) -> usize {
        self.batch * self.heads_kv * self.seq_k * self.value_dim
    }
    pub fn out_len(&self) -> usize {
        self.batch * self.heads_q * self.seq_q * self.value_dim
    }
    pub fn lse_len(&self) -> usize {
        self.batch * self.heads_q * self.seq_q
    }

    fn leading(&self, heads: usize, seq: usize) -> Vec<usize> {
        match self.ndim {
            2 => vec![seq],
            3 => vec![heads, seq],
            _ => vec![self.batch, heads, seq],
        }
    }
    /// Shape of the attention output, in the caller's number of dimensions.
    pub fn out_shape(&self) -> Vec<usize> {
        let mut s = self.leading(self.heads_q, self.seq_q);
        s.push(self.value_dim);
        s
    }
    pub fn lse_shape(&self) -> Vec<usize> {
        self.leading(self.heads_q, self.seq_q)
    }
    pub fn q_shape(&self) -> Vec<usize> {
        let mut s = self.leading(self.heads_q, self.seq_q);
        s.push(self.head_dim);
        s
    }
    pub fn k_shape(&self) -> Vec<usize> {
        let mut s = self.leading(self.heads_kv, self.seq_k);
        s.push(self.head_dim);
        s
    }
    pub fn v_shape(&self) -> Vec<usize> {
        let mut s = self.leading(self.heads_kv, self.seq_k);
        s.push(self.value_dim);
        s
    }

    /// Floating-point operations of the forward pass by the FlashAttention
    /// papers' convention (causal halves it; the backward is 2.5×).
    pub fn forward_flops(&self) -> f64 {
        let full = 2.0
            * (self.batch * self.heads_q) as f64
            * self.seq_q as f64
            * self.seq_k as f64
            * (self.head_dim + self.value_dim) as f64;
        if self.causal {
            full / 2.0
        } else {
            full
        }
    }
}

fn dtype_of(argument: &str, info: &ArrayInfo<'_>) -> Result<DType> {
    DType::from_numpy_name(info.dtype).ok_or_else(|| Error::DType {
        argument: argument.to_string(),
        dtype: info.dtype.to_string(),
        reason: "flashport computes in float16, float32 or float64".to_string(),
    })
}

fn check_ndim(argument: &str, info: &ArrayInfo<'_>) -> Result<()> {
    if !(2..=4).contains(&info.shape.len()) {
        return Err(Error::Shape(format!(
            "{argument} has shape {} ({} dimensions); expected (batch, heads, seq, dim), \
             (heads, seq, dim) or (seq, dim)",
            shape_str(info.shape),
            info.shape.len()
        )));
    }
    Ok(())
}

/// Splits a 2-, 3- or 4-dimensional shape into (batch, heads, seq, dim).
fn canonical(shape: &[usize]) -> [usize; 4] {
    match *shape {
        [s, d] => [1, 1, s, d],
        [h, s, d] => [1, h, s, d],
        [b, h, s, d] => [b, h, s, d],
        _ => unreachable!("check_ndim runs first"),
    }
}

/// Validates the arguments of the forward pass.
pub fn validate_forward(
    q: ArrayInfo<'_>,
    k: ArrayInfo<'_>,
    v: ArrayInfo<'_>,
    options: &Options,
) -> Result<Problem> {
    for (name, info) in [("q", &q), ("k", &k), ("v", &v)] {
        check_ndim(name, info)?;
    }
    let dtype = dtype_of("q", &q)?;
    for (name, info) in [("k", &k), ("v", &v)] {
        let other = dtype_of(name, info)?;
        if other != dtype {
            return Err(Error::DType {
                argument: name.to_string(),
                dtype: info.dtype.to_string(),
                reason: format!("q has dtype {}; q, k and v must share one dtype", q.dtype),
            });
        }
    }
    if k.shape.len() != q.shape.len() || v.shape.len() != q.shape.len() {
        return Err(Error::Shape(format!(
            "q, k and v must have the same number of dimensions; got q {}, k {}, v {}",
            shape_str(q.shape),
            shape_str(k.shape),
            shape_str(v.shape)
        )));
    }
    let [qb, qh, seq_q, d] = canonical(q.shape);
    let [kb, kh, seq_k, kd] = canonical(k.shape);
    let [vb, vh, vs, dv] = canonical(v.shape);
    let shapes = || {
        format!(
            "q {}, k {}, v {}",
            shape_str(q.shape),
            shape_str(k.shape),
            shape_str(v.shape)
        )
    };
    if kb != qb || vb != qb {
        return Err(Error::Shape(format!(
            "batch sizes differ (q: {qb}, k: {kb}, v: {vb}); got {}",
            shapes()
        )));
    }
    if kh != vh {
        return Err(Error::Shape(format!(
            "k and v must have the same number of heads (k: {kh}, v: {vh}); got {}",
            shapes()
        )));
    }
    if qh == 0 || kh == 0 {
        return Err(Error::Shape(format!(
            "the number of heads must be at least 1 (q: {qh}, k/v: {kh}); got {}",
            shapes()
        )));
    }
    if qh % kh != 0 {
        return Err(Error::Shape(format!(
            "number of heads in k/v ({kh}) must divide number of heads in q ({qh}); got {}",
            shapes()
        )));
    }
    if vs != seq_k {
        return Err(Error::Shape(format!(
            "k and v must have the same sequence length (k: {seq_k}, v: {vs}); got {}",
            shapes()
        )));
    }
    if kd != d {
        return Err(Error::Shape(format!(
            "q and k must have the same head dimension d (q: {d}, k: {kd}); got {}",
            shapes()
        )));
    }
    if d == 0 {
        return Err(Error::Shape(format!(
            "the head dimension d must be at least 1; got {}",
            shapes()
        )));
    }
    let scale = match options.scale {
        None => 1.0 / (d as f64).sqrt(),
        Some(s) if s.is_finite() => s,
        Some(s) => {
            return Err(Error::Value {
                argument: "scale".to_string(),
                value: s.to_string(),
                reason: "scale must be a finite number".to_string(),
            })
        }
    };
    Ok(Problem {
        batch: qb,
        heads_q: qh,
        heads_kv: kh,
        seq_q,
        seq_k,
        head_dim: d,
        value_dim: dv,
        scale,
        causal: options.causal,
        dtype,
        ndim: q.shape.len(),
    })
}

/// Validates the arguments of the backward pass: q, k, v as in the forward,
/// then `d_out` and `out` against the output shape and `lse` against the
/// log-sum-exp shape.
pub fn validate_backward(
    d_out: ArrayInfo<'_>,
    q: ArrayInfo<'_>,
    k: ArrayInfo<'_>,
    v: ArrayInfo<'_>,
    out: ArrayInfo<'_>,
    lse: ArrayInfo<'_>,
    options: &Options,
) -> Result<Problem> {
    let problem = validate_forward(q, k, v, options)?;
    let out_shape = problem.out_shape();
    for (name, info) in [("do", &d_out), ("o", &out)] {
        if info.shape != out_shape.as_slice() {
            return Err(Error::Shape(format!(
                "{name} has shape {} but the attention output for q {} and v {} has shape {}",
                shape_str(info.shape),
                shape_str(q.shape),
                shape_str(v.shape),
                shape_str(&out_shape)
            )));
        }
        if dtype_of(name, info)? != problem.dtype {
            return Err(Error::DType {
                argument: name.to_string(),
                dtype: info.dtype.to_string(),
                reason: format!(
                    "q has dtype {}; do, q, k, v and o must share one dtype",
                    q.dtype
                ),
            });
        }
    }
    let lse_shape = problem.lse_shape();
    if lse.shape != lse_shape.as_slice() {
        return Err(Error::Shape(format!(
            "lse has shape {} but for q {} it must have shape {}",
            shape_str(lse.shape),
            shape_str(q.shape),
            shape_str(&lse_shape)
        )));
    }
    match dtype_of("lse", &lse)? {
        DType::F32 | DType::F64 => {}
        DType::F16 => {
            return Err(Error::DType {
                argument: "lse".to_string(),
                dtype: lse.dtype.to_string(),
                reason: "lse must be float32 or float64 (as returned by attention)".to_string(),
            })
        }
    }
    Ok(problem)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fwd(q: &[usize], k: &[usize], v: &[usize]) -> Result<Problem> {
        validate_forward(
            ArrayInfo::new(q, "float32"),
            ArrayInfo::new(k, "float32"),
            ArrayInfo::new(v, "float32"),
            &Options::default(),
        )
    }

    #[test]
    fn accepts_gqa_and_distinct_value_dim() {
        let p = fwd(&[2, 8, 5, 16], &[2, 2, 7, 16], &[2, 2, 7, 24]).unwrap();
        assert_eq!(
            (p.group_size(), p.seq_q, p.seq_k, p.value_dim),
            (4, 5, 7, 24)
        );
        assert_eq!(p.out_shape(), vec![2, 8, 5, 24]);
        assert!((p.scale - 0.25).abs() < 1e-15);
    }

    #[test]
    fn unbatched_shapes_keep_their_ndim() {
        let p = fwd(&[5, 16], &[7, 16], &[7, 3]).unwrap();
        assert_eq!((p.batch, p.heads_q), (1, 1));
        assert_eq!(p.out_shape(), vec![5, 3]);
        assert_eq!(p.lse_shape(), vec![5]);
    }

    #[test]
    fn rejects_indivisible_heads_naming_both_counts() {
        let err = fwd(&[1, 6, 5, 16], &[1, 4, 5, 16], &[1, 4, 5, 16]).unwrap_err();
        match err {
            Error::Shape(msg) => assert!(msg.contains("(4)") && msg.contains("(6)"), "{msg}"),
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn rejects_mixed_and_unsupported_dtypes() {
        let q = [1, 1, 4, 8];
        let e = validate_forward(
            ArrayInfo::new(&q, "float32"),
            ArrayInfo::new(&q, "float64"),
            ArrayInfo::new(&q, "float32"),
            &Options::default(),
        )
        .unwrap_err();
        assert!(matches!(e, Error::DType { ref argument, .. } if argument == "k"));
        let e = validate_forward(
            ArrayInfo::new(&q, "int64"),
            ArrayInfo::new(&q, "int64"),
            ArrayInfo::new(&q, "int64"),
            &Options::default(),
        )
        .unwrap_err();
        assert!(e.to_string().contains("int64"));
    }

    #[test]
    fn rejects_non_finite_scale() {
        let q = [4, 8];
        let e = validate_forward(
            ArrayInfo::new(&q, "float32"),
            ArrayInfo::new(&q, "float32"),
            ArrayInfo::new(&q, "float32"),
            &Options {
                causal: false,
                scale: Some(f64::NAN),
            },
        )
        .unwrap_err();
        assert!(matches!(e, Error::Value { .. }));
    }

    #[test]
    fn causal_alignment_is_bottom_right() {
        let p = Problem {
            causal: true,
            ..fwd(&[3, 4], &[5, 4], &[5, 4]).unwrap()
        };
        // seq_q = 3, seq_k = 5: the last query sees every key.
        assert_eq!(
            (0..3).map(|i| p.visible_key_end(i)).collect::<Vec<_>>(),
            vec![3, 4, 5]
        );
        let p = Problem {
            causal: true,
            ..fwd(&[5, 4], &[2, 4], &[2, 4]).unwrap()
        };
        // seq_q > seq_k: the first rows see nothing.
        assert_eq!(
            (0..5).map(|i| p.visible_key_end(i)).collect::<Vec<_>>(),
            vec![0, 0, 0, 1, 2]
        );
    }
}
