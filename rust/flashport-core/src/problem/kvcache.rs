//! Validation of `attention_with_kvcache`: the query, a contiguous or
//! paged cache, the lengths and the block table.

use super::*;

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
/// `b` is at `cache_seqlens[b] - seq_q + i`, its keys at `0..len`; so
/// `causal` is bottom-right against each sequence's cached length, the
/// window is `(left, right)` around each row's position, and the
/// variants' mask, dropout and positions are refused.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct KvCacheOptions<'a> {
    pub variants: VariantOptions<'a>,
    /// Key splits per sequence (Flash-Decoding); `None` lets the backend
    /// choose from the shape.
    pub num_splits: Option<i128>,
}

/// The KV cache's options with only the variants given.
impl<'a> From<VariantOptions<'a>> for KvCacheOptions<'a> {
    fn from(variants: VariantOptions<'a>) -> Self {
        KvCacheOptions {
            variants,
            num_splits: None,
        }
    }
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
    let variants = &options.variants;
    let scale = checked_scale(variants.scale, d, dtype)?;
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
    let sizes = Sizes {
        batch,
        heads_q,
        heads_kv,
        seq_q,
        seq_k: 0,
        head_dim: d,
        value_dim: dv,
        dtype,
        ndim: 4,
    };
    let mut attention = sizes.problem(scale, variants.causal, -(seq_q as i64), 0);
    // The lengths are the mask and the positions, and decoding is
    // inference: the variants' other keywords have no meaning here.
    for (name, given) in [
        ("mask", variants.mask.is_some()),
        ("dropout_p", variants.dropout_p != 0.0),
        ("seed", variants.seed.is_some()),
        ("q_offset", variants.q_offset.is_some()),
        ("k_offset", variants.k_offset.is_some()),
    ] {
        if given {
            return Err(value_error(
                name,
                "given",
                "attention_with_kvcache takes no mask, dropout or positions (the cached \
                 lengths are the mask and the positions)",
            ));
        }
    }
    // The variants mean here what they mean for attention: the same
    // checks and messages.
    validate_variants(&mut attention, variants)?;
    Ok(KvCacheProblem {
        attention,
        layout,
        seqlens,
        num_splits,
    })
}
