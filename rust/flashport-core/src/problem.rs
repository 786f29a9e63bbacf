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

/// Keyword options shared by the forward and the backward pass, as the
/// caller gave them (validation turns them into a [`Problem`]).
///
/// The score of query row `i` and key `j` is built in this order (see
/// [`crate::variants`] for the full definition):
/// `u = scale·q_i·k_j`, `t = softcap·tanh(u/softcap)`,
/// `s = t + alibi + mask`, then `-inf` where causal, the window or a
/// boolean mask hides the key.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Options<'a> {
    /// Causal mask: query `i` sees keys `j` whose position is at most its
    /// own, `k_offset + j <= q_offset + i` (by default bottom-right
    /// aligned: `j <= i + seq_k - seq_q`).
    pub causal: bool,
    /// Multiplier of `q·kᵀ`; `None` means `1/sqrt(d)`.
    pub scale: Option<f64>,
    /// Sliding window `(left, right)`: query `i` sees keys
    /// `i + off - left <= j <= i + off + right` with
    /// `off = q_offset - k_offset`; `-1` leaves a side unbounded.
    pub window: Option<(i64, i64)>,
    /// Global position of query row 0; `None` means `seq_k - seq_q`.
    pub q_offset: Option<i128>,
    /// Global position of key 0; `None` means 0.
    pub k_offset: Option<i128>,
    /// Logit soft-capping; `None` or `0` disables it.
    pub softcap: Option<f64>,
    /// Dropout probability on the attention probabilities, in `[0, 1)`.
    pub dropout_p: f64,
    /// Seed of the dropout generator; required when `dropout_p > 0`.
    pub seed: Option<i128>,
    /// Boolean (True = attend) or additive float mask, broadcastable to
    /// `(batch, heads_q, seq_q, seq_k)`.
    pub mask: Option<ArrayInfo<'a>>,
    /// ALiBi slopes, `(heads_q,)` or `(batch, heads_q)`.
    pub alibi_slopes: Option<ArrayInfo<'a>>,
    /// One sink logit per query head, `(heads_q,)`.
    pub sinks: Option<ArrayInfo<'a>>,
    /// Backward only: also return the gradient of a float mask.
    pub return_dmask: bool,
}

/// A sliding window; `None` leaves a side unbounded.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Window {
    pub left: Option<usize>,
    pub right: Option<usize>,
}

/// Dropout on the attention probabilities.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Dropout {
    pub p: f64,
    pub seed: u64,
}

/// The element type of a mask array.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MaskDType {
    Bool,
    Float(DType),
}

/// The shape of a mask array: its own dimensions, right-aligned against
/// `(batch, heads_q, seq_q, seq_k)` and padded with 1s on the left.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MaskSpec {
    /// Canonical 4-d shape; a 1 broadcasts.
    pub dims: [usize; 4],
    /// The caller's number of dimensions (1 to 4), so that the mask's
    /// gradient can be returned in the caller's shape.
    pub ndim: usize,
    pub dtype: MaskDType,
}

impl MaskSpec {
    pub fn len(&self) -> usize {
        self.dims.iter().product()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The caller's shape.
    pub fn shape(&self) -> Vec<usize> {
        self.dims[4 - self.ndim..].to_vec()
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
    /// [`crate::varlen::Segments::visible_keys`].
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

    /// Whether anything beyond plain (causal) attention is asked for.
    pub fn has_variants(&self) -> bool {
        self.window != Window::default()
            || self.softcap.is_some()
            || self.dropout.is_some()
            || self.mask.is_some()
            || self.alibi_per_batch.is_some()
            || self.sinks
    }

    /// The variants in use, by their keyword names, for error messages.
    pub fn variant_names(&self) -> Vec<&'static str> {
        let mut names = Vec::new();
        if self.window != Window::default() {
            names.push("window");
        }
        if self.mask.is_some() {
            names.push("mask");
        }
        if self.alibi_per_batch.is_some() {
            names.push("alibi_slopes");
        }
        if self.softcap.is_some() {
            names.push("softcap");
        }
        if self.sinks {
            names.push("sinks");
        }
        if self.dropout.is_some() {
            names.push("dropout_p");
        }
        names
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
    let scale = checked_scale(options.scale, d, dtype)?;
    let mut problem = Problem {
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
        window: Window::default(),
        softcap: None,
        dropout: None,
        mask: None,
        alibi_per_batch: None,
        sinks: false,
        return_dmask: false,
        varlen: None,
        q_offset: position("q_offset", options.q_offset, seq_k as i128 - seq_q as i128)?,
        k_offset: position("k_offset", options.k_offset, 0)?,
    };
    validate_variants(&mut problem, options)?;
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

/// A float dtype for an optional parameter array (slopes, sinks).
fn float_parameter(argument: &str, info: &ArrayInfo<'_>) -> Result<DType> {
    DType::from_numpy_name(info.dtype).ok_or_else(|| Error::DType {
        argument: argument.to_string(),
        dtype: info.dtype.to_string(),
        reason: "expected float16, bfloat16, float32 or float64".to_string(),
    })
}

/// Checks the variant keywords against the validated shapes and records
/// them in the problem.
fn validate_variants(problem: &mut Problem, options: &Options<'_>) -> Result<()> {
    if let Some((left, right)) = options.window {
        let side = |name: &str, value: i64| -> Result<Option<usize>> {
            match value {
                -1 => Ok(None),
                v if v >= 0 => Ok(Some(v as usize)),
                v => Err(value_error(
                    "window",
                    format!("({left}, {right})"),
                    format!(
                        "the {name} extent is {v}; each side must be >= 0, or None / -1 for unbounded"
                    ),
                )),
            }
        };
        problem.window = Window {
            left: side("left", left)?,
            right: side("right", right)?,
        };
    }
    match options.softcap {
        None => {}
        Some(0.0) => {}
        Some(c) if c.is_finite() && c > 0.0 => {
            problem.softcap = Some(within_compute_range("softcap", c, problem.dtype)?)
        }
        Some(c) => {
            return Err(value_error(
                "softcap",
                c,
                "softcap must be a positive finite number (None or 0 disables it)",
            ))
        }
    }
    let p = options.dropout_p;
    if !(0.0..1.0).contains(&p) {
        return Err(value_error(
            "dropout_p",
            p,
            "dropout_p must be in [0, 1) (1 would drop every probability)",
        ));
    }
    if p > 0.0 {
        let seed = match options.seed {
            None => {
                return Err(value_error(
                    "seed",
                    "None",
                    format!(
                        "dropout_p={p} needs an integer seed, so that attention_backward can \
                         regenerate the same dropout mask"
                    ),
                ))
            }
            Some(seed) => u64::try_from(seed)
                .map_err(|_| value_error("seed", seed, "seed must be in [0, 2**64)"))?,
        };
        problem.dropout = Some(Dropout { p, seed });
    } else if let Some(seed) = options.seed {
        u64::try_from(seed).map_err(|_| value_error("seed", seed, "seed must be in [0, 2**64)"))?;
    }

    let target = [problem.batch, problem.heads_q, problem.seq_q, problem.seq_k];
    if let Some(mask) = options.mask {
        let dtype = match mask.dtype {
            "bool" => MaskDType::Bool,
            name => match DType::from_numpy_name(name) {
                Some(d) => MaskDType::Float(d),
                None => {
                    return Err(Error::DType {
                        argument: "mask".to_string(),
                        dtype: name.to_string(),
                        reason: "a mask is bool (True = attend) or float16/32/64 or bfloat16 \
                                 (added to the scores)"
                            .to_string(),
                    })
                }
            },
        };
        let ndim = mask.shape.len();
        let broadcastable = ndim <= 4
            && mask
                .shape
                .iter()
                .zip(&target[4 - ndim.min(4)..])
                .all(|(&m, &t)| m == 1 || m == t);
        if !broadcastable {
            return Err(Error::Shape(format!(
                "mask has shape {} which does not broadcast to (batch, heads_q, seq_q, seq_k) \
                 = {}",
                shape_str(mask.shape),
                shape_str(&target)
            )));
        }
        let mut dims = [1; 4];
        dims[4 - ndim..].copy_from_slice(mask.shape);
        problem.mask = Some(MaskSpec { dims, ndim, dtype });
    }
    if let Some(slopes) = options.alibi_slopes {
        float_parameter("alibi_slopes", &slopes)?;
        problem.alibi_per_batch = Some(match *slopes.shape {
            [h] if h == problem.heads_q => false,
            [b, h] if b == problem.batch && h == problem.heads_q => true,
            _ => {
                return Err(Error::Shape(format!(
                    "alibi_slopes has shape {}; expected (heads_q,) = ({},) or (batch, heads_q) \
                     = ({}, {})",
                    shape_str(slopes.shape),
                    problem.heads_q,
                    problem.batch,
                    problem.heads_q
                )))
            }
        });
    }
    if let Some(sinks) = options.sinks {
        float_parameter("sinks", &sinks)?;
        if sinks.shape != [problem.heads_q] {
            return Err(Error::Shape(format!(
                "sinks has shape {}; expected one logit per query head, ({},)",
                shape_str(sinks.shape),
                problem.heads_q
            )));
        }
        problem.sinks = true;
    }
    Ok(())
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

/// One argument of `merge_states`: an array with a leading parts axis, or
/// one array per part.
#[derive(Debug, Clone, Copy)]
pub enum Parts<'a> {
    Stacked(ArrayInfo<'a>),
    Each(&'a [ArrayInfo<'a>]),
}

impl<'a> Parts<'a> {
    /// The number of parts and the distinct ones to check, each with its
    /// name for messages (`outs[2]`, or `outs` when stacked): a stacked
    /// array's parts all have one shape and dtype, so it is one part to
    /// check however many it holds (a broadcast view may hold more than
    /// memory could list). An error naming `argument` when there is no
    /// part.
    fn split(self, argument: &str) -> Result<(usize, Vec<(String, ArrayInfo<'a>)>)> {
        match self {
            // Something that is not an array of floats at all (a string, a
            // generator: NumPy makes them 0-d arrays) is a dtype error, as
            // the docstring says, before its shape is looked at.
            Parts::Stacked(info) if info.shape.is_empty() => {
                dtype_of(argument, &info)?;
                Err(Error::Shape(format!(
                    "{argument} has shape (): no parts along its first axis; \
                     merge_states needs at least one"
                )))
            }
            Parts::Stacked(info) => match info.shape.split_first() {
                Some((&count, part)) if count > 0 => Ok((
                    count,
                    vec![(argument.to_string(), ArrayInfo::new(part, info.dtype))],
                )),
                _ => Err(Error::Shape(format!(
                    "{argument} has shape {}: no parts along its first axis; \
                     merge_states needs at least one",
                    shape_str(info.shape)
                ))),
            },
            Parts::Each([]) => Err(Error::Shape(format!(
                "{argument} is an empty sequence: merge_states needs at least one part"
            ))),
            Parts::Each(infos) => Ok((
                infos.len(),
                infos
                    .iter()
                    .enumerate()
                    .map(|(i, info)| (format!("{argument}[{i}]"), *info))
                    .collect(),
            )),
        }
    }
}

/// A validated `merge_states`: `parts` attention states, each an output of
/// `rows × value_dim` (rows = every dimension but the last, flattened) and
/// a log-sum-exp per row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MergeProblem {
    pub parts: usize,
    pub rows: usize,
    pub value_dim: usize,
    /// The outputs' dtype; the log-sum-exps are `dtype.lse_dtype()`.
    pub dtype: DType,
    /// The shape of one part's output, which is the merged output's.
    pub out_shape: Vec<usize>,
}

impl MergeProblem {
    pub fn out_len(&self) -> usize {
        self.rows * self.value_dim
    }
    pub fn lse_shape(&self) -> Vec<usize> {
        self.out_shape[..self.out_shape.len() - 1].to_vec()
    }
}

/// Validates the arguments of `merge_states`: every part's output has one
/// shape `(..., seq_q, d_v)` and one float dtype, and its log-sum-exp has
/// that shape without `d_v`, in the dtype `attention` returns it in.
pub fn validate_merge(outs: Parts<'_>, lses: Parts<'_>) -> Result<MergeProblem> {
    let (parts, out_parts) = outs.split("outs")?;
    let (lse_count, lse_parts) = lses.split("lses")?;
    if parts != lse_count {
        return Err(Error::Shape(format!(
            "outs has {parts} parts but lses has {lse_count}; each part is one (out, lse) pair"
        )));
    }
    let (first_name, first) = &out_parts[0];
    let dtype = dtype_of(first_name, first)?;
    let Some((&value_dim, lead)) = first.shape.split_last().filter(|(_, l)| !l.is_empty()) else {
        let what = match outs {
            Parts::Stacked(_) => "(parts, ..., seq_q, d_v)",
            Parts::Each(_) => "(..., seq_q, d_v)",
        };
        return Err(Error::Shape(format!(
            "{first_name} has a part of shape {}; expected {what}",
            shape_str(first.shape)
        )));
    };
    for (name, info) in &out_parts[1..] {
        if dtype_of(name, info)? != dtype {
            return Err(Error::DType {
                argument: name.clone(),
                dtype: info.dtype.to_string(),
                reason: format!(
                    "{first_name} has dtype {}; every part's out must share one dtype",
                    first.dtype
                ),
            });
        }
        if info.shape != first.shape {
            return Err(Error::Shape(format!(
                "{name} has shape {} but {first_name} has shape {}; every part's out has the \
                 merged output's shape",
                shape_str(info.shape),
                shape_str(first.shape)
            )));
        }
    }
    let lse_dtype = dtype.lse_dtype().numpy_name();
    for (name, info) in &lse_parts {
        if info.dtype != lse_dtype {
            return Err(Error::DType {
                argument: name.clone(),
                dtype: info.dtype.to_string(),
                reason: format!(
                    "the log-sum-exps of {} outs are {lse_dtype} (float64 only for float64 \
                     outs), as flashport.attention returns them",
                    dtype.numpy_name()
                ),
            });
        }
        if info.shape != lead {
            return Err(Error::Shape(format!(
                "{name} has shape {} but the outs' parts have shape {}, whose log-sum-exps \
                 have shape {}",
                shape_str(info.shape),
                shape_str(first.shape),
                shape_str(lead)
            )));
        }
    }
    // The merged output, like each part, fits in memory's address range.
    elements(first.shape, first_name)?;
    Ok(MergeProblem {
        parts,
        rows: elements(lead, first_name)?,
        value_dim,
        dtype,
        out_shape: first.shape.to_vec(),
    })
}

/// A packed batch of variable-length sequences, flash-attn's varlen layout:
/// the [`Problem`] is the whole batch packed as one (`batch = 1`, `seq_q =
/// total_q`, `seq_k = total_k`, head-major as the kernels take it), and
/// [`crate::varlen::Segments`] (from `cu_seqlens_q` and `cu_seqlens_k`)
/// cut its rows and keys into `sequences` independent attentions.
/// Causal, the window and ALiBi are aligned within each sequence; there
/// are no `q_offset`/`k_offset` and no mask.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Varlen {
    pub sequences: usize,
    /// The (query, key) pairs the sequences' rows see: the work, which
    /// follows the real lengths, not the longest.
    pub visible_pairs: u64,
}

/// A `cu_seqlens_*` argument as validation reads it: shape and dtype, and
/// the entries (read only when those say it is a vector of integers).
#[derive(Debug, Clone, Copy)]
pub struct SeqLens<'a> {
    pub info: ArrayInfo<'a>,
    pub values: &'a [i128],
}

/// Whether a NumPy dtype name is an integer type (cu_seqlens).
pub fn is_integer_dtype(name: &str) -> bool {
    matches!(
        name,
        "int8" | "int16" | "int32" | "int64" | "uint8" | "uint16" | "uint32" | "uint64"
    )
}

/// The first entries of a prefix-sum argument, for messages.
fn entries_str(values: &[i128]) -> String {
    const SHOWN: usize = 8;
    let mut shown: Vec<String> = values.iter().take(SHOWN).map(i128::to_string).collect();
    if values.len() > SHOWN {
        shown.push(format!("... ({} entries)", values.len()));
    }
    format!("[{}]", shown.join(", "))
}

/// The prefix sums of one `cu_seqlens_*` argument, checked to be a vector
/// of integers from 0, never decreasing, ending at `total` (the rows of
/// `packed`, the argument they index).
fn prefix_sums(
    argument: &str,
    lens: &SeqLens<'_>,
    total: usize,
    packed: (&str, &[usize]),
) -> Result<Vec<usize>> {
    if !is_integer_dtype(lens.info.dtype) {
        return Err(Error::DType {
            argument: argument.to_string(),
            dtype: lens.info.dtype.to_string(),
            reason: "cu_seqlens are integer prefix sums of the sequence lengths (int32 or \
                     int64, as flash-attn takes them)"
                .to_string(),
        });
    }
    let [n] = *lens.info.shape else {
        return Err(Error::Shape(format!(
            "{argument} has shape {}; expected (batch + 1,): the prefix sums of the \
             sequence lengths, from 0",
            shape_str(lens.info.shape)
        )));
    };
    if n == 0 || lens.values.len() != n {
        return Err(Error::Shape(format!(
            "{argument} has shape {}; expected (batch + 1,) with at least the entry 0",
            shape_str(lens.info.shape)
        )));
    }
    let values = lens.values;
    let bad = |reason: String| Err(value_error(argument, entries_str(values), reason));
    if values[0] != 0 {
        return bad(format!(
            "{argument}[0] = {}; the prefix sums start at 0",
            values[0]
        ));
    }
    for i in 1..n {
        if values[i] < values[i - 1] {
            return bad(format!(
                "{argument}[{i}] = {} < {argument}[{}] = {}: the prefix sums must not \
                 decrease (a sequence length is never negative)",
                values[i],
                i - 1,
                values[i - 1]
            ));
        }
    }
    if values[n - 1] != total as i128 {
        let (name, shape) = packed;
        return Err(Error::Shape(format!(
            "{argument}[{}] = {} but {name} holds {total} packed rows ({name} has shape {}): \
             the last prefix sum is the total length",
            n - 1,
            values[n - 1],
            shape_str(shape)
        )));
    }
    // Every entry lies in [0, total]: it fits usize.
    Ok(values.iter().map(|&x| x as usize).collect())
}

/// Validates the arguments of `attention_varlen`: `q (total_q, heads_q,
/// d)`, `k (total_k, heads_kv, d)`, `v (total_k, heads_kv, d_v)` and the
/// prefix sums `cu_seqlens_q`, `cu_seqlens_k` (`(batch + 1,)` each). The
/// problem is the head-major packed one (`(heads, total, dim)`, what the
/// kernels run); the segments say where each sequence's rows and keys lie.
/// `options` must not hold a mask or positions (`attention_varlen` has no
/// such keywords); `alibi_slopes` are `(heads_q,)` or `(batch, heads_q)`
/// with `batch` the number of sequences.
pub fn validate_varlen_forward(
    q: ArrayInfo<'_>,
    k: ArrayInfo<'_>,
    v: ArrayInfo<'_>,
    cu_seqlens_q: SeqLens<'_>,
    cu_seqlens_k: SeqLens<'_>,
    options: &Options<'_>,
) -> Result<(Problem, crate::varlen::Segments)> {
    for (name, info) in [("q", &q), ("k", &k), ("v", &v)] {
        if info.shape.len() != 3 {
            return Err(Error::Shape(format!(
                "{name} has shape {} ({} dimensions); attention_varlen takes packed \
                 sequences, q (total_q, heads_q, d), k (total_k, heads_kv, d) and \
                 v (total_k, heads_kv, d_v)",
                shape_str(info.shape),
                info.shape.len()
            )));
        }
    }
    let ([tq, hq, d], [tk, hk, dk], [tv, hv, dv]) = (
        [q.shape[0], q.shape[1], q.shape[2]],
        [k.shape[0], k.shape[1], k.shape[2]],
        [v.shape[0], v.shape[1], v.shape[2]],
    );
    let shapes = || {
        format!(
            "q {}, k {}, v {}",
            shape_str(q.shape),
            shape_str(k.shape),
            shape_str(v.shape)
        )
    };
    if tv != tk {
        return Err(Error::Shape(format!(
            "k and v must hold the same packed keys (total_k: k {tk}, v {tv}); got {}",
            shapes()
        )));
    }
    if hv != hk {
        return Err(Error::Shape(format!(
            "k and v must have the same number of heads (k: {hk}, v: {hv}); got {}",
            shapes()
        )));
    }
    let cu_q = prefix_sums("cu_seqlens_q", &cu_seqlens_q, tq, ("q", q.shape))?;
    let cu_k = prefix_sums("cu_seqlens_k", &cu_seqlens_k, tk, ("k", k.shape))?;
    if cu_q.len() != cu_k.len() {
        return Err(Error::Shape(format!(
            "cu_seqlens_q has {} entries (batch {}) but cu_seqlens_k has {} (batch {}); \
             each sequence has one entry in both",
            cu_q.len(),
            cu_q.len() - 1,
            cu_k.len(),
            cu_k.len() - 1
        )));
    }
    let shape_error = |what: String| Err(Error::Shape(format!("{what}; got {}", shapes())));
    if hq == 0 || hk == 0 {
        return shape_error(format!(
            "the number of heads must be at least 1 (q: {hq}, k/v: {hk})"
        ));
    }
    if hq % hk != 0 {
        return shape_error(format!(
            "number of heads in k/v ({hk}) must divide number of heads in q ({hq})"
        ));
    }
    if dk != d {
        return shape_error(format!(
            "q and k must have the same head dimension d (q: {d}, k: {dk})"
        ));
    }
    if d == 0 {
        return shape_error("the head dimension d must be at least 1".to_string());
    }
    // Positions are those within each sequence, and a mask would have to
    // be one per sequence: attention_varlen has neither keyword.
    for (name, given) in [
        ("mask", options.mask.is_some()),
        ("q_offset", options.q_offset.is_some()),
        ("k_offset", options.k_offset.is_some()),
    ] {
        if given {
            return Err(value_error(
                name,
                "given",
                "attention_varlen takes no mask and no positions (they are those within \
                 each sequence)",
            ));
        }
    }
    let (qh, kh, vh) = ([hq, tq, d], [hk, tk, d], [hk, tk, dv]);
    let mut problem = validate_forward(
        ArrayInfo::new(&qh, q.dtype),
        ArrayInfo::new(&kh, k.dtype),
        ArrayInfo::new(&vh, v.dtype),
        &Options {
            alibi_slopes: None,
            ..*options
        },
    )?;
    let sequences = cu_q.len() - 1;
    if let Some(slopes) = options.alibi_slopes {
        float_parameter("alibi_slopes", &slopes)?;
        problem.alibi_per_batch = Some(match *slopes.shape {
            [h] if h == hq => false,
            [b, h] if b == sequences && h == hq => true,
            _ => {
                return Err(Error::Shape(format!(
                    "alibi_slopes has shape {}; expected (heads_q,) = ({hq},) or \
                     (batch, heads_q) = ({sequences}, {hq}), batch being the number of \
                     sequences (len(cu_seqlens_q) - 1)",
                    shape_str(slopes.shape),
                )))
            }
        });
    }
    let segments = crate::varlen::Segments::new(cu_q, cu_k);
    problem.varlen = Some(Varlen {
        sequences,
        visible_pairs: segments.visible_pairs(&problem),
    });
    Ok((problem, segments))
}

/// Validates the arguments of `attention_varlen_backward`: those of the
/// forward, `do` and `o` shaped `(total_q, heads_q, d_v)` like its output
/// and `lse` `(heads_q, total_q)`.
#[allow(clippy::too_many_arguments)]
pub fn validate_varlen_backward(
    d_out: ArrayInfo<'_>,
    q: ArrayInfo<'_>,
    k: ArrayInfo<'_>,
    v: ArrayInfo<'_>,
    out: ArrayInfo<'_>,
    lse: ArrayInfo<'_>,
    cu_seqlens_q: SeqLens<'_>,
    cu_seqlens_k: SeqLens<'_>,
    options: &Options<'_>,
) -> Result<(Problem, crate::varlen::Segments)> {
    let (problem, segments) =
        validate_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, options)?;
    let out_shape = [problem.seq_q, problem.heads_q, problem.value_dim];
    for (name, info) in [("do", &d_out), ("o", &out)] {
        if info.shape != out_shape {
            return Err(Error::Shape(format!(
                "{name} has shape {} but attention_varlen's output for q {} and v {} has \
                 shape {}",
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
    let lse_shape = [problem.heads_q, problem.seq_q];
    if lse.shape != lse_shape {
        return Err(Error::Shape(format!(
            "lse has shape {} but for q {} it must have shape (heads_q, total_q) = {}",
            shape_str(lse.shape),
            shape_str(q.shape),
            shape_str(&lse_shape)
        )));
    }
    match dtype_of("lse", &lse)? {
        DType::F32 | DType::F64 => Ok((problem, segments)),
        DType::F16 | DType::BF16 => Err(Error::DType {
            argument: "lse".to_string(),
            dtype: lse.dtype.to_string(),
            reason: "lse must be float32 or float64 (as returned by attention_varlen)".to_string(),
        }),
    }
}

// ---------------------------------------------------------------------------
// attention_with_kvcache: queries against a cache of keys and values,
// contiguous per sequence or paged through a block table.

/// An integer array argument with its values (`cache_seqlens`,
/// `block_table`): validation reads the entries, not only the shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IntArray<'a> {
    pub shape: &'a [usize],
    /// The NumPy dtype name; anything but an integer type is refused.
    pub dtype: &'a str,
    /// The entries, row-major, widened to i64 (a uint64 block table's
    /// entries above `i64::MAX` saturate, and a used one is named as "2^63
    /// or more"; lengths and tokens beyond int64 are refused before).
    pub values: &'a [i64],
}

/// The keyword options of `attention_with_kvcache`, as the caller gave
/// them. Positions come from `cache_seqlens`: query row `i` of sequence
/// `b` is at `cache_seqlens[b] - seq_q + i`, its keys at `0..len`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct KvCacheOptions<'a> {
    /// Query row `i` sees keys up to its own position (bottom-right
    /// against the sequence's cached length).
    pub causal: bool,
    pub scale: Option<f64>,
    /// `(left, right)` around each row's position; `-1` is unbounded.
    pub window: Option<(i64, i64)>,
    pub softcap: Option<f64>,
    pub alibi_slopes: Option<ArrayInfo<'a>>,
    pub sinks: Option<ArrayInfo<'a>>,
    /// Key splits per sequence (Flash-Decoding); `None` lets the backend
    /// choose from the shape.
    pub num_splits: Option<i128>,
}

/// The most key splits a call may ask for (the GPU's grid allows more;
/// this bounds the partial results a call holds).
pub const MAX_SPLITS: usize = 1024;

/// Where the cache keeps a sequence's keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheLayout {
    /// `(batch, heads_kv, capacity, d)`: sequence `b` in its own rows.
    Contiguous { capacity: usize },
    /// `(num_blocks, heads_kv, block_size, d)`, key `j` of sequence `b` in
    /// block `table[b * max_blocks + j / block_size]`. Only the entries a
    /// sequence's length reaches are validated and kept; the others (past
    /// the length) are 0 here and never read.
    Paged {
        num_blocks: usize,
        block_size: usize,
        max_blocks: usize,
        table: Vec<usize>,
    },
}

/// A validated `attention_with_kvcache`.
#[derive(Debug, Clone, PartialEq)]
pub struct KvCacheProblem {
    /// The attention of one sequence: batch, heads, seq_q, head dims,
    /// scale, causal, dtype and the variants (window, softcap, ALiBi,
    /// sinks), with `seq_k = 0` and default positions;
    /// [`KvCacheProblem::sequence`] gives the one of sequence `b`.
    pub attention: Problem,
    pub layout: CacheLayout,
    /// Valid keys per sequence.
    pub seqlens: Vec<usize>,
    /// Explicit key splits per sequence, if the caller gave them.
    pub num_splits: Option<usize>,
}

impl KvCacheProblem {
    /// Checks the variant arrays against the problem: no mask (the cache's
    /// lengths are the mask), slopes and sinks of the validated sizes.
    pub(crate) fn check_variant_arrays(&self, variants: &crate::VariantArrays<'_>) -> Result<()> {
        let a = &self.attention;
        let slopes = match a.alibi_per_batch {
            None => None,
            Some(true) => Some(a.batch * a.heads_q),
            Some(false) => Some(a.heads_q),
        };
        let sinks = a.sinks.then_some(a.heads_q);
        if variants.mask.is_some()
            || slopes != variants.alibi_slopes.map(<[f64]>::len)
            || sinks != variants.sinks.map(<[f64]>::len)
        {
            return Err(Error::Shape(
                "the variant arrays do not match the validated problem".to_string(),
            ));
        }
        Ok(())
    }

    pub fn batch(&self) -> usize {
        self.attention.batch
    }
    pub fn heads_q(&self) -> usize {
        self.attention.heads_q
    }
    pub fn heads_kv(&self) -> usize {
        self.attention.heads_kv
    }
    pub fn group_size(&self) -> usize {
        self.attention.group_size()
    }
    pub fn seq_q(&self) -> usize {
        self.attention.seq_q
    }
    pub fn dtype(&self) -> DType {
        self.attention.dtype
    }
    /// Query rows that share one key/value head in a sequence: the GQA
    /// group's heads times seq_q, row `g * seq_q + i`.
    pub fn group_rows(&self) -> usize {
        self.group_size() * self.seq_q()
    }

    /// Keys per block: the block size, or a contiguous cache's capacity
    /// (each sequence one block).
    pub fn block_size(&self) -> usize {
        match &self.layout {
            CacheLayout::Contiguous { capacity } => *capacity,
            CacheLayout::Paged { block_size, .. } => *block_size,
        }
    }

    /// Blocks of the cache arrays' first axis (the batch, when contiguous).
    pub fn cache_blocks(&self) -> usize {
        match &self.layout {
            CacheLayout::Contiguous { .. } => self.batch(),
            CacheLayout::Paged { num_blocks, .. } => *num_blocks,
        }
    }

    /// Rows of `head_dim` (k_cache) or `value_dim` (v_cache) in a cache.
    pub fn cache_rows(&self) -> usize {
        self.cache_blocks() * self.heads_kv() * self.block_size()
    }

    /// The block holding key `j` of sequence `b`: `b` when contiguous.
    pub fn block_of(&self, b: usize, j: usize) -> usize {
        match &self.layout {
            CacheLayout::Contiguous { .. } => b,
            CacheLayout::Paged {
                block_size,
                max_blocks,
                table,
                ..
            } => table[b * max_blocks + j / block_size],
        }
    }

    /// The cache row of key `j` of sequence `b`, key/value head `h`:
    /// `(block * heads_kv + h) * block_size + j % block_size`.
    pub fn cache_row(&self, b: usize, h: usize, j: usize) -> usize {
        let bs = self.block_size();
        (self.block_of(b, j) * self.heads_kv() + h) * bs + j % bs
    }

    /// The attention of sequence `b` alone: its `seq_k` keys with the
    /// default, bottom-right positions (query `i` at `len - seq_q + i`).
    pub fn sequence(&self, b: usize) -> Problem {
        let len = self.seqlens[b];
        Problem {
            seq_k: len,
            q_offset: len as i64 - self.seq_q() as i64,
            k_offset: 0,
            ..self.attention
        }
    }

    /// The keys any query row of sequence `b` sees (causal and the
    /// window bound the first and the last row).
    pub fn keys_read(&self, b: usize) -> std::ops::Range<usize> {
        let p = self.sequence(b);
        if p.seq_q == 0 || p.seq_k == 0 {
            return 0..0;
        }
        let (first, last) = (p.visible_keys(0), p.visible_keys(p.seq_q - 1));
        let start = first.start.min(last.end);
        start..last.end.max(start)
    }

    pub fn q_len(&self) -> usize {
        self.batch() * self.heads_q() * self.seq_q() * self.attention.head_dim
    }
    pub fn k_cache_len(&self) -> usize {
        self.cache_rows() * self.attention.head_dim
    }
    pub fn v_cache_len(&self) -> usize {
        self.cache_rows() * self.attention.value_dim
    }
    pub fn out_len(&self) -> usize {
        self.attention.out_len()
    }
    pub fn lse_len(&self) -> usize {
        self.attention.lse_len()
    }
    pub fn out_shape(&self) -> Vec<usize> {
        self.attention.out_shape()
    }
    pub fn lse_shape(&self) -> Vec<usize> {
        self.attention.lse_shape()
    }
}

fn integer_dtype(argument: &str, info: &IntArray<'_>) -> Result<()> {
    const INTEGERS: [&str; 8] = [
        "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    ];
    if INTEGERS.contains(&info.dtype) {
        return Ok(());
    }
    Err(Error::DType {
        argument: argument.to_string(),
        dtype: info.dtype.to_string(),
        reason: "expected an integer array (int32 or int64)".to_string(),
    })
}

/// Validates the arguments of `attention_with_kvcache`: shapes and dtypes
/// of every array, then every length and every block-table entry a length
/// reaches, so that no backend reads outside the caches.
pub fn validate_kvcache(
    q: ArrayInfo<'_>,
    k_cache: ArrayInfo<'_>,
    v_cache: ArrayInfo<'_>,
    cache_seqlens: IntArray<'_>,
    block_table: Option<IntArray<'_>>,
    options: &KvCacheOptions<'_>,
) -> Result<KvCacheProblem> {
    let names = ["q", "k_cache", "v_cache"];
    let infos = [&q, &k_cache, &v_cache];
    let expected = [
        "(batch, heads_q, seq_q, d)",
        "(batch or num_blocks, heads_kv, capacity or block_size, d)",
        "(batch or num_blocks, heads_kv, capacity or block_size, d_v)",
    ];
    for ((name, info), want) in names.iter().zip(infos).zip(expected) {
        if info.shape.len() != 4 {
            return Err(Error::Shape(format!(
                "{name} has shape {} ({} dimensions); expected {want}",
                shape_str(info.shape),
                info.shape.len()
            )));
        }
    }
    let dtype = dtype_of("q", &q)?;
    for (name, info) in [("k_cache", &k_cache), ("v_cache", &v_cache)] {
        if dtype_of(name, info)? != dtype {
            return Err(Error::DType {
                argument: name.to_string(),
                dtype: info.dtype.to_string(),
                reason: format!(
                    "q has dtype {}; q, k_cache and v_cache must share one dtype",
                    q.dtype
                ),
            });
        }
    }
    let [batch, heads_q, seq_q, d] = [q.shape[0], q.shape[1], q.shape[2], q.shape[3]];
    let [blocks, heads_kv, rows, kd] = [
        k_cache.shape[0],
        k_cache.shape[1],
        k_cache.shape[2],
        k_cache.shape[3],
    ];
    let dv = v_cache.shape[3];
    let shapes = || {
        format!(
            "q {}, k_cache {}, v_cache {}",
            shape_str(q.shape),
            shape_str(k_cache.shape),
            shape_str(v_cache.shape)
        )
    };
    if v_cache.shape[..3] != k_cache.shape[..3] {
        return Err(Error::Shape(format!(
            "k_cache and v_cache must agree in all but their last dimension; got {}",
            shapes()
        )));
    }
    if heads_q == 0 || heads_kv == 0 {
        return Err(Error::Shape(format!(
            "the number of heads must be at least 1 (q: {heads_q}, caches: {heads_kv}); got {}",
            shapes()
        )));
    }
    if heads_q % heads_kv != 0 {
        return Err(Error::Shape(format!(
            "number of heads in the caches ({heads_kv}) must divide number of heads in q \
             ({heads_q}); got {}",
            shapes()
        )));
    }
    if kd != d {
        return Err(Error::Shape(format!(
            "q and k_cache must have the same head dimension d (q: {d}, k_cache: {kd}); got {}",
            shapes()
        )));
    }
    if d == 0 {
        return Err(Error::Shape(format!(
            "the head dimension d must be at least 1; got {}",
            shapes()
        )));
    }
    integer_dtype("cache_seqlens", &cache_seqlens)?;
    if cache_seqlens.shape != [batch] {
        return Err(Error::Shape(format!(
            "cache_seqlens has shape {}; expected one length per sequence, ({batch},)",
            shape_str(cache_seqlens.shape)
        )));
    }
    let layout = match block_table {
        None => {
            if blocks != batch {
                return Err(Error::Shape(format!(
                    "k_cache has {blocks} sequences but q has {batch}: a contiguous cache is \
                     (batch, heads_kv, capacity, d) (a paged one needs block_table); got {}",
                    shapes()
                )));
            }
            CacheLayout::Contiguous { capacity: rows }
        }
        Some(table) => {
            integer_dtype("block_table", &table)?;
            let max_blocks = match *table.shape {
                [b, m] if b == batch => m,
                _ => {
                    return Err(Error::Shape(format!(
                        "block_table has shape {}; expected (batch, max_blocks_per_seq) with \
                         batch = {batch}",
                        shape_str(table.shape)
                    )))
                }
            };
            if rows == 0 {
                return Err(Error::Shape(format!(
                    "k_cache has shape {}: a paged cache's block size (its third dimension) \
                     must be at least 1",
                    shape_str(k_cache.shape)
                )));
            }
            CacheLayout::Paged {
                num_blocks: blocks,
                block_size: rows,
                max_blocks,
                table: Vec::new(),
            }
        }
    };
    let mut seqlens = Vec::with_capacity(batch);
    for (b, &len) in cache_seqlens.values.iter().enumerate() {
        let room = match &layout {
            CacheLayout::Contiguous { capacity } => *capacity,
            CacheLayout::Paged {
                block_size,
                max_blocks,
                ..
            } => block_size.saturating_mul(*max_blocks),
        };
        if len < 0 {
            return Err(value_error(
                &format!("cache_seqlens[{b}]"),
                len,
                "a length must be >= 0",
            ));
        }
        let len = usize::try_from(len).unwrap_or(usize::MAX);
        if len > room {
            return Err(match &layout {
                CacheLayout::Contiguous { capacity } => value_error(
                    &format!("cache_seqlens[{b}]"),
                    len,
                    format!(
                        "more keys than the cache holds per sequence (capacity = \
                         k_cache.shape[2] = {capacity})"
                    ),
                ),
                CacheLayout::Paged {
                    block_size,
                    max_blocks,
                    ..
                } => Error::Shape(format!(
                    "block_table has shape {}: {max_blocks} blocks of {block_size} keys = \
                     {room} keys per sequence, but cache_seqlens[{b}] = {len}",
                    shape_str(block_table.map_or(&[][..], |t| t.shape))
                )),
            });
        }
        seqlens.push(len);
    }
    let mut layout = layout;
    if let (
        CacheLayout::Paged {
            num_blocks,
            block_size,
            max_blocks,
            table,
        },
        Some(given),
    ) = (&mut layout, block_table)
    {
        table.resize(batch * *max_blocks, 0);
        for (b, &len) in seqlens.iter().enumerate() {
            let used = len.div_ceil(*block_size);
            let entries = &given.values[b * *max_blocks..][..used];
            let slots = &mut table[b * *max_blocks..][..used];
            for (i, (&entry, slot)) in entries.iter().zip(slots).enumerate() {
                if !(0..*num_blocks as i128).contains(&(entry as i128)) {
                    // The binding saturates a uint64 table's entries past
                    // int64 (those past a length may be anything): the
                    // value is then 2^63 or more, not the one shown.
                    let shown = if entry == i64::MAX && given.dtype == "uint64" {
                        "2^63 or more".to_string()
                    } else {
                        entry.to_string()
                    };
                    return Err(value_error(
                        &format!("block_table[{b}, {i}]"),
                        shown,
                        format!(
                            "not a block of the cache (num_blocks = {num_blocks}); entries \
                             past a sequence's length (cache_seqlens[{b}] = {len}) are not \
                             read and may be anything"
                        ),
                    ));
                }
                *slot = entry as usize;
            }
        }
    }
    let scale = checked_scale(options.scale, d, dtype)?;
    let num_splits = match options.num_splits {
        None => None,
        Some(n) if (1..=MAX_SPLITS as i128).contains(&n) => Some(n as usize),
        Some(n) => {
            return Err(value_error(
                "num_splits",
                n,
                format!("expected None (chosen from the shape) or 1 to {MAX_SPLITS}"),
            ))
        }
    };
    let mut attention = Problem {
        batch,
        heads_q,
        heads_kv,
        seq_q,
        seq_k: 0,
        head_dim: d,
        value_dim: dv,
        scale,
        causal: options.causal,
        dtype,
        ndim: 4,
        window: Window::default(),
        softcap: None,
        dropout: None,
        mask: None,
        alibi_per_batch: None,
        sinks: false,
        return_dmask: false,
        q_offset: -(seq_q as i64),
        k_offset: 0,
        varlen: None,
    };
    // The variants mean here what they mean for attention: the same
    // checks and messages.
    validate_variants(
        &mut attention,
        &Options {
            window: options.window,
            softcap: options.softcap,
            alibi_slopes: options.alibi_slopes,
            sinks: options.sinks,
            ..Options::default()
        },
    )?;
    Ok(KvCacheProblem {
        attention,
        layout,
        seqlens,
        num_splits,
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn window_pairs_equals_counting_every_row() {
        let mut checked = 0;
        for seq_q in [0usize, 1, 2, 5, 13] {
            for seq_k in [0usize, 1, 3, 8, 17] {
                for causal in [false, true] {
                    for left in [None, Some(0), Some(1), Some(4), Some(30)] {
                        for right in [None, Some(0), Some(2), Some(30)] {
                            for offset in [-20i64, -3, 0, 2, 25] {
                                let mut p = fwd(&[2, 4], &[3, 4], &[3, 4]).unwrap();
                                (p.seq_q, p.seq_k) = (seq_q, seq_k);
                                p.causal = causal;
                                p.window = Window { left, right };
                                p.q_offset = offset;
                                let rows: usize = (0..seq_q).map(|i| p.visible_keys(i).len()).sum();
                                assert_eq!(p.window_pairs(), rows as f64, "{p:?}");
                                checked += 1;
                            }
                        }
                    }
                }
            }
        }
        assert_eq!(checked, 5 * 5 * 2 * 5 * 4 * 5);
    }

    #[test]
    fn window_pairs_of_huge_empty_problems_take_no_time() {
        let mut p = fwd(&[2, 4], &[3, 4], &[3, 4]).unwrap();
        (p.seq_q, p.seq_k) = (usize::MAX / 2, usize::MAX / 4);
        p.batch = 0;
        p.window = Window {
            left: Some(3),
            right: Some(1),
        };
        assert_eq!(p.forward_flops(), 0.0);
        p.batch = 1;
        assert!(p.window_pairs() > 1e18);
    }

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
    fn bfloat16_is_ml_dtypes_name_and_computes_in_float32() {
        for d in [DType::F16, DType::BF16, DType::F32, DType::F64] {
            assert_eq!(DType::from_numpy_name(d.numpy_name()), Some(d));
        }
        assert_eq!(DType::from_numpy_name("bfloat16"), Some(DType::BF16));
        assert_eq!(DType::BF16.lse_dtype(), DType::F32);
        assert!(DType::BF16.is_half() && !DType::F32.is_half());
        let shape = [1, 2, 4, 8];
        let p = validate_forward(
            ArrayInfo::new(&shape, "bfloat16"),
            ArrayInfo::new(&shape, "bfloat16"),
            ArrayInfo::new(&shape, "bfloat16"),
            &Options::default(),
        )
        .unwrap();
        assert_eq!(p.dtype, DType::BF16);
        let err = validate_forward(
            ArrayInfo::new(&shape, "int8"),
            ArrayInfo::new(&shape, "int8"),
            ArrayInfo::new(&shape, "int8"),
            &Options::default(),
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("bfloat16"), "{err}");
        // lse is float32 (or float64), never the inputs' half dtype.
        let lse = [1, 2, 4];
        let a = ArrayInfo::new(&shape, "bfloat16");
        let bad = validate_backward(
            a,
            a,
            a,
            a,
            a,
            ArrayInfo::new(&lse, "bfloat16"),
            &Options::default(),
        );
        assert!(matches!(bad, Err(Error::DType { ref argument, .. }) if argument == "lse"));
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
                scale: Some(f64::NAN),
                ..Options::default()
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
            (0..3).map(|i| p.visible_keys(i).end).collect::<Vec<_>>(),
            vec![3, 4, 5]
        );
        let p = Problem {
            causal: true,
            ..fwd(&[5, 4], &[2, 4], &[2, 4]).unwrap()
        };
        // seq_q > seq_k: the first rows see nothing.
        assert_eq!(
            (0..5).map(|i| p.visible_keys(i).end).collect::<Vec<_>>(),
            vec![0, 0, 0, 1, 2]
        );
    }

    #[test]
    fn offsets_default_to_bottom_right_and_move_the_diagonal() {
        let p = fwd(&[3, 4], &[5, 4], &[5, 4]).unwrap();
        assert_eq!((p.q_offset, p.k_offset, p.causal_offset()), (2, 0, 2));
        let explicit = |q_offset, k_offset| {
            validate_forward(
                ArrayInfo::new(&[3, 4], "float32"),
                ArrayInfo::new(&[5, 4], "float32"),
                ArrayInfo::new(&[5, 4], "float32"),
                &Options {
                    causal: true,
                    q_offset,
                    k_offset,
                    ..Options::default()
                },
            )
            .unwrap()
        };
        let ends = |p: Problem| (0..3).map(|i| p.visible_keys(i)).collect::<Vec<_>>();
        // Explicit defaults are the defaults.
        assert_eq!(explicit(Some(2), Some(0)), explicit(None, None));
        // Queries at 10..13 against keys at 10..15: top-left aligned.
        assert_eq!(ends(explicit(Some(10), Some(10))), vec![0..1, 0..2, 0..3]);
        // Keys 0..5 at 100..105 lie after queries 7..10: nothing visible.
        assert_eq!(ends(explicit(Some(7), Some(100))), vec![0..0; 3]);
        // The far past: every key visible, exactly at the range's ends.
        let limit = i128::from(POSITION_LIMIT);
        let p = explicit(Some(limit), Some(-limit));
        assert_eq!(p.causal_offset(), 1i128 << 63);
        assert_eq!(ends(p), vec![0..5; 3]);
    }

    #[test]
    fn offsets_out_of_range_are_refused_by_name() {
        let q = [3, 4];
        let k = [5, 4];
        for (q_offset, k_offset, name) in [
            (Some(1i128 << 62 | 1), None, "q_offset"),
            (None, Some(-(1i128 << 62) - 1), "k_offset"),
            (Some(i128::MAX), None, "q_offset"),
        ] {
            let e = with(
                Options {
                    q_offset,
                    k_offset,
                    ..Options::default()
                },
                &q,
                &k,
            )
            .unwrap_err();
            match e {
                Error::Value { ref argument, .. } => assert_eq!(argument, name, "{e}"),
                other => panic!("unexpected {other:?}"),
            }
        }
    }

    fn with(options: Options<'_>, q: &[usize], k: &[usize]) -> Result<Problem> {
        validate_forward(
            ArrayInfo::new(q, "float32"),
            ArrayInfo::new(k, "float32"),
            ArrayInfo::new(k, "float32"),
            &options,
        )
    }

    #[test]
    fn window_is_aligned_like_causal_and_combines_with_it() {
        // seq_q = 4, seq_k = 6: the diagonal of row i is key i + 2.
        let window = Options {
            window: Some((1, 0)),
            ..Options::default()
        };
        let p = with(window, &[4, 8], &[6, 8]).unwrap();
        let ranges: Vec<_> = (0..4).map(|i| p.visible_keys(i)).collect();
        assert_eq!(ranges, vec![1..3, 2..4, 3..5, 4..6]);
        let p = with(
            Options {
                window: Some((-1, 1)),
                causal: true,
                ..Options::default()
            },
            &[4, 8],
            &[6, 8],
        )
        .unwrap();
        // causal wins over the wider right side.
        assert_eq!(p.visible_keys(0), 0..3);
        let p = with(
            Options {
                window: Some((0, 0)),
                ..Options::default()
            },
            &[6, 8],
            &[2, 8],
        )
        .unwrap();
        // Rows whose diagonal lies before key 0 see nothing.
        assert_eq!(p.visible_keys(0), 0..0);
        assert_eq!(p.visible_keys(5), 1..2);
        assert!(p.forward_flops() > 0.0);
    }

    #[test]
    fn variant_arguments_are_checked_by_name() {
        let q = [2, 3, 5, 8];
        let k = [2, 3, 7, 8];
        let err = |options: Options<'_>| with(options, &q, &k).unwrap_err().to_string();
        assert!(err(Options {
            window: Some((-2, 0)),
            ..Options::default()
        })
        .contains("window"));
        assert!(err(Options {
            softcap: Some(-1.0),
            ..Options::default()
        })
        .contains("softcap"));
        assert!(err(Options {
            dropout_p: 1.0,
            ..Options::default()
        })
        .contains("dropout_p"));
        assert!(err(Options {
            dropout_p: 0.1,
            ..Options::default()
        })
        .contains("seed"));
        let bad_mask = [5, 6];
        let e = err(Options {
            mask: Some(ArrayInfo::new(&bad_mask, "bool")),
            ..Options::default()
        });
        assert!(e.contains("(5, 6)") && e.contains("(2, 3, 5, 7)"), "{e}");
        let e = err(Options {
            mask: Some(ArrayInfo::new(&[5, 7], "int8")),
            ..Options::default()
        });
        assert!(e.contains("mask") && e.contains("int8"), "{e}");
        let e = err(Options {
            sinks: Some(ArrayInfo::new(&[2], "float32")),
            ..Options::default()
        });
        assert!(e.contains("sinks") && e.contains("(3,)"), "{e}");
        let e = err(Options {
            alibi_slopes: Some(ArrayInfo::new(&[3, 3], "float32")),
            ..Options::default()
        });
        assert!(e.contains("alibi_slopes"), "{e}");
    }

    #[test]
    fn masks_broadcast_from_the_right() {
        let q = [2, 3, 5, 8];
        let k = [2, 3, 7, 8];
        for shape in [&[7][..], &[5, 1], &[3, 1, 7], &[2, 1, 5, 7], &[1, 1, 1, 1]] {
            let p = with(
                Options {
                    mask: Some(ArrayInfo::new(shape, "float32")),
                    ..Options::default()
                },
                &q,
                &k,
            )
            .unwrap();
            assert_eq!(p.mask.unwrap().shape(), shape.to_vec());
        }
    }

    #[test]
    fn return_dmask_needs_a_float_mask_and_the_backward() {
        let q = [5, 8];
        let (mask_shape, lse) = ([5, 5], [5]);
        let info = |s| ArrayInfo::new(s, "float32");
        let backward = |mask: &str, dmask: bool| {
            validate_backward(
                info(&q),
                info(&q),
                info(&q),
                info(&q),
                info(&q),
                info(&lse),
                &Options {
                    mask: Some(ArrayInfo::new(&mask_shape, mask)),
                    return_dmask: dmask,
                    ..Options::default()
                },
            )
        };
        assert!(backward("float32", true).unwrap().return_dmask);
        assert!(backward("bool", true)
            .unwrap_err()
            .to_string()
            .contains("boolean"));
        assert!(!backward("bool", false).unwrap().return_dmask);
    }

    /// `attention_varlen`'s arguments with `cu_seqlens` given as (dtype,
    /// entries); q `(total_q, 4, 8)`, k and v `(total_k, 2, 8)`.
    fn varlen(
        cu_q: (&str, &[i128]),
        cu_k: (&str, &[i128]),
        totals: (usize, usize),
        options: Options<'_>,
    ) -> Result<(Problem, crate::varlen::Segments)> {
        let (tq, tk) = totals;
        let (sq, sk) = ([cu_q.1.len()], [cu_k.1.len()]);
        validate_varlen_forward(
            ArrayInfo::new(&[tq, 4, 8], "float32"),
            ArrayInfo::new(&[tk, 2, 8], "float32"),
            ArrayInfo::new(&[tk, 2, 8], "float32"),
            SeqLens {
                info: ArrayInfo::new(&sq, cu_q.0),
                values: cu_q.1,
            },
            SeqLens {
                info: ArrayInfo::new(&sk, cu_k.0),
                values: cu_k.1,
            },
            &options,
        )
    }

    #[test]
    fn varlen_packs_the_batch_head_major() {
        let (p, s) = varlen(
            ("int32", &[0, 3, 3, 10]),
            ("uint64", &[0, 5, 6, 6]),
            (10, 6),
            Options::default(),
        )
        .unwrap();
        assert_eq!(
            (p.batch, p.heads_q, p.heads_kv, p.seq_q, p.seq_k, p.ndim),
            (1, 4, 2, 10, 6, 3)
        );
        assert_eq!(p.varlen.map(|v| v.sequences), Some(3));
        assert_eq!(p.varlen.map(|v| v.visible_pairs), Some(3 * 5));
        assert_eq!(s.cu_seqlens_k(), &[0, 5, 6, 6]);
        // A batch of no sequences at all.
        let (p, _) = varlen(("int64", &[0]), ("int64", &[0]), (0, 0), Options::default()).unwrap();
        assert_eq!((p.seq_q, p.seq_k, p.varlen.unwrap().sequences), (0, 0, 0));
    }

    #[test]
    fn varlen_errors_name_the_argument_and_the_entry() {
        let ok: &[i128] = &[0, 4, 10];
        let err = |cu_q: (&str, &[i128]), cu_k: (&str, &[i128]), totals| {
            varlen(cu_q, cu_k, totals, Options::default())
                .unwrap_err()
                .to_string()
        };
        let e = err(("int32", &[0, 12, 10]), ("int32", ok), (10, 10));
        assert!(
            e.contains("cu_seqlens_q[2] = 10 < cu_seqlens_q[1] = 12"),
            "{e}"
        );
        let e = err(("int32", ok), ("int32", &[1, 4, 10]), (10, 10));
        assert!(e.contains("cu_seqlens_k[0] = 1"), "{e}");
        let e = err(("int32", &[0, 4, 11]), ("int32", ok), (10, 10));
        assert!(
            e.contains("cu_seqlens_q[2] = 11") && e.contains("q holds 10 packed rows"),
            "{e}"
        );
        let e = err(("int32", ok), ("int32", &[0, 4, 9]), (10, 10));
        assert!(
            e.contains("cu_seqlens_k[2] = 9") && e.contains("k holds 10"),
            "{e}"
        );
        let e = err(("int32", ok), ("int32", &[0, 10]), (10, 10));
        assert!(
            e.contains("cu_seqlens_q has 3 entries (batch 2)")
                && e.contains("cu_seqlens_k has 2 (batch 1)"),
            "{e}"
        );
        match varlen(("float32", ok), ("int32", ok), (10, 10), Options::default()).unwrap_err() {
            Error::DType {
                argument, dtype, ..
            } => {
                assert_eq!(
                    (argument.as_str(), dtype.as_str()),
                    ("cu_seqlens_q", "float32")
                )
            }
            other => panic!("unexpected {other:?}"),
        }
        let e = err(("int32", &[]), ("int32", ok), (10, 10));
        assert!(e.contains("cu_seqlens_q has shape (0,)"), "{e}");
        // Packed shapes are reported as given.
        let e = validate_varlen_forward(
            ArrayInfo::new(&[10, 3, 8], "float32"),
            ArrayInfo::new(&[10, 2, 8], "float32"),
            ArrayInfo::new(&[10, 2, 8], "float32"),
            SeqLens {
                info: ArrayInfo::new(&[3], "int64"),
                values: ok,
            },
            SeqLens {
                info: ArrayInfo::new(&[3], "int64"),
                values: ok,
            },
            &Options::default(),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("(2) must divide") && e.contains("q (10, 3, 8)"),
            "{e}"
        );
        let e = validate_varlen_forward(
            ArrayInfo::new(&[2, 10, 3, 8], "float32"),
            ArrayInfo::new(&[10, 2, 8], "float32"),
            ArrayInfo::new(&[10, 2, 8], "float32"),
            SeqLens {
                info: ArrayInfo::new(&[3], "int64"),
                values: ok,
            },
            SeqLens {
                info: ArrayInfo::new(&[3], "int64"),
                values: ok,
            },
            &Options::default(),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("q has shape (2, 10, 3, 8)"), "{e}");
        // Per-sequence ALiBi slopes are (batch, heads_q), batch counting
        // sequences.
        let slopes = |shape: &[usize]| {
            varlen(
                ("int32", ok),
                ("int32", ok),
                (10, 10),
                Options {
                    alibi_slopes: Some(ArrayInfo::new(shape, "float32")),
                    ..Options::default()
                },
            )
        };
        assert_eq!(slopes(&[2, 4]).unwrap().0.alibi_per_batch, Some(true));
        assert_eq!(slopes(&[4]).unwrap().0.alibi_per_batch, Some(false));
        let e = slopes(&[1, 4]).unwrap_err().to_string();
        assert!(
            e.contains("alibi_slopes has shape (1, 4)") && e.contains("(2, 4)"),
            "{e}"
        );
    }

    #[test]
    fn varlen_backward_checks_the_packed_output_and_lse() {
        let ok: &[i128] = &[0, 4, 10];
        let lens = SeqLens {
            info: ArrayInfo::new(&[3], "int32"),
            values: ok,
        };
        let (q, kv) = ([10, 4, 8], [10, 2, 6]);
        let k = [10, 2, 8];
        let backward = |o: &[usize], lse: &[usize], lse_dtype: &str| {
            validate_varlen_backward(
                ArrayInfo::new(o, "float32"),
                ArrayInfo::new(&q, "float32"),
                ArrayInfo::new(&k, "float32"),
                ArrayInfo::new(&kv, "float32"),
                ArrayInfo::new(o, "float32"),
                ArrayInfo::new(lse, lse_dtype),
                lens,
                lens,
                &Options::default(),
            )
        };
        assert!(backward(&[10, 4, 6], &[4, 10], "float32").is_ok());
        let e = backward(&[4, 10, 6], &[4, 10], "float32")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("do has shape (4, 10, 6)") && e.contains("(10, 4, 6)"),
            "{e}"
        );
        let e = backward(&[10, 4, 6], &[10, 4], "float32")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("lse has shape (10, 4)") && e.contains("(4, 10)"),
            "{e}"
        );
        assert!(matches!(
            backward(&[10, 4, 6], &[4, 10], "float16").unwrap_err(),
            Error::DType { .. }
        ));
    }

    fn merge_err(outs: Parts<'_>, lses: Parts<'_>) -> String {
        validate_merge(outs, lses).unwrap_err().to_string()
    }

    #[test]
    fn merge_takes_stacked_or_separate_parts_of_any_leading_shape() {
        let (o, l) = ([2, 3, 5, 8], [2, 3, 5]);
        let outs = [ArrayInfo::new(&o, "float16"); 3];
        let lses = [ArrayInfo::new(&l, "float32"); 3];
        let each = validate_merge(Parts::Each(&outs), Parts::Each(&lses)).unwrap();
        assert_eq!((each.parts, each.rows, each.value_dim), (3, 30, 8));
        assert_eq!(
            (each.out_shape.clone(), each.lse_shape()),
            (o.to_vec(), l.to_vec())
        );
        let stacked = validate_merge(
            Parts::Stacked(ArrayInfo::new(&[3, 2, 3, 5, 8], "float16")),
            Parts::Stacked(ArrayInfo::new(&[3, 2, 3, 5], "float32")),
        )
        .unwrap();
        assert_eq!(stacked, each);
        // Mixed forms, and a part of just (seq_q, d_v).
        let p = validate_merge(
            Parts::Stacked(ArrayInfo::new(&[1, 4, 0], "float64")),
            Parts::Each(&[ArrayInfo::new(&[4], "float64")]),
        )
        .unwrap();
        assert_eq!((p.parts, p.rows, p.value_dim, p.out_len()), (1, 4, 0, 0));
    }

    #[test]
    fn merge_errors_name_the_part() {
        let (o, l) = ([4, 8], [4]);
        let out = ArrayInfo::new(&o, "float32");
        let lse = ArrayInfo::new(&l, "float32");
        let e = merge_err(Parts::Each(&[]), Parts::Each(&[]));
        assert!(e.contains("outs is an empty sequence"), "{e}");
        let e = merge_err(
            Parts::Stacked(ArrayInfo::new(&[0, 4, 8], "float32")),
            Parts::Stacked(ArrayInfo::new(&[0, 4], "float32")),
        );
        assert!(
            e.contains("outs has shape (0, 4, 8)") && e.contains("no parts"),
            "{e}"
        );
        let e = merge_err(Parts::Each(&[out, out]), Parts::Each(&[lse]));
        assert!(e.contains("outs has 2 parts but lses has 1"), "{e}");
        let odd = ArrayInfo::new(&[4, 9], "float32");
        let e = merge_err(Parts::Each(&[out, out, odd]), Parts::Each(&[lse; 3]));
        assert!(
            e.contains("outs[2] has shape (4, 9)") && e.contains("outs[0]"),
            "{e}"
        );
        let wide = ArrayInfo::new(&o, "float64");
        match validate_merge(Parts::Each(&[out, wide]), Parts::Each(&[lse; 2])).unwrap_err() {
            Error::DType { argument, .. } => assert_eq!(argument, "outs[1]"),
            other => panic!("unexpected {other:?}"),
        }
        let lse64 = ArrayInfo::new(&l, "float64");
        match validate_merge(Parts::Each(&[out; 2]), Parts::Each(&[lse, lse64])).unwrap_err() {
            Error::DType {
                argument, reason, ..
            } => {
                assert_eq!(argument, "lses[1]");
                assert!(reason.contains("float32"), "{reason}");
            }
            other => panic!("unexpected {other:?}"),
        }
        let short = ArrayInfo::new(&[3], "float32");
        let e = merge_err(Parts::Each(&[out]), Parts::Each(&[short]));
        assert!(
            e.contains("lses[0] has shape (3,)") && e.contains("(4,)"),
            "{e}"
        );
        let e = merge_err(
            Parts::Stacked(ArrayInfo::new(&[2, 8], "float32")),
            Parts::Stacked(ArrayInfo::new(&[2], "float32")),
        );
        assert!(e.contains("(parts, ..., seq_q, d_v)"), "{e}");
        let e = merge_err(
            Parts::Each(&[ArrayInfo::new(&o, "int32")]),
            Parts::Each(&[lse]),
        );
        assert!(e.contains("outs[0] has dtype int32"), "{e}");
    }
}

#[cfg(test)]
mod kvcache_tests {
    use super::*;

    const Q: [usize; 4] = [2, 8, 1, 16];

    fn ints<'a>(shape: &'a [usize], values: &'a [i64]) -> IntArray<'a> {
        IntArray {
            shape,
            dtype: "int32",
            values,
        }
    }

    fn paged(cache: &[usize], lens: &[i64], table: IntArray<'_>) -> Result<KvCacheProblem> {
        validate_kvcache(
            ArrayInfo::new(&Q, "float32"),
            ArrayInfo::new(cache, "float32"),
            ArrayInfo::new(cache, "float32"),
            ints(&[2], lens),
            Some(table),
            &KvCacheOptions::default(),
        )
    }

    fn contiguous(
        cache: &[usize],
        lens: &[i64],
        options: KvCacheOptions<'_>,
    ) -> Result<KvCacheProblem> {
        validate_kvcache(
            ArrayInfo::new(&Q, "float32"),
            ArrayInfo::new(cache, "float32"),
            ArrayInfo::new(cache, "float32"),
            ints(&[2], lens),
            None,
            &options,
        )
    }

    fn value_argument(e: Error) -> (String, String) {
        match e {
            Error::Value {
                argument, value, ..
            } => (argument, value),
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn paged_rows_follow_the_table_and_unread_entries_may_be_anything() {
        let cache = [10, 2, 3, 16];
        // Sequence 0 has 7 keys (blocks 4, 9, 0); sequence 1 has 2 keys in
        // block 4 (shared) and -1 padding after.
        let table = [4, 9, 0, 5, 4, -1, -1, 77];
        let p = paged(&cache, &[7, 2], ints(&[2, 4], &table)).unwrap();
        assert_eq!(
            (p.block_size(), p.cache_blocks(), p.cache_rows()),
            (3, 10, 60)
        );
        // Key 4 of sequence 0 is in block 9 at offset 1, head 1.
        assert_eq!(p.cache_row(0, 1, 4), (9 * 2 + 1) * 3 + 1);
        assert_eq!(p.cache_row(1, 0, 1), (4 * 2) * 3 + 1);
        assert_eq!(p.keys_read(0), 0..7);
        assert_eq!(p.sequence(1).q_offset, 1);
    }

    #[test]
    fn bad_entries_and_lengths_are_named() {
        let cache = [10, 2, 3, 16];
        let e = paged(&cache, &[7, 2], ints(&[2, 4], &[4, 13, 0, 0, 0, 0, 0, 0])).unwrap_err();
        assert_eq!(value_argument(e), ("block_table[0, 1]".into(), "13".into()));
        let e = paged(&cache, &[7, 2], ints(&[2, 4], &[4, 1, 0, 0, -1, 0, 0, 0])).unwrap_err();
        assert_eq!(value_argument(e), ("block_table[1, 0]".into(), "-1".into()));
        let e = paged(&cache, &[13, 2], ints(&[2, 4], &[0; 8])).unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, Error::Shape(_)), "{msg}");
        assert!(
            msg.contains("block_table has shape (2, 4)") && msg.contains("cache_seqlens[0] = 13"),
            "{msg}"
        );
        let e = paged(&cache, &[1, -3], ints(&[2, 4], &[0; 8])).unwrap_err();
        assert_eq!(value_argument(e), ("cache_seqlens[1]".into(), "-3".into()));
        let e = contiguous(&[2, 2, 5, 16], &[5, 6], KvCacheOptions::default()).unwrap_err();
        assert_eq!(value_argument(e), ("cache_seqlens[1]".into(), "6".into()));
        let float_table = IntArray {
            shape: &[2, 4],
            dtype: "float32",
            values: &[],
        };
        match paged(&cache, &[1, 1], float_table).unwrap_err() {
            Error::DType { argument, .. } => assert_eq!(argument, "block_table"),
            other => panic!("unexpected {other:?}"),
        }
        let e = paged(&cache, &[1, 1], ints(&[3, 4], &[0; 12])).unwrap_err();
        assert!(
            e.to_string().contains("block_table has shape (3, 4)"),
            "{e}"
        );
    }

    #[test]
    fn shapes_dtypes_and_options_are_checked_by_name() {
        let e = contiguous(&[3, 2, 5, 16], &[1, 1], KvCacheOptions::default()).unwrap_err();
        assert!(
            e.to_string()
                .contains("k_cache has 3 sequences but q has 2"),
            "{e}"
        );
        let e = contiguous(&[2, 3, 5, 16], &[1, 1], KvCacheOptions::default()).unwrap_err();
        assert!(e.to_string().contains("(3) must divide"), "{e}");
        let e = contiguous(&[2, 2, 5, 8], &[1, 1], KvCacheOptions::default()).unwrap_err();
        assert!(e.to_string().contains("k_cache: 8"), "{e}");
        let e = validate_kvcache(
            ArrayInfo::new(&Q, "float32"),
            ArrayInfo::new(&[2, 2, 5, 16], "float16"),
            ArrayInfo::new(&[2, 2, 5, 16], "float16"),
            ints(&[2], &[1, 1]),
            None,
            &KvCacheOptions::default(),
        )
        .unwrap_err();
        assert!(matches!(e, Error::DType { ref argument, .. } if argument == "k_cache"));
        for n in [0, -1, MAX_SPLITS as i128 + 1] {
            let options = KvCacheOptions {
                num_splits: Some(n),
                ..KvCacheOptions::default()
            };
            let e = contiguous(&[2, 2, 5, 16], &[1, 1], options).unwrap_err();
            assert_eq!(value_argument(e).0, "num_splits");
        }
        let options = KvCacheOptions {
            window: Some((-3, 0)),
            ..KvCacheOptions::default()
        };
        let e = contiguous(&[2, 2, 5, 16], &[1, 1], options).unwrap_err();
        assert_eq!(value_argument(e).0, "window");
    }

    #[test]
    fn positions_are_bottom_right_against_each_length() {
        let q = [2, 2, 3, 4];
        let options = KvCacheOptions {
            causal: true,
            window: Some((1, -1)),
            ..KvCacheOptions::default()
        };
        let p = validate_kvcache(
            ArrayInfo::new(&q, "float64"),
            ArrayInfo::new(&[2, 1, 8, 4], "float64"),
            ArrayInfo::new(&[2, 1, 8, 4], "float64"),
            ints(&[2], &[8, 2]),
            None,
            &options,
        )
        .unwrap();
        // Rows at 5, 6, 7 of 8 keys: each sees itself and one before.
        let s = p.sequence(0);
        assert_eq!(
            (0..3).map(|i| s.visible_keys(i)).collect::<Vec<_>>(),
            vec![4..6, 5..7, 6..8]
        );
        assert_eq!(p.keys_read(0), 4..8);
        // Rows at -1, 0, 1 of 2 keys: the first sees nothing.
        let s = p.sequence(1);
        assert_eq!(
            (0..3).map(|i| s.visible_keys(i)).collect::<Vec<_>>(),
            vec![0..0, 0..1, 0..2]
        );
        assert_eq!(p.keys_read(1), 0..2);
    }
}
