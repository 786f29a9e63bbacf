//! The attention problem and its validation: the one place where shapes,
//! dtypes and options are checked, for every backend and for both the
//! forward and the backward pass.

use crate::error::{shape_str, Error, Result};

/// The element type a call computes in.
///
/// float16 and bfloat16 inputs are computed with float32 accumulation and
/// rounded back to their dtype on output.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    F16,
    /// bfloat16 as `ml_dtypes` holds it in NumPy (NumPy has none of its own).
    BF16,
    F32,
    F64,
}

impl DType {
    /// Parses a NumPy dtype name (`numpy.dtype(x).name`).
    pub fn from_numpy_name(name: &str) -> Option<DType> {
        match name {
            "float16" => Some(DType::F16),
            "bfloat16" => Some(DType::BF16),
            "float32" => Some(DType::F32),
            "float64" => Some(DType::F64),
            _ => None,
        }
    }

    pub fn numpy_name(self) -> &'static str {
        match self {
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::F32 => "float32",
            DType::F64 => "float64",
        }
    }

    /// The dtype of the log-sum-exp output: float64 for float64 inputs so
    /// that a float64 backward keeps full precision, float32 otherwise.
    pub fn lse_dtype(self) -> DType {
        match self {
            DType::F64 => DType::F64,
            DType::F16 | DType::BF16 | DType::F32 => DType::F32,
        }
    }

    /// Whether the dtype is stored narrower than it computes: float16 and
    /// bfloat16 compute in float32 and are rounded back on output.
    pub fn is_half(self) -> bool {
        matches!(self, DType::F16 | DType::BF16)
    }
}

/// What validation needs to know about one array argument.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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

/// The options of `attention` and `attention_backward` (and of
/// `attention_varlen`, which refuses a mask and positions), as the caller
/// gave them (validation turns them into a [`Problem`]).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Options<'a> {
    pub variants: VariantOptions<'a>,
    /// Backward only: also return the gradient of a float mask.
    pub return_dmask: bool,
}

/// Attention's options with only the variants given.
impl<'a> From<VariantOptions<'a>> for Options<'a> {
    fn from(variants: VariantOptions<'a>) -> Self {
        Options {
            variants,
            return_dmask: false,
        }
    }
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
    /// Sliding window; both sides `None` without one.
    pub window: Window,
    pub softcap: Option<f64>,
    pub dropout: Option<Dropout>,
    pub mask: Option<MaskSpec>,
    /// ALiBi: `Some(true)` for per-(batch, head) slopes, `Some(false)` for
    /// per-head slopes.
    pub alibi_per_batch: Option<bool>,
    /// Whether a sink logit per query head joins the softmax denominator.
    pub sinks: bool,
    /// Backward only: the gradient of the (float) mask is wanted.
    pub return_dmask: bool,
    /// A packed batch of variable-length sequences (`attention_varlen`):
    /// see [`Varlen`]. `None` for every other problem.
    pub varlen: Option<Varlen>,
    /// Global positions of query row 0 and of key 0: causal, the window
    /// and ALiBi compare `q_offset + i` with `k_offset + j`. Both lie in
    /// `[-POSITION_LIMIT, POSITION_LIMIT]`. A mask array and dropout keep
    /// indexing by the local row and key.
    pub q_offset: i64,
    pub k_offset: i64,
}

/// The largest magnitude of `q_offset` and `k_offset`: positions and their
/// differences then stay exact in 64-bit integers for any sequence length
/// an array can have.
pub const POSITION_LIMIT: i64 = 1 << 62;

/// A problem's checked sizes, before its options.
#[derive(Debug, Clone, Copy)]
struct Sizes {
    batch: usize,
    heads_q: usize,
    heads_kv: usize,
    seq_q: usize,
    seq_k: usize,
    head_dim: usize,
    value_dim: usize,
    dtype: DType,
    ndim: usize,
}

impl Sizes {
    /// The problem of these sizes with `scale`, `causal` and the
    /// positions, and every other variant off: where each operation's
    /// validation starts before [`validate_variants`] records the variants
    /// asked for. The one literal of a `Problem`, so that a new variant's
    /// field is off in one place.
    fn problem(self, scale: f64, causal: bool, q_offset: i64, k_offset: i64) -> Problem {
        Problem {
            batch: self.batch,
            heads_q: self.heads_q,
            heads_kv: self.heads_kv,
            seq_q: self.seq_q,
            seq_k: self.seq_k,
            head_dim: self.head_dim,
            value_dim: self.value_dim,
            scale,
            causal,
            dtype: self.dtype,
            ndim: self.ndim,
            window: Window::default(),
            softcap: None,
            dropout: None,
            mask: None,
            alibi_per_batch: None,
            sinks: false,
            return_dmask: false,
            varlen: None,
            q_offset,
            k_offset,
        }
    }
}

impl Problem {
    /// Query heads that share one key/value head (GQA / MQA group size).
    pub fn group_size(&self) -> usize {
        self.heads_q / self.heads_kv
    }

    /// `q_offset - k_offset`: query row `i` is at the position of key
    /// `i + causal_offset()` (its diagonal), so causal attention shows it
    /// keys `j <= i + causal_offset()`. `seq_k - seq_q` by default
    /// (bottom-right alignment). Exact: the difference of two offsets
    /// within [`POSITION_LIMIT`] need not fit 64 bits.
    pub fn causal_offset(&self) -> i128 {
        i128::from(self.q_offset) - i128::from(self.k_offset)
    }

    /// The keys query row `i` may attend to by the causal mask and the
    /// sliding window, as a half-open range (empty when it sees none). Both
    /// ends are non-decreasing in the row. A mask array may hide more. The
    /// rows of a packed batch (`varlen`) see their sequence's keys instead:
    /// [`Segments::visible_keys`].
    pub fn visible_keys(&self, query_row: usize) -> std::ops::Range<usize> {
        // In i128, every sum below is exact.
        let diagonal = query_row as i128 + self.causal_offset();
        let seq_k = self.seq_k as i128;
        let mut end = seq_k;
        if self.causal {
            end = end.min(diagonal + 1);
        }
        if let Some(right) = self.window.right {
            end = end.min(diagonal + right as i128 + 1);
        }
        let start = match self.window.left {
            Some(left) => (diagonal - left as i128).max(0),
            None => 0,
        };
        let end = end.clamp(0, seq_k);
        start.min(end) as usize..end as usize
    }

    /// The (query, key) pairs that causal and the window leave visible, in
    /// time independent of the sequence lengths (they may be huge for an
    /// empty or broadcast array). A row's count, `visible_keys(i).len()`,
    /// is linear in `i` between the rows where one of its clamps engages
    /// (the ends reaching 0 or `seq_k`, the start passing the end), so it
    /// is summed as arithmetic series between those rows.
    pub fn window_pairs(&self) -> f64 {
        let c = self.causal_offset();
        let (seq_q, seq_k) = (self.seq_q as i128, self.seq_k as i128);
        let left = self.window.left.map(|l| l as i128);
        let right = self.window.right.map(|r| r as i128);
        let mut cuts = vec![0, seq_q];
        let mut near = |row: i128| cuts.extend([row - 1, row, row + 1]);
        if let Some(left) = left {
            near(left - c);
            near(seq_k + left - c);
        }
        for reach in [self.causal.then_some(0), right].into_iter().flatten() {
            near(-c - reach - 1);
            near(seq_k - c - reach - 1);
        }
        cuts.retain(|&row| (0..=seq_q).contains(&row));
        cuts.sort_unstable();
        cuts.dedup();
        let count = |row: i128| self.visible_keys(row as usize).len() as f64;
        cuts.windows(2)
            .map(|w| {
                let (first, last) = (w[0], w[1] - 1);
                (count(first) + count(last)) * (last - first + 1) as f64 / 2.0
            })
            .sum()
    }

    /// Whether causal or the window hide any score.
    pub fn has_range_mask(&self) -> bool {
        self.causal || self.window.left.is_some() || self.window.right.is_some()
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
    /// With a sliding window the visible (query, key) pairs are counted
    /// exactly; a mask array is not taken into account.
    pub fn forward_flops(&self) -> f64 {
        // In f64 throughout: a count, not a size, so it may exceed usize.
        let per_pair = 2.0
            * self.batch as f64
            * self.heads_q as f64
            * (self.head_dim as f64 + self.value_dim as f64);
        let full = per_pair * self.seq_q as f64 * self.seq_k as f64;
        if let Some(varlen) = self.varlen {
            per_pair * varlen.visible_pairs as f64
        } else if self.window != Window::default() {
            per_pair * self.window_pairs()
        } else if self.causal {
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
        reason: "flashport computes in float16, bfloat16, float32 or float64".to_string(),
    })
}

/// The number of elements of `shape`, or an error naming `argument` when
/// it does not fit in memory's address range (only a broadcast view, or a
/// caller of the Rust API, can describe such an array).
pub(crate) fn elements(shape: &[usize], argument: &str) -> Result<usize> {
    shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .filter(|&n| n <= isize::MAX as usize)
        .ok_or_else(|| {
            Error::TooLarge(format!(
                "{argument} of shape {} has more elements than memory can address",
                shape_str(shape)
            ))
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
    options: &Options<'_>,
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
    // Every array's element count, and the output's, fits in memory's
    // address range: the lengths the backends compute stay exact.
    elements(q.shape, "q")?;
    elements(k.shape, "k")?;
    elements(v.shape, "v")?;
    elements(
        &[qb, qh, seq_q, dv],
        "the output (batch, heads_q, seq_q, d_v)",
    )?;
    let variants = &options.variants;
    let scale = checked_scale(variants.scale, d, dtype)?;
    let sizes = Sizes {
        batch: qb,
        heads_q: qh,
        heads_kv: kh,
        seq_q,
        seq_k,
        head_dim: d,
        value_dim: dv,
        dtype,
        ndim: q.shape.len(),
    };
    let mut problem = sizes.problem(
        scale,
        variants.causal,
        position("q_offset", variants.q_offset, seq_k as i128 - seq_q as i128)?,
        position("k_offset", variants.k_offset, 0)?,
    );
    validate_variants(&mut problem, variants)?;
    if options.return_dmask {
        return Err(Error::Value {
            argument: "return_dmask".to_string(),
            value: "True".to_string(),
            reason: "only attention_backward returns a mask gradient".to_string(),
        });
    }
    Ok(problem)
}

/// A position offset as given, or its default, within [`POSITION_LIMIT`].
fn position(argument: &str, given: Option<i128>, default: i128) -> Result<i64> {
    let value = given.unwrap_or(default);
    let limit = i128::from(POSITION_LIMIT);
    if !(-limit..=limit).contains(&value) {
        return Err(position_error(argument, &value.to_string()));
    }
    Ok(value as i64)
}

/// The error for a position offset out of range (also for one too large
/// for the bindings to pass on).
pub fn position_error(argument: &str, value: &str) -> Error {
    value_error(
        argument,
        value,
        "positions must lie within ±2**62 (so that every position and every difference \
         of two stays exact in 64-bit integers)",
    )
}

/// The scale of the scores: `1/sqrt(d)` by default, else the caller's,
/// finite and within the range of the precision `dtype` computes in.
fn checked_scale(scale: Option<f64>, d: usize, dtype: DType) -> Result<f64> {
    match scale {
        None => Ok(1.0 / (d as f64).sqrt()),
        Some(s) if s.is_finite() => within_compute_range("scale", s, dtype),
        Some(s) => Err(value_error("scale", s, "scale must be a finite number")),
    }
}

/// `value` if the precision `dtype` computes in holds it: float16, bfloat16
/// and float32 inputs compute in float32, where a larger scale or softcap
/// would be infinite and turn every score into inf or NaN.
fn within_compute_range(argument: &str, value: f64, dtype: DType) -> Result<f64> {
    if dtype != DType::F64 && value.abs() > f32::MAX as f64 {
        return Err(value_error(
            argument,
            format!("{value:e}"),
            format!(
                "{argument} is beyond float32's range (±{:e}), in which {} inputs compute",
                f32::MAX,
                dtype.numpy_name()
            ),
        ));
    }
    Ok(value)
}

fn value_error(argument: &str, value: impl ToString, reason: impl ToString) -> Error {
    Error::Value {
        argument: argument.to_string(),
        value: value.to_string(),
        reason: reason.to_string(),
    }
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
    options: &Options<'_>,
) -> Result<Problem> {
    let mut problem = validate_forward(
        q,
        k,
        v,
        &Options {
            return_dmask: false,
            ..*options
        },
    )?;
    if options.return_dmask {
        match problem.mask {
            Some(MaskSpec {
                dtype: MaskDType::Float(_),
                ..
            }) => problem.return_dmask = true,
            Some(_) => {
                return Err(value_error(
                    "return_dmask",
                    "True",
                    "a boolean mask has no gradient; pass a float (additive) mask",
                ))
            }
            None => {
                return Err(value_error(
                    "return_dmask",
                    "True",
                    "there is no mask to differentiate (mask=None)",
                ))
            }
        }
    }
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
        DType::F16 | DType::BF16 => {
            return Err(Error::DType {
                argument: "lse".to_string(),
                dtype: lse.dtype.to_string(),
                reason: "lse must be float32 or float64 (as returned by attention)".to_string(),
            })
        }
    }
    Ok(problem)
}

mod kvcache;
mod merge;
mod sum;
mod variants;
mod varlen;

pub use kvcache::*;
pub use merge::*;
pub use sum::*;
pub use variants::*;
pub use varlen::*;

#[cfg(test)]
mod kvcache_tests;
#[cfg(test)]
mod tests;
