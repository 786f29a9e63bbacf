//! A paged KV cache for generation: a preallocated pool of blocks, block
//! tables, reference-counted sharing with copy-on-write, and prefix reuse
//! (PagedAttention's memory manager, with vLLM's block-pool conventions).
//!
//! # Blocks and layers
//!
//! The pool has `num_blocks` blocks of `block_size` token slots. A block is
//! one slot range in **every** layer's pools at once: block `b` is
//! `k_pool[l][b]` and `v_pool[l][b]` for every layer `l`, each pool in the
//! paged layout of `attention_with_kvcache`, `(num_blocks, heads_kv,
//! block_size, head_dim)` (values: `head_dim_v`). A sequence therefore has
//! one block table for all layers (as vLLM's per-layer KV tensors share
//! one), and each layer its own *length*: the positions appended on that
//! layer. A model's forward over new tokens does, for each layer `l`,
//! `append(sid, k_l, v_l, layer = l)` and then attention of the layer's
//! queries over that layer's length. The first append that reaches past
//! the sequence's blocks (on whichever layer) allocates the new blocks for
//! all layers; the other layers' appends then find them. The length of a
//! sequence is the positions written on every layer (the least of its
//! layers' lengths).
//!
//! # Sharing
//!
//! Every block has a reference count: the number of sequences whose table
//! holds it. Free blocks (count 0) wait in a queue: freed blocks join its
//! back, allocation takes its front, so the order is deterministic and the
//! least recently freed block is taken first.
//!
//! * `fork` gives a new sequence the same table, the partly filled last
//!   block included; every count goes up by one. It needs no free block.
//! * `free` counts each block down (last block first); a block at 0 joins
//!   the free queue.
//! * **Copy-on-write:** an append that writes into a block whose count is
//!   above 1 first copies the block, all layers of it, into a fresh block,
//!   which replaces it in the appending sequence's table (the original's
//!   count goes down). No sequence ever sees another's tokens: a position
//!   is written only in a block its sequence holds alone (or one of the
//!   cached blocks below, which are never written).
//! * **Prefix reuse** (vLLM's prefix caching), for appends given the
//!   `tokens` of their positions: a sequence's block `i` is identified by
//!   the hash chained over its prefix, `h_i = H(h_{i-1}, tokens of block
//!   i)`, rooted in the cache's identity ([`crate::blocks::hash`]). Once a block is full
//!   on every layer and its tokens are known, it is *cached*: its hash
//!   maps to it (unless another block already holds that prefix; the
//!   later one stays an uncached duplicate, as in vLLM). An append that
//!   reaches a new block whose whole token range it covers, with tokens
//!   known from position 0 through that block, looks the hash up; on a hit
//!   the sequence adopts the cached block (count up; out of the free queue
//!   if it was free) instead of a fresh one, and no position of it is
//!   written, on this layer or any later one. A cached block is never
//!   written again: it holds every layer's keys and values of that prefix.
//!   A freed cached block keeps its hash in the free queue and can be
//!   adopted until the allocator takes it for fresh data (evicting the
//!   hash; least recently freed first).
//!
//! What is shared: full blocks with the same whole prefix of tokens (any
//! sequences, at the same positions), and after a fork every block until
//! one side writes into it. What is not: a partly filled block except
//! between a sequence and its forks (until the first write), blocks of
//! appends without tokens, and a block whose prefix was cached by another
//! block when it filled. Prefix reuse trusts, as vLLM does, that the same
//! tokens at the same positions give the same keys and values on every
//! layer (the same model, weights and position encoding): the keys and
//! values an append gives for positions of an adopted block are not
//! compared, they are skipped.
//!
//! Tokens: an append's `tokens` are the token ids of its positions. They
//! may be given on any layer's append (the first layer's, or every
//! layer's); positions whose tokens are known must get the same ones
//! again, and tokens can only extend the known tokens contiguously from
//! position 0 (after positions appended without tokens on every layer, a
//! sequence's later tokens are refused). A fork inherits its parent's
//! tokens.
//!
//! # Errors lose nothing
//!
//! Every mutating call checks its arguments (unknown or freed sequence
//! ids, layer range, shapes and dtypes, tokens) and plans its whole work
//! (blocks taken, adopted and copied) before changing anything; an append
//! that needs more free blocks than there are fails with
//! [`Error::CacheFull`] and leaves the cache, its counts and every
//! sequence as they were.
//!
//! # Swapping
//!
//! A cache made with `swap_blocks > 0` has a swap space in host memory
//! ([`swap_space`], a budget of its own on every device) for a scheduler
//! that preempts sequences by swapping (PagedAttention's, vLLM's CPU swap
//! space). [`KvCache::swap_out`] of a group of sequences (a request's forks
//! together) copies each distinct block they hold to a host block once (one
//! storage read), then they leave the pool as `free` leaves it (blocks at 0
//! join the free queue; cached ones stay adoptable). [`KvCache::swap_in`]
//! takes a fresh block for each distinct host block (one storage write) and
//! gives the sequences back their tables over them, every value, length,
//! token and hash as before; their full blocks are offered to the prefix
//! cache again. A block shared with a sequence that stays in the pool keeps
//! serving that one and is copied for the swapped one, which comes back
//! with its own copy. Swapped sequences can be swapped in, freed and
//! measured; everything else refuses them by name. Either direction plans
//! first and fails with [`Error::CacheFull`] having changed nothing.
//!
//! # Batches
//!
//! [`KvCache::append_batch`] appends to several sequences in one call (a
//! decode step of a batch, one call per layer): the same as separate
//! appends in the batch's order, in one storage write
//! ([`crate::blocks::batch`]). A
//! failure of any row leaves the whole cache as it was.

pub mod cpu_storage;
pub mod swap_space;

// The blocks' bookkeeping and the storage contract live a floor down, in
// `crate::blocks`, where the GPU's storage implements the contract; the
// cache's constructor arguments and parts keep their paths here.
pub use crate::blocks::{BlockManager, CacheArgs, CacheShape, Sequence, Storage};

use crate::array::{Buffer, Input, Placement};
use crate::blocks::batch::{Batch, Row};
use crate::device::Device;
use crate::error::{shape_str, Error, Result};
use crate::output::ForwardOutput;
use crate::problem::{
    validate_kvcache, ArrayInfo, DType, IntArray, KvCacheOptions, KvCacheProblem,
};
use crate::variants::VariantArrays;
use cpu_storage::CpuStorage;
use swap_space::SwapSpace;

/// A KV cache: the bookkeeping and the storage of its blocks.
#[derive(Debug)]
pub struct KvCache {
    shape: CacheShape,
    manager: BlockManager,
    storage: Box<dyn Storage>,
    swap: SwapSpace,
}

/// An array argument: its shape and dtype name, and its data.
#[derive(Debug, Clone, Copy)]
pub struct ArrayArg<'a> {
    pub info: ArrayInfo<'a>,
    pub data: Input<'a>,
}

fn integer_dtype(dtype: &str) -> bool {
    matches!(
        dtype,
        "int8" | "int16" | "int32" | "int64" | "uint8" | "uint16" | "uint32" | "uint64"
    )
}

impl KvCache {
    /// A cache with every block free, its pools allocated on `device`
    /// (`None` and `"auto"` follow [`Device::parse`]: the CPU unless
    /// `FLASHPORT_DEVICE` says otherwise).
    pub fn new(args: &CacheArgs<'_>, device: Option<&str>) -> Result<KvCache> {
        let shape = CacheShape::new(args)?;
        let swap = SwapSpace::new(shape)?;
        let storage: Box<dyn Storage> = match Device::parse(device)? {
            Device::Cpu | Device::Auto => Box::new(CpuStorage::new(shape)?),
            Device::Gpu(gpu) => Box::new(crate::gpu::GpuStorage::new(gpu, shape)?),
        };
        Ok(KvCache {
            shape,
            manager: BlockManager::new(shape.identity(), shape.num_blocks, shape.swap_blocks),
            storage,
            swap,
        })
    }

    pub fn shape(&self) -> &CacheShape {
        &self.shape
    }

    /// `"cpu"` or `"gpu:N"`: where the pools live.
    pub fn device(&self) -> String {
        self.storage.device()
    }

    /// The bookkeeping, for queries: counts, the free queue, sequences.
    pub fn manager(&self) -> &BlockManager {
        &self.manager
    }

    pub fn new_sequence(&mut self) -> u64 {
        self.manager.new_sequence()
    }

    /// See [`BlockManager::fork`].
    pub fn fork(&mut self, sid: i64) -> Result<u64> {
        self.manager.fork(sid)
    }

    /// See [`BlockManager::free`].
    pub fn free(&mut self, sid: i64) -> Result<()> {
        self.manager.free(sid)
    }

    /// Swaps sequences `seq_ids` out of the pools together, into the swap
    /// space: each distinct block they hold is copied to a host block once
    /// (in one storage read), then they leave the pools as `free` would
    /// leave them (blocks at 0 join the free queue). Fails with
    /// [`Error::CacheFull`] when the swap space has too few free blocks,
    /// and changes nothing on any error.
    pub fn swap_out(&mut self, seq_ids: &[i64]) -> Result<()> {
        let plan = self.manager.plan_swap_out(seq_ids)?;
        if !plan.moves.is_empty() {
            let data = self.storage.read_blocks(&plan.pool_blocks())?;
            self.swap.store(&plan.host_blocks(), &data);
        }
        self.manager.commit_swap_out(&plan);
        Ok(())
    }

    /// Swaps sequences `seq_ids` back into the pools: a fresh block for
    /// each distinct host block they hold, written in one storage write;
    /// every value, length, token and hash is as before the swap-out.
    /// Fails with [`Error::CacheFull`] when the pool has too few free
    /// blocks, and changes nothing on any error.
    pub fn swap_in(&mut self, seq_ids: &[i64]) -> Result<()> {
        let plan = self.manager.plan_swap_in(seq_ids)?;
        if !plan.moves.is_empty() {
            let data = self.swap.load(&plan.host_blocks())?;
            if let Err(e) = self.storage.write_blocks(&plan.pool_blocks(), &data) {
                self.manager.abandon_swap_in(&plan);
                return Err(e);
            }
        }
        self.manager.commit_swap_in(&plan);
        Ok(())
    }

    /// Whether sequence `sid` is swapped out.
    pub fn is_swapped(&self, sid: i64) -> Result<bool> {
        self.manager.is_swapped("sid", sid)
    }

    /// Positions written on `layer`, or on every layer when `None` (of a
    /// sequence in the pools or swapped out).
    pub fn length(&self, sid: i64, layer: Option<i64>) -> Result<usize> {
        let seq = self.manager.any_sequence("sid", sid)?;
        match layer {
            None => Ok(seq.length()),
            Some(l) => Ok(seq.lengths[self.manager.check_layer(l)?]),
        }
    }

    /// The sequences' blocks, row-major `(seq_ids.len(), width)` with
    /// `width` the most blocks any of them holds, padded with -1.
    pub fn block_table(&self, seq_ids: &[i64]) -> Result<(Vec<i64>, usize)> {
        let seqs = self.sequences(seq_ids)?;
        let width = seqs.iter().map(|s| s.blocks.len()).max().unwrap_or(0);
        let mut table = vec![-1i64; seqs.len() * width];
        for (row, seq) in seqs.iter().enumerate() {
            for (i, &b) in seq.blocks.iter().enumerate() {
                table[row * width + i] = b as i64;
            }
        }
        Ok((table, width))
    }

    fn sequences(&self, seq_ids: &[i64]) -> Result<Vec<&Sequence>> {
        seq_ids
            .iter()
            .enumerate()
            .map(|(i, &id)| self.manager.sequence_named(|| format!("seq_ids[{i}]"), id))
            .collect()
    }

    /// Checks `k` or `v` (by `argument`): `(heads_kv, n, dim)`, or with
    /// `batch` rows `(batch, heads_kv, n, dim)`, in the cache's dtype.
    /// Returns `n`.
    fn check_array(
        &self,
        argument: &str,
        arg: &ArrayArg<'_>,
        batch: Option<usize>,
    ) -> Result<usize> {
        let s = self.shape;
        let dtype = s.dtype.numpy_name();
        let (dim, dim_name) = if argument == "k" {
            (s.head_dim, "head_dim")
        } else {
            (s.head_dim_v, "head_dim_v")
        };
        let want = match batch {
            None => vec![Some(s.heads_kv), None, Some(dim)],
            Some(b) => vec![Some(b), Some(s.heads_kv), None, Some(dim)],
        };
        let expected = || match batch {
            None => format!("(heads_kv, n, {dim_name}) = ({}, n, {dim})", s.heads_kv),
            Some(b) => format!(
                "(len(seq_ids), heads_kv, n, {dim_name}) = ({b}, {}, n, {dim})",
                s.heads_kv
            ),
        };
        let shape = arg.info.shape;
        let fits = shape.len() == want.len()
            && want
                .iter()
                .zip(shape)
                .all(|(want, &got)| want.is_none_or(|w| w == got));
        if !fits {
            return Err(Error::Shape(format!(
                "{argument} has shape {}; expected {}",
                shape_str(shape),
                expected()
            )));
        }
        if arg.info.dtype != dtype {
            return Err(Error::DType {
                argument: argument.to_string(),
                dtype: arg.info.dtype.to_string(),
                reason: format!("the cache holds {dtype}"),
            });
        }
        let len: usize = shape.iter().product();
        if arg.data.len() != len || arg.data.dtype() != s.dtype {
            return Err(Error::Shape(format!(
                "{argument} holds {} {} elements but its shape {} needs {len} {dtype}",
                arg.data.len(),
                arg.data.dtype().numpy_name(),
                shape_str(shape)
            )));
        }
        Ok(shape[shape.len() - 2])
    }

    /// Checks `k` and `v` (see [`Self::check_array`]) and that they hold
    /// the same number of positions `n`, which it returns.
    fn check_kv(&self, k: &ArrayArg<'_>, v: &ArrayArg<'_>, batch: Option<usize>) -> Result<usize> {
        let n = self.check_array("k", k, batch)?;
        let nv = self.check_array("v", v, batch)?;
        if nv != n {
            return Err(Error::Shape(format!(
                "k holds {n} positions but v holds {nv}; got k {}, v {}",
                shape_str(k.info.shape),
                shape_str(v.info.shape)
            )));
        }
        Ok(n)
    }

    /// Checks `tokens`: integer token ids of shape `want` (one per
    /// appended position).
    fn check_tokens(tokens: &IntArray<'_>, want: &[usize]) -> Result<()> {
        if !integer_dtype(tokens.dtype) {
            return Err(Error::DType {
                argument: "tokens".to_string(),
                dtype: tokens.dtype.to_string(),
                reason: "expected integer token ids".to_string(),
            });
        }
        if tokens.shape != want || tokens.values.len() != want.iter().product::<usize>() {
            return Err(Error::Shape(format!(
                "tokens has shape {}; expected one token id per appended position, {}",
                shape_str(tokens.shape),
                shape_str(want)
            )));
        }
        Ok(())
    }

    /// Appends the keys `k` `(heads_kv, n, head_dim)` and values `v`
    /// `(heads_kv, n, head_dim_v)` of `n` new positions to `layer` of
    /// sequence `sid`, with the positions' token ids if given. Validates
    /// and plans everything first: on any error (including
    /// [`Error::CacheFull`]) nothing has changed.
    pub fn append(
        &mut self,
        sid: i64,
        layer: i64,
        k: ArrayArg<'_>,
        v: ArrayArg<'_>,
        tokens: Option<IntArray<'_>>,
    ) -> Result<()> {
        self.manager.sequence("sid", sid)?;
        let layer = self.manager.check_layer(layer)?;
        let n = self.check_kv(&k, &v, None)?;
        if let Some(t) = &tokens {
            Self::check_tokens(t, &[n])?;
        }
        let row = Row {
            sid,
            tokens: tokens.map(|t| t.values),
        };
        self.store(layer, n, &[row], false, k.data, v.data)
    }

    /// Appends `n` new positions to `layer` of each sequence of `seq_ids`
    /// at once (a decode step of a batch: `n = 1`): `k` is `(len(seq_ids),
    /// heads_kv, n, head_dim)` and `v` `(len(seq_ids), heads_kv, n,
    /// head_dim_v)`, row `r` for sequence `seq_ids[r]`, and `tokens`, if
    /// given, `(len(seq_ids), n)`. The same as [`Self::append`] of each row
    /// in order, bit for bit and block for block (copy-on-write and prefix
    /// reuse included), in one storage write. A sequence may appear only
    /// once. Validates and plans every row first: on any error (including
    /// [`Error::CacheFull`] for any row) nothing has changed.
    pub fn append_batch(
        &mut self,
        seq_ids: &[i64],
        layer: i64,
        k: ArrayArg<'_>,
        v: ArrayArg<'_>,
        tokens: Option<IntArray<'_>>,
    ) -> Result<()> {
        self.sequences(seq_ids)?;
        let mut seen = std::collections::HashMap::with_capacity(seq_ids.len());
        for (r, &sid) in seq_ids.iter().enumerate() {
            if let Some(first) = seen.insert(sid, r) {
                return Err(Error::Value {
                    argument: format!("seq_ids[{r}]"),
                    value: sid.to_string(),
                    reason: format!(
                        "sequence {sid} is also seq_ids[{first}]; a batch appends to each \
                         sequence once (append all its positions in one row)"
                    ),
                });
            }
        }
        let layer = self.manager.check_layer(layer)?;
        let batch = seq_ids.len();
        let n = self.check_kv(&k, &v, Some(batch))?;
        if let Some(t) = &tokens {
            Self::check_tokens(t, &[batch, n])?;
        }
        let rows: Vec<Row<'_>> = seq_ids
            .iter()
            .enumerate()
            .map(|(r, &sid)| Row {
                sid,
                tokens: tokens.map(|t| &t.values[r * n..(r + 1) * n]),
            })
            .collect();
        self.store(layer, n, &rows, true, k.data, v.data)
    }

    /// Commits the rows' appends (see [`Batch`]), then has the storage copy
    /// and write them; if the storage fails, the bookkeeping is rolled
    /// back (and the taken blocks' cached prefixes forgotten).
    fn store(
        &mut self,
        layer: usize,
        n: usize,
        rows: &[Row<'_>],
        named: bool,
        k: Input<'_>,
        v: Input<'_>,
    ) -> Result<()> {
        let batch = Batch::commit(&mut self.manager, layer, n, rows, named)?;
        let stored = self
            .storage
            .append(layer, n, &batch.copies(), &batch.writes(), k, v);
        if let Err(e) = stored {
            batch.abandon(&mut self.manager);
            return Err(e);
        }
        Ok(())
    }

    /// Attention of `q` `(seq_ids.len(), heads_q, seq_q, head_dim)` over
    /// `layer` of the sequences `seq_ids` (query row `i` of a sequence at
    /// position `length - seq_q + i` of that layer, as
    /// `attention_with_kvcache` with the sequences' block table), on the
    /// pools where they are. Returns the outputs and the problem (for its
    /// output shapes).
    pub fn attention(
        &self,
        q: ArrayArg<'_>,
        seq_ids: &[i64],
        layer: i64,
        options: &KvCacheOptions<'_>,
        variants: &VariantArrays<'_>,
        outputs: Placement,
    ) -> Result<(ForwardOutput<crate::array::Array>, KvCacheProblem)> {
        let layer = self.manager.check_layer(layer)?;
        let seqs = self.sequences(seq_ids)?;
        let s = self.shape;
        let shape = q.info.shape;
        if shape.len() != 4 || shape[0] != seq_ids.len() || shape[3] != s.head_dim {
            return Err(Error::Shape(format!(
                "q has shape {}; expected (len(seq_ids), heads_q, seq_q, head_dim) = ({}, \
                 heads_q, seq_q, {})",
                shape_str(shape),
                seq_ids.len(),
                s.head_dim
            )));
        }
        if q.info.dtype != s.dtype.numpy_name() {
            return Err(Error::DType {
                argument: "q".to_string(),
                dtype: q.info.dtype.to_string(),
                reason: format!("the cache holds {}", s.dtype.numpy_name()),
            });
        }
        let lengths: Vec<i64> = seqs.iter().map(|seq| seq.lengths[layer] as i64).collect();
        let width = seqs
            .iter()
            .map(|seq| seq.lengths[layer].div_ceil(s.block_size))
            .max()
            .unwrap_or(0);
        let mut table = vec![0i64; seqs.len() * width];
        for (row, seq) in seqs.iter().enumerate() {
            let used = seq.lengths[layer].div_ceil(s.block_size);
            for (i, &b) in seq.blocks[..used].iter().enumerate() {
                table[row * width + i] = b as i64;
            }
        }
        let (k_shape, v_shape) = (s.k_pool_shape(), s.v_pool_shape());
        let dtype = s.dtype.numpy_name();
        let table_shape = [seqs.len(), width];
        let problem = validate_kvcache(
            q.info,
            ArrayInfo::new(&k_shape, dtype),
            ArrayInfo::new(&v_shape, dtype),
            IntArray {
                shape: &table_shape[..1],
                dtype: "int64",
                values: &lengths,
            },
            Some(IntArray {
                shape: &table_shape,
                dtype: "int64",
                values: &table,
            }),
            options,
        )?;
        let out = self
            .storage
            .attention(layer, &problem, q.data, variants, outputs)?;
        Ok((out, problem))
    }

    /// Copies of `layer`'s key and value pools, `(num_blocks, heads_kv,
    /// block_size, head_dim)` and `(..., head_dim_v)`, in host memory.
    pub fn read_layer(&self, layer: i64) -> Result<(Buffer, Buffer)> {
        self.storage.read(self.manager.check_layer(layer)?)
    }

    /// The dtype of the pools.
    pub fn dtype(&self) -> DType {
        self.shape.dtype
    }
}

#[cfg(test)]
mod tests;
