//! Validation of `attention_varlen` and its backward: packed sequences
//! described by cumulative lengths, and the [`Segments`] it makes of
//! them, which give each packed row its visible keys (both backends' tile
//! loops read them; see `crate::varlen` for the packed layout).

use std::ops::Range;

use super::*;

/// A packed batch of variable-length sequences, flash-attn's varlen layout:
/// the [`Problem`] is the whole batch packed as one (`batch = 1`, `seq_q =
/// total_q`, `seq_k = total_k`, head-major as the kernels take it), and
/// [`Segments`] (from `cu_seqlens_q` and `cu_seqlens_k`)
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

/// Where each sequence of a packed batch lies: its rows `cu_q[b]..cu_q[b +
/// 1]` and keys `cu_k[b]..cu_k[b + 1]` (validated prefix sums, see
/// [`validate_varlen_forward`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Segments {
    cu_q: Vec<usize>,
    cu_k: Vec<usize>,
}

/// The rows of one sequence and its keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sequence {
    pub rows: Range<usize>,
    pub keys: Range<usize>,
}

impl Segments {
    /// From validated prefix sums (same length, from 0, non-decreasing).
    pub(crate) fn new(cu_q: Vec<usize>, cu_k: Vec<usize>) -> Self {
        debug_assert!(cu_q.len() == cu_k.len() && !cu_q.is_empty());
        Segments { cu_q, cu_k }
    }

    pub fn sequences(&self) -> usize {
        self.cu_q.len() - 1
    }

    pub fn cu_seqlens_q(&self) -> &[usize] {
        &self.cu_q
    }

    pub fn cu_seqlens_k(&self) -> &[usize] {
        &self.cu_k
    }

    pub fn sequence(&self, b: usize) -> Sequence {
        Sequence {
            rows: self.cu_q[b]..self.cu_q[b + 1],
            keys: self.cu_k[b]..self.cu_k[b + 1],
        }
    }

    /// The sequence that packed row `row` belongs to (empty sequences own
    /// no row).
    pub fn sequence_of_row(&self, row: usize) -> usize {
        self.cu_q.partition_point(|&c| c <= row) - 1
    }

    /// Sequence `b` as a problem of its own: `p`'s heads, dimensions and
    /// variants, its own lengths and the default (bottom-right) positions.
    fn local(&self, p: &Problem, b: usize) -> Problem {
        let s = self.sequence(b);
        let (seq_q, seq_k) = (s.rows.len(), s.keys.len());
        Problem {
            seq_q,
            seq_k,
            q_offset: seq_k as i64 - seq_q as i64,
            k_offset: 0,
            varlen: None,
            ..*p
        }
    }

    /// Where the diagonal of sequence `b`'s rows lies: row `r` is at the
    /// position of key `r + diagonal(b)` (`cu_k[b + 1] - cu_q[b + 1]`, the
    /// bottom-right alignment within the sequence). ALiBi measures
    /// `|r + diagonal(b) - j|`, the distance within the sequence.
    pub fn diagonal(&self, b: usize) -> i64 {
        self.cu_k[b + 1] as i64 - self.cu_q[b + 1] as i64
    }

    /// The keys packed row `row` sees (causal and the window within its
    /// sequence), as packed key indices: a subrange of its sequence's keys.
    pub fn visible_keys(&self, p: &Problem, row: usize) -> Range<usize> {
        let b = self.sequence_of_row(row);
        let start = self.cu_q[b];
        let local = self.local(p, b).visible_keys(row - start);
        self.cu_k[b] + local.start..self.cu_k[b] + local.end
    }

    /// Every row's visible keys and sequence, computed once per call. Both
    /// ends of the ranges are non-decreasing in the row, across sequences
    /// too: a sequence's keys all lie before the next one's.
    pub fn rows(&self, p: &Problem) -> RowTable {
        let total = self.cu_q[self.sequences()];
        let mut table = RowTable {
            visible: Vec::with_capacity(total),
            sequence: Vec::with_capacity(total),
        };
        for b in 0..self.sequences() {
            let s = self.sequence(b);
            let local = self.local(p, b);
            for i in 0..s.rows.len() {
                let keys = local.visible_keys(i);
                table
                    .visible
                    .push(s.keys.start + keys.start..s.keys.start + keys.end);
                table.sequence.push(b);
            }
        }
        table
    }

    /// The (query, key) pairs the rows see, per head: what the work of a
    /// call follows.
    pub fn visible_pairs(&self, p: &Problem) -> u64 {
        (0..self.sequences())
            .map(|b| {
                let local = self.local(p, b);
                if local.has_range_mask() {
                    (0..local.seq_q)
                        .map(|i| local.visible_keys(i).len() as u64)
                        .sum()
                } else {
                    (local.seq_q * local.seq_k) as u64
                }
            })
            .sum()
    }

    pub(crate) fn check(&self, p: &Problem) -> Result<()> {
        let fits = p.varlen.map(|v| v.sequences) == Some(self.sequences())
            && self.cu_q.last() == Some(&p.seq_q)
            && self.cu_k.last() == Some(&p.seq_k)
            && p.batch == 1;
        if fits {
            Ok(())
        } else {
            Err(Error::Shape(
                "the segments do not match the validated problem".to_string(),
            ))
        }
    }
}

/// Each packed row's visible keys and sequence ([`Segments::rows`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowTable {
    pub visible: Vec<Range<usize>>,
    pub sequence: Vec<usize>,
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
) -> Result<(Problem, Segments)> {
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
    let variants = &options.variants;
    for (name, given) in [
        ("mask", variants.mask.is_some()),
        ("q_offset", variants.q_offset.is_some()),
        ("k_offset", variants.k_offset.is_some()),
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
            variants: VariantOptions {
                alibi_slopes: None,
                ..*variants
            },
            ..*options
        },
    )?;
    let sequences = cu_q.len() - 1;
    if let Some(slopes) = variants.alibi_slopes {
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
    let segments = Segments::new(cu_q, cu_k);
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
) -> Result<(Problem, Segments)> {
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
