//! The variant keywords: as every operation takes them
//! ([`VariantOptions`]), what a validated [`Problem`] records of them, and
//! their validation, the same for every operation (see
//! [`crate::variants`] for what each computes).

use super::*;

/// The variant and position keywords as the caller gave them: one value,
/// embedded in every operation's options ([`Options`] of attention, its
/// backward and varlen; [`KvCacheOptions`]), so that a keyword is declared,
/// converted and validated ([`validate_variants`]) once. An operation
/// refuses a keyword it does not take (varlen: the mask and positions; the
/// KV cache: those and dropout), so none is dropped unseen.
///
/// The score of query row `i` and key `j` is built in this order (see
/// [`crate::variants`] for the full definition):
/// `u = scale·q_i·k_j`, `t = softcap·tanh(u/softcap)`,
/// `s = t + alibi + mask`, then `-inf` where causal, the window or a
/// boolean mask hides the key.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct VariantOptions<'a> {
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

impl Problem {
    /// Whether anything beyond plain (causal) attention is asked for.
    pub fn has_variants(&self) -> bool {
        !self.variant_names().is_empty()
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
}

/// A float dtype for an optional parameter array (slopes, sinks).
pub(super) fn float_parameter(argument: &str, info: &ArrayInfo<'_>) -> Result<DType> {
    DType::from_numpy_name(info.dtype).ok_or_else(|| Error::DType {
        argument: argument.to_string(),
        dtype: info.dtype.to_string(),
        reason: "expected float16, bfloat16, float32 or float64".to_string(),
    })
}

/// Checks the variant keywords against the validated shapes and records
/// them in the problem (scale, causal and the positions are recorded by
/// [`Sizes::problem`], which every operation's validation starts from).
pub(super) fn validate_variants(problem: &mut Problem, options: &VariantOptions<'_>) -> Result<()> {
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
