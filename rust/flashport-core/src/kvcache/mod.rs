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
//!   i)`, rooted in the cache's identity ([`hash`]). Once a block is full
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

pub mod free_queue;
pub mod hash;
pub mod manager;
pub mod plan;
pub mod pool;

pub use manager::{BlockManager, Sequence};
