//! The sequences of a KV cache and the rules of sharing, on block ids
//! alone (no storage): fork, free, and the plan of each append, with
//! copy-on-write and prefix reuse (see the module docs of
//! [`crate::kvcache`] for the rules these implement).

use std::collections::BTreeMap;

use super::hash::{chain, BlockHash, CacheIdentity};
use super::plan::{AppendPlan, BlockCopy, SwapPlan, WriteRun};
use super::pool::{BlockPool, Undo};
use super::swap_pool::SwapPool;
use crate::error::{Error, Result};

/// What [`BlockManager::commit`] replaced: the pool's changes in order,
/// and the sequence's count of blocks offered to the prefix cache (the
/// rest of the sequence's old state is in the plan).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Committed {
    pool: Vec<Undo>,
    registered: usize,
}

/// One sequence: its blocks (shared by every layer), each layer's written
/// length, and the tokens known from position 0 with the chain hashes of
/// the blocks they fill.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sequence {
    /// Block `i` holds positions `i·block_size ..` on every layer.
    pub blocks: Vec<usize>,
    /// Positions appended on each layer.
    pub lengths: Vec<usize>,
    /// The tokens of positions `0 .. tokens.len()`, as appends gave them.
    pub tokens: Vec<i64>,
    /// `hashes[i]`: the chain hash of block `i`, for every block whose
    /// tokens are known (`tokens.len() / block_size` of them).
    pub hashes: Vec<BlockHash>,
    /// Blocks `0 .. registered` were offered to the prefix cache.
    registered: usize,
}

impl Sequence {
    /// Positions written on every layer.
    pub fn length(&self) -> usize {
        self.lengths.iter().copied().min().unwrap_or(0)
    }
}

/// The bookkeeping of a KV cache: the pool, the sequences, and the
/// sequences swapped out to the host (their `blocks` then name host
/// blocks of `swap`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockManager {
    identity: CacheIdentity,
    root: BlockHash,
    pool: BlockPool,
    sequences: BTreeMap<u64, Sequence>,
    swap: SwapPool,
    swapped: BTreeMap<u64, Sequence>,
    next_id: u64,
}

/// The blocks `seqs` hold, each once, in the order of their tables.
fn distinct_blocks<'s>(seqs: impl Iterator<Item = &'s Sequence>) -> Vec<usize> {
    let mut blocks: Vec<usize> = Vec::new();
    for seq in seqs {
        for &b in &seq.blocks {
            if !blocks.contains(&b) {
                blocks.push(b);
            }
        }
    }
    blocks
}

/// A swapped-out sequence where only one in the pools will do.
fn swapped_out(argument: &str, id: i64) -> Error {
    Error::Value {
        argument: argument.to_string(),
        value: id.to_string(),
        reason: format!(
            "sequence {id} is swapped out: its keys and values are in the host swap space, \
             not the pools; swap_in({id}) before it attends, appends, forks or gives a block \
             table (free works either way)"
        ),
    }
}

fn unknown(argument: &str, id: impl std::fmt::Display, reason: String) -> Error {
    Error::UnknownSequence {
        argument: argument.to_string(),
        value: id.to_string(),
        reason,
    }
}

impl BlockManager {
    /// `num_blocks` pool blocks and `swap_blocks` host blocks, all free.
    pub fn new(identity: CacheIdentity, num_blocks: usize, swap_blocks: usize) -> Self {
        BlockManager {
            identity,
            root: identity.root(),
            pool: BlockPool::new(num_blocks),
            sequences: BTreeMap::new(),
            swap: SwapPool::new(swap_blocks),
            swapped: BTreeMap::new(),
            next_id: 0,
        }
    }

    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    pub fn swap_pool(&self) -> &SwapPool {
        &self.swap
    }

    pub fn identity(&self) -> &CacheIdentity {
        &self.identity
    }

    fn block_size(&self) -> usize {
        self.identity.block_size
    }

    /// The ids of the sequences in the pools, in increasing order.
    pub fn sequence_ids(&self) -> impl Iterator<Item = u64> + '_ {
        self.sequences.keys().copied()
    }

    /// The ids of the sequences swapped out, in increasing order.
    pub fn swapped_ids(&self) -> impl Iterator<Item = u64> + '_ {
        self.swapped.keys().copied()
    }

    /// Whether sequence `id` is swapped out (an error if it is neither
    /// swapped out nor in the pools).
    pub fn is_swapped(&self, argument: &str, id: i64) -> Result<bool> {
        if u64::try_from(id).is_ok_and(|key| self.swapped.contains_key(&key)) {
            return Ok(true);
        }
        self.sequence(argument, id).map(|_| false)
    }

    /// Sequence `id`, in the pools or swapped out (its lengths and tokens:
    /// what swapping keeps).
    pub fn any_sequence(&self, argument: &str, id: i64) -> Result<&Sequence> {
        match u64::try_from(id)
            .ok()
            .and_then(|key| self.swapped.get(&key))
        {
            Some(seq) => Ok(seq),
            None => self.sequence(argument, id),
        }
    }

    /// Sequence `id`, or an error naming `argument`: ids are never
    /// reused, so a freed id stays unknown.
    pub fn sequence(&self, argument: &str, id: i64) -> Result<&Sequence> {
        self.sequence_named(|| argument.to_string(), id)
    }

    /// [`Self::sequence`], the argument's name written only for a message
    /// (a batch names each row's; formatting every name of every call
    /// showed in a decode step's profile).
    pub fn sequence_named(&self, argument: impl FnOnce() -> String, id: i64) -> Result<&Sequence> {
        let found = u64::try_from(id)
            .ok()
            .and_then(|key| self.sequences.get(&key));
        if found.is_none() && u64::try_from(id).is_ok_and(|key| self.swapped.contains_key(&key)) {
            return Err(swapped_out(&argument(), id));
        }
        found.ok_or_else(|| {
            let reason = match u64::try_from(id) {
                Ok(key) if key < self.next_id => "that sequence was freed".to_string(),
                _ if self.next_id == 0 => {
                    "no such sequence: the cache has made none yet (new_sequence())".to_string()
                }
                _ => format!(
                    "no such sequence: the cache has made ids 0 to {}",
                    self.next_id - 1
                ),
            };
            unknown(&argument(), id, reason)
        })
    }

    /// `layer` as an index, or an error naming the argument.
    pub fn check_layer(&self, layer: i64) -> Result<usize> {
        let layers = self.identity.layers;
        match usize::try_from(layer) {
            Ok(l) if l < layers => Ok(l),
            _ => Err(Error::Value {
                argument: "layer".to_string(),
                value: layer.to_string(),
                reason: format!("the cache has {layers} layer(s): 0 to {}", layers - 1),
            }),
        }
    }

    /// A new, empty sequence.
    pub fn new_sequence(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        self.sequences.insert(
            id,
            Sequence {
                blocks: Vec::new(),
                lengths: vec![0; self.identity.layers],
                tokens: Vec::new(),
                hashes: Vec::new(),
                registered: 0,
            },
        );
        id
    }

    /// A new sequence sharing every block of `id` (a partly filled last
    /// block included): each block's count goes up by one. Needs no free
    /// block; the first append into a shared block copies it.
    pub fn fork(&mut self, id: i64) -> Result<u64> {
        let child = self.sequence("sid", id)?.clone();
        for &block in &child.blocks {
            self.pool.share(block);
        }
        let new = self.next_id;
        self.next_id += 1;
        self.sequences.insert(new, child);
        Ok(new)
    }

    /// Ends sequence `id`: each block's count goes down by one, and blocks
    /// at 0 join the free queue, last block first, so that a cached
    /// prefix's later blocks are evicted before its earlier ones (which
    /// more prompts share).
    pub fn free(&mut self, id: i64) -> Result<()> {
        if let Some(seq) = u64::try_from(id)
            .ok()
            .and_then(|key| self.swapped.remove(&key))
        {
            for &block in seq.blocks.iter().rev() {
                self.swap.release(block);
            }
            return Ok(());
        }
        self.sequence("sid", id)?;
        let seq = self.sequences.remove(&(id as u64)).expect("checked above");
        for &block in seq.blocks.iter().rev() {
            self.pool.release(block);
        }
        Ok(())
    }

    /// Plans an append of `n` positions to `layer` of sequence `id`, with
    /// their `tokens` if given (then `tokens.len() == n`). Changes
    /// nothing; fails with [`Error::CacheFull`] if the free blocks do not
    /// suffice, and on tokens that contradict the sequence's.
    pub fn plan_append(
        &self,
        id: i64,
        layer: usize,
        n: usize,
        tokens: Option<&[i64]>,
    ) -> Result<AppendPlan> {
        self.plan_row(id, layer, n, tokens, None)
    }

    /// [`Self::plan_append`] for row `row` of a batch of appends (then
    /// errors name `seq_ids[row]` and `tokens[row, i]`).
    pub fn plan_row(
        &self,
        id: i64,
        layer: usize,
        n: usize,
        tokens: Option<&[i64]>,
        row: Option<usize>,
    ) -> Result<AppendPlan> {
        let bs = self.block_size();
        // Names are written only for messages.
        let sid_name = || match row {
            None => "sid".to_string(),
            Some(r) => format!("seq_ids[{r}]"),
        };
        let tokens_name = || match row {
            None => "tokens".to_string(),
            Some(r) => format!("tokens[{r}]"),
        };
        let token_name = |i: usize| match row {
            None => format!("tokens[{i}]"),
            Some(r) => format!("tokens[{r}, {i}]"),
        };
        let seq = self.sequence_named(sid_name, id)?;
        let start = seq.lengths[layer];
        let end = start + n;
        // Tokens: the known ones must agree; new ones extend the record
        // only where it is contiguous from position 0.
        let known = seq.tokens.len();
        let mut new_tokens = Vec::new();
        if let Some(tokens) = tokens.filter(|t| !t.is_empty()) {
            if start > known {
                return Err(Error::Value {
                    argument: tokens_name(),
                    value: format!("<{} tokens from position {start}>", tokens.len()),
                    reason: format!(
                        "positions {known} to {} of sequence {id} were appended without \
                         tokens on every layer; prefix reuse needs a sequence's tokens from \
                         position 0 on (give tokens with the first append of each position, \
                         or with none)",
                        start - 1
                    ),
                });
            }
            for (i, &token) in tokens.iter().enumerate() {
                match seq.tokens.get(start + i) {
                    Some(&had) if had != token => {
                        return Err(Error::Value {
                            argument: token_name(i),
                            value: token.to_string(),
                            reason: format!(
                                "position {} of sequence {id} holds token {had} (given by an \
                                 earlier append, on this or another layer)",
                                start + i
                            ),
                        })
                    }
                    Some(_) => {}
                    None => new_tokens.push(token),
                }
            }
        }
        let token_at = |p: usize| match seq.tokens.get(p) {
            Some(&t) => t,
            None => new_tokens[p - known],
        };
        let mut new_hashes = Vec::new();
        let mut parent = seq.hashes.last().copied().unwrap_or(self.root);
        for i in seq.hashes.len()..(known + new_tokens.len()) / bs {
            let block: Vec<i64> = (i * bs..(i + 1) * bs).map(token_at).collect();
            parent = chain(parent, &block);
            new_hashes.push(parent);
        }
        let hash_of_index = |i: usize| {
            seq.hashes
                .get(i)
                .or_else(|| new_hashes.get(i - seq.hashes.len()))
                .copied()
        };

        // Blocks: copies of the shared, uncached blocks written into, then
        // new blocks, adopted from the prefix cache where their prefix is
        // cached.
        let have = seq.blocks.len();
        let reach = if n == 0 { 0 } else { end.div_ceil(bs) };
        let written = (start / bs)..reach.min(have);
        let shared: Vec<usize> = written
            .filter(|&i| {
                let block = seq.blocks[i];
                self.pool.hash_of(block).is_none() && self.pool.ref_count(block) > 1
            })
            .collect();
        let mut adopted = Vec::new();
        let mut new_indices = Vec::new();
        for i in have..reach.max(have) {
            match hash_of_index(i).and_then(|h| self.pool.lookup(h)) {
                Some(block) => adopted.push((i, block)),
                None => new_indices.push(i),
            }
        }
        let adopting_free: Vec<usize> = adopted
            .iter()
            .map(|&(_, b)| b)
            .filter(|&b| self.pool.ref_count(b) == 0)
            .collect();
        let count = shared.len() + new_indices.len();
        let fresh = self.pool.next_fresh(count, &adopting_free).ok_or_else(|| {
            let after = match row {
                Some(r) if r > 0 => format!(
                    " (seq_ids[{r}], after the blocks the batch's sequences before it took)"
                ),
                Some(r) => format!(" (seq_ids[{r}])"),
                None => String::new(),
            };
            Error::CacheFull(format!(
                "the KV cache is full: appending {n} position(s) to layer {layer} of \
                     sequence {id}{after} needs {} free block(s) ({} new, {} copy-on-write \
                     copies of shared blocks, {} cached blocks adopted from the free queue) but \
                     {} of {} are free; nothing was changed (free sequences, or make a cache \
                     with more blocks)",
                count + adopting_free.len(),
                new_indices.len(),
                shared.len(),
                adopting_free.len(),
                self.pool.num_free(),
                self.pool.num_blocks()
            ))
        })?;

        // The table is not copied: an append costs its own blocks, not the
        // sequence's.
        let mut take = fresh.iter().copied();
        let copies: Vec<(usize, BlockCopy)> = shared
            .iter()
            .map(|&i| {
                let (src, dst) = (seq.blocks[i], take.next().expect("counted"));
                (i, BlockCopy { src, dst })
            })
            .collect();
        let mut adoptions = adopted.iter().peekable();
        let new_blocks: Vec<usize> = (have..reach.max(have))
            .map(|i| match adoptions.next_if(|&&(j, _)| j == i) {
                Some(&(_, block)) => block,
                None => take.next().expect("counted"),
            })
            .collect();
        // Block index i after the append, and whether it is cached. The
        // positions of a cached block are not written: an adopted block
        // holds them on every layer, and a cached block of the sequence's
        // own is full on every layer (never in an append's range).
        let after = |i: usize| {
            if i >= have {
                (new_blocks[i - have], adopted.iter().any(|&(j, _)| j == i))
            } else if let Some(&(_, copy)) = copies.iter().find(|&&(j, _)| j == i) {
                (copy.dst, false)
            } else {
                (seq.blocks[i], self.pool.hash_of(seq.blocks[i]).is_some())
            }
        };
        let mut writes = Vec::new();
        let mut p = start;
        while p < end {
            let i = p / bs;
            let stop = ((i + 1) * bs).min(end);
            let (block, cached) = after(i);
            if !cached {
                writes.push(WriteRun {
                    block,
                    offset: p % bs,
                    source: (p - start)..(stop - start),
                });
            }
            p = stop;
        }
        Ok(AppendPlan {
            sequence: id as u64,
            layer,
            positions: start..end,
            adopted: adopted.iter().map(|&(i, b)| (b, i)).collect(),
            fresh,
            copies,
            new_blocks,
            writes,
            new_tokens,
            new_hashes,
        })
    }

    /// Carries out the bookkeeping of a plan made by [`Self::plan_append`]
    /// on this state. Returns what it replaced, for [`Self::rollback`].
    pub fn commit(&mut self, plan: &AppendPlan) -> Committed {
        let mut pool = Vec::with_capacity(plan.blocks_needed() + plan.copies.len());
        for &(block, _) in &plan.adopted {
            pool.push(self.pool.share(block));
        }
        for &block in &plan.fresh {
            pool.push(self.pool.take(block));
        }
        for &(_, copy) in &plan.copies {
            pool.push(self.pool.release(copy.src));
        }
        let bs = self.block_size();
        let seq = self
            .sequences
            .get_mut(&plan.sequence)
            .expect("a plan names a live sequence");
        for &(i, copy) in &plan.copies {
            seq.blocks[i] = copy.dst;
        }
        seq.blocks.extend_from_slice(&plan.new_blocks);
        seq.lengths[plan.layer] = plan.positions.end;
        seq.tokens.extend_from_slice(&plan.new_tokens);
        seq.hashes.extend_from_slice(&plan.new_hashes);
        // Blocks full on every layer whose tokens are known join the prefix
        // cache (unless a block with the same prefix is cached already).
        let full = (seq.length() / bs).min(seq.hashes.len());
        for i in seq.registered..full {
            let block = seq.blocks[i];
            if self.pool.hash_of(block).is_none() && self.pool.register(block, seq.hashes[i]) {
                pool.push(Undo::Register { block });
            }
        }
        let registered = seq.registered;
        seq.registered = seq.registered.max(full);
        Committed { pool, registered }
    }

    /// Undoes [`Self::commit`] of `plan`, which returned `committed`. Commits
    /// are undone last first: each then finds the state its commit left,
    /// and the manager ends exactly as before them (counts, the free
    /// queue's order, cached prefixes, every sequence).
    pub fn rollback(&mut self, plan: &AppendPlan, committed: Committed) {
        let seq = self
            .sequences
            .get_mut(&plan.sequence)
            .expect("a committed plan names a live sequence");
        seq.registered = committed.registered;
        seq.hashes
            .truncate(seq.hashes.len() - plan.new_hashes.len());
        seq.tokens
            .truncate(seq.tokens.len() - plan.new_tokens.len());
        seq.lengths[plan.layer] = plan.positions.start;
        seq.blocks
            .truncate(seq.blocks.len() - plan.new_blocks.len());
        for &(i, copy) in &plan.copies {
            seq.blocks[i] = copy.src;
        }
        for undo in committed.pool.into_iter().rev() {
            self.pool.undo(undo);
        }
    }

    /// After a plan's storage work failed part way: its fresh blocks may
    /// hold partial data, so any cached prefix they held is forgotten.
    /// Nothing else changes (losing a cached prefix never changes a result).
    pub fn abandon(&mut self, plan: &AppendPlan) {
        for &block in &plan.fresh {
            self.pool.evict(block);
        }
    }

    /// `ids` as distinct sequence keys, each found by `find` (the errors
    /// name `seq_ids[i]`).
    fn distinct_ids(
        &self,
        ids: &[i64],
        find: impl Fn(&str, i64) -> Result<()>,
    ) -> Result<Vec<u64>> {
        let mut keys = Vec::with_capacity(ids.len());
        for (i, &id) in ids.iter().enumerate() {
            find(&format!("seq_ids[{i}]"), id)?;
            let key = id as u64;
            if keys.contains(&key) {
                return Err(Error::Value {
                    argument: format!("seq_ids[{i}]"),
                    value: id.to_string(),
                    reason: "a sequence may be named once per swap".to_string(),
                });
            }
            keys.push(key);
        }
        Ok(keys)
    }

    /// Plans swapping sequences `ids` out of the pools together: one host
    /// block for each distinct block they hold, in the order of their
    /// tables. Changes nothing; fails with [`Error::CacheFull`] when the
    /// swap space has too few free blocks.
    pub fn plan_swap_out(&self, ids: &[i64]) -> Result<SwapPlan> {
        let sequences = self.distinct_ids(ids, |name, id| self.sequence(name, id).map(|_| ()))?;
        let blocks = distinct_blocks(sequences.iter().map(|key| &self.sequences[key]));
        let host = self.swap.next_free(blocks.len()).ok_or_else(|| {
            Error::CacheFull(format!(
                "the swap space is full: swapping out sequence(s) {ids:?} needs {} host \
                 block(s) but {} of {} are free; nothing was changed (free or swap in swapped \
                 sequences, or make the cache with more swap_blocks)",
                blocks.len(),
                self.swap.num_free(),
                self.swap.num_blocks()
            ))
        })?;
        Ok(SwapPlan {
            sequences,
            moves: blocks.into_iter().zip(host).collect(),
        })
    }

    /// Carries out the bookkeeping of [`Self::plan_swap_out`]'s plan, once
    /// the storage has copied the blocks out: the sequences leave the pools
    /// (each block's count down, as [`Self::free`] does: a block at 0 joins
    /// the free queue, a cached one stays adoptable) and hold host blocks.
    pub fn commit_swap_out(&mut self, plan: &SwapPlan) {
        let mut taken = Vec::with_capacity(plan.moves.len());
        for key in &plan.sequences {
            let mut seq = self
                .sequences
                .remove(key)
                .expect("a plan names live sequences");
            for &block in seq.blocks.iter().rev() {
                self.pool.release(block);
            }
            for block in seq.blocks.iter_mut() {
                let host = plan
                    .moves
                    .iter()
                    .find(|&&(pool, _)| pool == *block)
                    .map(|&(_, host)| host)
                    .expect("planned");
                if taken.contains(&host) {
                    self.swap.share(host);
                } else {
                    let got = self.swap.take();
                    debug_assert_eq!(got, host);
                    taken.push(host);
                }
                *block = host;
            }
            // Swapped in, its blocks are fresh: offered to the prefix cache
            // again then.
            seq.registered = 0;
            self.swapped.insert(*key, seq);
        }
    }

    /// Plans swapping sequences `ids` back into the pools: a fresh pool
    /// block for each distinct host block they hold. Changes nothing;
    /// fails with [`Error::CacheFull`] when the pool has too few free
    /// blocks.
    pub fn plan_swap_in(&self, ids: &[i64]) -> Result<SwapPlan> {
        let sequences = self.distinct_ids(ids, |name, id| match self.is_swapped(name, id)? {
            true => Ok(()),
            false => Err(Error::Value {
                argument: name.to_string(),
                value: id.to_string(),
                reason: format!("sequence {id} is in the pools, not swapped out"),
            }),
        })?;
        let host = distinct_blocks(sequences.iter().map(|key| &self.swapped[key]));
        let fresh = self.pool.next_fresh(host.len(), &[]).ok_or_else(|| {
            Error::CacheFull(format!(
                "the KV cache is full: swapping in sequence(s) {ids:?} needs {} free block(s) \
                 but {} of {} are free; nothing was changed (free or swap out sequences, or \
                 make a cache with more blocks)",
                host.len(),
                self.pool.num_free(),
                self.pool.num_blocks()
            ))
        })?;
        Ok(SwapPlan {
            sequences,
            moves: fresh.into_iter().zip(host).collect(),
        })
    }

    /// Carries out the bookkeeping of [`Self::plan_swap_in`]'s plan, once
    /// the storage has copied the blocks in: the sequences hold the fresh
    /// blocks (one count per sequence holding each), their host blocks are
    /// counted down, and their full blocks with known tokens are offered to
    /// the prefix cache as an append's would be.
    pub fn commit_swap_in(&mut self, plan: &SwapPlan) {
        let bs = self.block_size();
        let mut taken = Vec::with_capacity(plan.moves.len());
        for key in &plan.sequences {
            let mut seq = self
                .swapped
                .remove(key)
                .expect("a plan names swapped sequences");
            for block in seq.blocks.iter_mut() {
                let host = *block;
                self.swap.release(host);
                let pool = plan
                    .moves
                    .iter()
                    .find(|&&(_, h)| h == host)
                    .map(|&(pool, _)| pool)
                    .expect("planned");
                if taken.contains(&pool) {
                    self.pool.share(pool);
                } else {
                    self.pool.take(pool);
                    taken.push(pool);
                }
                *block = pool;
            }
            let full = (seq.length() / bs).min(seq.hashes.len());
            for i in 0..full {
                let block = seq.blocks[i];
                if self.pool.hash_of(block).is_none() {
                    self.pool.register(block, seq.hashes[i]);
                }
            }
            seq.registered = full;
            self.sequences.insert(*key, seq);
        }
    }

    /// After a swap-in's storage work failed part way: the fresh blocks may
    /// hold partial data, so any cached prefix they held is forgotten
    /// (losing a cached prefix never changes a result).
    pub fn abandon_swap_in(&mut self, plan: &SwapPlan) {
        for &(block, _) in &plan.moves {
            self.pool.evict(block);
        }
    }

    /// Checks the bookkeeping's invariants: each block's count is the
    /// number of sequences holding it, the free queue holds exactly the
    /// blocks at 0, the cache map and the blocks' hashes agree, and no
    /// sequence holds a block twice or reaches past its blocks.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let bs = self.block_size();
        let mut holders = vec![0usize; self.pool.num_blocks()];
        for (id, seq) in &self.sequences {
            let mut seen = seq.blocks.clone();
            seen.sort_unstable();
            seen.dedup();
            if seen.len() != seq.blocks.len() {
                return Err(format!(
                    "sequence {id} holds a block twice: {:?}",
                    seq.blocks
                ));
            }
            if seq
                .lengths
                .iter()
                .any(|&l| l.div_ceil(bs) > seq.blocks.len())
            {
                return Err(format!("sequence {id} is longer than its blocks"));
            }
            if seq.hashes.len() != seq.tokens.len() / bs {
                return Err(format!("sequence {id} has {} hashes", seq.hashes.len()));
            }
            for &b in &seq.blocks {
                holders[b] += 1;
            }
        }
        for (block, (&count, &held)) in self.pool.ref_counts().iter().zip(&holders).enumerate() {
            if count != held {
                return Err(format!("block {block} counts {count} but {held} hold it"));
            }
        }
        let mut free: Vec<usize> = self.pool.free_order().collect();
        free.sort_unstable();
        let zero: Vec<usize> = (0..self.pool.num_blocks())
            .filter(|&b| holders[b] == 0)
            .collect();
        if free != zero {
            return Err(format!("free queue {free:?}, blocks at 0 {zero:?}"));
        }
        for block in 0..self.pool.num_blocks() {
            if let Some(h) = self.pool.hash_of(block) {
                if self.pool.lookup(h) != Some(block) {
                    return Err(format!("block {block}'s hash maps elsewhere"));
                }
            }
        }
        let cached = (0..self.pool.num_blocks())
            .filter(|&b| self.pool.hash_of(b).is_some())
            .count();
        if cached != self.pool.num_cached() {
            return Err(format!(
                "{cached} blocks hashed, {} in the map",
                self.pool.num_cached()
            ));
        }
        // The swapped sequences and their host blocks, likewise.
        let mut host_holders = vec![0usize; self.swap.num_blocks()];
        for (id, seq) in &self.swapped {
            if self.sequences.contains_key(id) {
                return Err(format!("sequence {id} is in the pools and swapped out"));
            }
            let mut seen = seq.blocks.clone();
            seen.sort_unstable();
            seen.dedup();
            if seen.len() != seq.blocks.len() {
                return Err(format!("swapped sequence {id} holds a host block twice"));
            }
            if seq
                .lengths
                .iter()
                .any(|&l| l.div_ceil(bs) > seq.blocks.len())
                || seq.hashes.len() != seq.tokens.len() / bs
            {
                return Err(format!("swapped sequence {id} is inconsistent"));
            }
            for &b in &seq.blocks {
                host_holders[b] += 1;
            }
        }
        if self.swap.ref_counts() != host_holders.as_slice() {
            return Err(format!(
                "host block counts {:?}, holders {host_holders:?}",
                self.swap.ref_counts()
            ));
        }
        let mut free: Vec<usize> = self.swap.free_order().collect();
        free.sort_unstable();
        let zero: Vec<usize> = (0..self.swap.num_blocks())
            .filter(|&b| host_holders[b] == 0)
            .collect();
        if free != zero {
            return Err(format!(
                "host free queue {free:?}, host blocks at 0 {zero:?}"
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::problem::DType;

    fn manager(num_blocks: usize, block_size: usize, layers: usize) -> BlockManager {
        BlockManager::new(
            CacheIdentity {
                layers,
                heads_kv: 1,
                head_dim: 4,
                head_dim_v: 4,
                block_size,
                dtype: DType::F32,
            },
            num_blocks,
            3,
        )
    }

    /// Plans and commits an append (the storage's part is not needed here).
    fn append(
        m: &mut BlockManager,
        id: u64,
        layer: usize,
        n: usize,
        tokens: Option<&[i64]>,
    ) -> AppendPlan {
        let plan = m.plan_append(id as i64, layer, n, tokens).unwrap();
        m.commit(&plan);
        m.check_invariants().unwrap();
        plan
    }

    /// Appends `n` positions on every layer, layer 0 with the tokens.
    fn append_all(m: &mut BlockManager, id: u64, n: usize, tokens: Option<&[i64]>) {
        for layer in 0..m.identity().layers {
            append(m, id, layer, n, tokens.filter(|_| layer == 0));
        }
    }

    fn blocks(m: &BlockManager, id: u64) -> Vec<usize> {
        m.sequence("sid", id as i64).unwrap().blocks.clone()
    }

    fn free_order(m: &BlockManager) -> Vec<usize> {
        m.pool().free_order().collect()
    }

    #[test]
    fn appends_take_blocks_from_the_front_and_write_runs() {
        let mut m = manager(6, 4, 1);
        let s = m.new_sequence();
        let plan = append(&mut m, s, 0, 6, None);
        assert_eq!(
            (plan.fresh.clone(), plan.new_blocks.clone()),
            (vec![0, 1], vec![0, 1])
        );
        assert_eq!(
            plan.writes,
            [
                WriteRun {
                    block: 0,
                    offset: 0,
                    source: 0..4
                },
                WriteRun {
                    block: 1,
                    offset: 0,
                    source: 4..6
                },
            ]
        );
        // Into the partly filled block, then a new one.
        let plan = append(&mut m, s, 0, 3, None);
        assert_eq!(plan.fresh, [2]);
        assert_eq!(
            plan.writes,
            [
                WriteRun {
                    block: 1,
                    offset: 2,
                    source: 0..2
                },
                WriteRun {
                    block: 2,
                    offset: 0,
                    source: 2..3
                },
            ]
        );
        assert_eq!(m.sequence("sid", s as i64).unwrap().lengths, [9]);
        assert_eq!((m.pool().num_used(), m.pool().num_free()), (3, 3));
        // Nothing to append: nothing planned.
        let plan = append(&mut m, s, 0, 0, None);
        assert!(plan.fresh.is_empty() && plan.writes.is_empty());
    }

    #[test]
    fn fork_counts_up_free_counts_down_in_lru_order() {
        let mut m = manager(5, 2, 1);
        let a = m.new_sequence();
        append(&mut m, a, 0, 5, None); // blocks 0, 1, 2 (2 partly filled)
        let b = m.fork(a as i64).unwrap();
        assert_eq!(blocks(&m, b), [0, 1, 2]);
        assert_eq!(m.pool().ref_counts(), [2, 2, 2, 0, 0]);
        assert_eq!(m.pool().num_free(), 2);
        m.free(a as i64).unwrap();
        assert_eq!(m.pool().ref_counts(), [1, 1, 1, 0, 0]);
        m.free(b as i64).unwrap();
        // Freed last block first: 2, 1, 0 behind the never-used 3, 4.
        assert_eq!(free_order(&m), [3, 4, 2, 1, 0]);
        m.check_invariants().unwrap();
        let c = m.new_sequence();
        let plan = append(&mut m, c, 0, 4, None);
        assert_eq!(plan.fresh, [3, 4]);
        let plan = append(&mut m, c, 0, 1, None);
        assert_eq!(plan.fresh, [2]);
    }

    #[test]
    fn the_first_write_into_a_shared_block_copies_it_for_every_layer() {
        let mut m = manager(6, 4, 2);
        let a = m.new_sequence();
        append_all(&mut m, a, 6, None); // blocks 0 (full), 1 (2 of 4)
        let b = m.fork(a as i64).unwrap();
        // b writes position 6 on layer 0: block 1 is shared, so it is
        // copied (all layers) into block 2, which b then writes.
        let plan = append(&mut m, b, 0, 1, None);
        assert_eq!(plan.copies, [(1, BlockCopy { src: 1, dst: 2 })]);
        assert_eq!(plan.fresh, [2]);
        assert_eq!(
            plan.writes,
            [WriteRun {
                block: 2,
                offset: 2,
                source: 0..1
            }]
        );
        assert_eq!((blocks(&m, a), blocks(&m, b)), (vec![0, 1], vec![0, 2]));
        assert_eq!(m.pool().ref_counts()[..3], [2, 1, 1]);
        // Layer 1 of b finds block 2 its own: no second copy.
        let plan = append(&mut m, b, 1, 1, None);
        assert!(plan.copies.is_empty() && plan.fresh.is_empty());
        assert_eq!(
            plan.writes,
            [WriteRun {
                block: 2,
                offset: 2,
                source: 0..1
            }]
        );
        // a's block 1 is its own again: written in place.
        let plan = append(&mut m, a, 0, 2, None);
        assert!(plan.copies.is_empty());
        assert_eq!(
            plan.writes,
            [WriteRun {
                block: 1,
                offset: 2,
                source: 0..2
            }]
        );
        // An append spanning a shared full block? Full blocks are past
        // every write; a fork mid-block of a longer append copies only the
        // shared block written into.
        let c = m.fork(b as i64).unwrap();
        let plan = append(&mut m, c, 0, 5, None);
        assert_eq!(plan.copies, [(1, BlockCopy { src: 2, dst: 3 })]);
        assert_eq!(plan.fresh, [3, 4]);
        assert_eq!(plan.new_blocks, [4]);
        assert_eq!(blocks(&m, c), [0, 3, 4]);
        assert_eq!(m.pool().ref_counts()[..5], [3, 1, 1, 1, 1]);
    }

    #[test]
    fn a_fork_between_layers_copies_when_either_side_writes() {
        // The fork happens after layer 0 wrote the step's token and before
        // layer 1 did.
        let mut m = manager(8, 4, 2);
        let a = m.new_sequence();
        append_all(&mut m, a, 3, None);
        append(&mut m, a, 0, 1, None);
        let b = m.fork(a as i64).unwrap();
        assert_eq!(m.sequence("sid", b as i64).unwrap().lengths, [4, 3]);
        let plan = append(&mut m, a, 1, 1, None);
        assert_eq!(plan.copies, [(0, BlockCopy { src: 0, dst: 1 })]);
        let plan = append(&mut m, b, 1, 1, None);
        assert!(plan.copies.is_empty(), "b holds block 0 alone now");
        assert_eq!((blocks(&m, a), blocks(&m, b)), (vec![1], vec![0]));
    }

    #[test]
    fn full_blocks_are_cached_when_full_on_every_layer_and_adopted_by_prefix() {
        let mut m = manager(10, 2, 2);
        let prompt = [7, 8, 9, 10, 11];
        let a = m.new_sequence();
        append(&mut m, a, 0, 5, Some(&prompt));
        // Full on layer 0 only: not cached yet.
        assert_eq!(m.pool().num_cached(), 0);
        append(&mut m, a, 1, 5, None);
        assert_eq!(m.pool().num_cached(), 2);
        assert_eq!(blocks(&m, a), [0, 1, 2]);
        // Same prompt: blocks 0 and 1 adopted, block 2 (partial) fresh; the
        // adopted positions are not written on any layer.
        let b = m.new_sequence();
        let plan = append(&mut m, b, 0, 5, Some(&prompt));
        assert_eq!(plan.adopted, [(0, 0), (1, 1)]);
        assert_eq!(plan.fresh, [3]);
        assert_eq!(
            plan.writes,
            [WriteRun {
                block: 3,
                offset: 0,
                source: 4..5
            }]
        );
        let plan = append(&mut m, b, 1, 5, None);
        assert_eq!(
            plan.writes,
            [WriteRun {
                block: 3,
                offset: 0,
                source: 4..5
            }]
        );
        assert_eq!(m.pool().ref_counts()[..4], [2, 2, 1, 1]);
        // A different first block: its chain differs, so nothing matches,
        // not even the identical second block.
        let c = m.new_sequence();
        let plan = append(&mut m, c, 0, 4, Some(&[6, 8, 9, 10]));
        assert!(plan.adopted.is_empty());
        assert_eq!(plan.fresh, [4, 5]);
        // Appended in pieces from a block boundary, the prefix still hits.
        let d = m.new_sequence();
        let plan = append(&mut m, d, 0, 2, Some(&prompt[..2]));
        assert_eq!(plan.adopted, [(0, 0)]);
        let plan = append(&mut m, d, 0, 3, Some(&prompt[2..]));
        assert_eq!(plan.adopted, [(1, 1)]);
        assert_eq!(plan.fresh, [6]);
        // Without tokens there is no reuse.
        let e = m.new_sequence();
        let plan = append(&mut m, e, 0, 4, None);
        assert!(plan.adopted.is_empty());
    }

    #[test]
    fn freed_cached_blocks_stay_reusable_until_evicted_lru() {
        let mut m = manager(4, 2, 1);
        let a = m.new_sequence();
        append(&mut m, a, 0, 4, Some(&[1, 2, 3, 4]));
        m.free(a as i64).unwrap();
        assert_eq!((m.pool().num_free(), m.pool().num_cached()), (4, 2));
        assert_eq!(free_order(&m), [2, 3, 1, 0]);
        // Adopting both from the free queue leaves 2 free; 3 more blocks
        // would be too many.
        let b = m.new_sequence();
        let e = m
            .plan_append(b as i64, 0, 10, Some(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]))
            .unwrap_err();
        assert!(matches!(e, Error::CacheFull(_)), "{e}");
        assert!(e.to_string().contains("needs 5 free block(s) (3 new, 0 copy-on-write copies of shared blocks, 2 cached blocks adopted"), "{e}");
        let plan = append(&mut m, b, 0, 5, Some(&[1, 2, 3, 4, 5]));
        assert_eq!(
            (plan.adopted.clone(), plan.fresh.clone()),
            (vec![(0, 0), (1, 1)], vec![2])
        );
        m.free(b as i64).unwrap();
        // Blocks 2 (uncached) , 1, 0 freed in that order behind 3.
        assert_eq!(free_order(&m), [3, 2, 1, 0]);
        // Taking 3 fresh blocks evicts the cached block 1 (freed before 0).
        let c = m.new_sequence();
        append(&mut m, c, 0, 6, None);
        assert_eq!(blocks(&m, c), [3, 2, 1]);
        assert_eq!(m.pool().num_cached(), 1);
        let d = m.new_sequence();
        let e = m
            .plan_append(d as i64, 0, 4, Some(&[1, 2, 3, 4]))
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("(1 new, 0 copy-on-write copies of shared blocks, 1 cached"),
            "{e}"
        );
        let plan = append(&mut m, d, 0, 2, Some(&[1, 2]));
        assert_eq!(plan.adopted, [(0, 0)], "block 0 is still cached");
        assert!(plan.fresh.is_empty() && plan.writes.is_empty());
    }

    #[test]
    fn fork_and_adoption_do_not_cache_duplicates() {
        let mut m = manager(8, 2, 1);
        let a = m.new_sequence();
        let b = m.new_sequence();
        // Both write the same prompt before either's blocks are cached:
        // a's blocks are cached first, b's stay duplicates.
        append(&mut m, a, 0, 1, Some(&[1]));
        append(&mut m, b, 0, 1, Some(&[1]));
        append(&mut m, a, 0, 1, Some(&[2]));
        append(&mut m, b, 0, 1, Some(&[2]));
        assert_eq!((blocks(&m, a), blocks(&m, b)), (vec![0], vec![1]));
        assert_eq!(
            (m.pool().hash_of(0).is_some(), m.pool().hash_of(1)),
            (true, None)
        );
        assert_eq!(m.pool().num_cached(), 1);
    }

    #[test]
    fn cache_full_changes_nothing() {
        let mut m = manager(3, 2, 2);
        let a = m.new_sequence();
        append_all(&mut m, a, 3, Some(&[1, 2, 3]));
        let b = m.fork(a as i64).unwrap();
        let c = m.new_sequence();
        append(&mut m, c, 0, 2, None); // the last free block
        let before = m.clone();
        for (id, layer, n) in [(a, 0, 1), (b, 1, 1), (c, 0, 1), (c, 1, 3), (b, 0, 5)] {
            let e = m.plan_append(id as i64, layer, n, None).unwrap_err();
            assert!(matches!(e, Error::CacheFull(_)), "{e}");
            assert_eq!(m, before);
        }
        // Forks need no block.
        m.fork(a as i64).unwrap();
        // Writing into c's own block needs none either.
        append(&mut m, c, 1, 2, None);
    }

    #[test]
    fn tokens_must_agree_and_extend_contiguously() {
        let mut m = manager(8, 2, 2);
        let a = m.new_sequence();
        append(&mut m, a, 0, 3, Some(&[5, 6, 7]));
        // The same tokens again on another layer: fine; a different one is
        // refused by name, and nothing changes.
        append(&mut m, a, 1, 2, Some(&[5, 6]));
        let before = m.clone();
        let e = m.plan_append(a as i64, 1, 2, Some(&[8, 9])).unwrap_err();
        assert_eq!(
            e.to_string(),
            "tokens[0]=8: position 2 of sequence 0 holds token 7 (given by an earlier append, \
             on this or another layer)"
        );
        assert_eq!(m, before);
        // Known tokens that agree, then new ones.
        let plan = append(&mut m, a, 1, 2, Some(&[7, 9]));
        assert_eq!(plan.new_tokens, [9]);
        assert_eq!(m.sequence("sid", a as i64).unwrap().tokens, [5, 6, 7, 9]);
        // Past positions appended without tokens on every layer.
        let b = m.new_sequence();
        append_all(&mut m, b, 2, None);
        let e = m.plan_append(b as i64, 0, 1, Some(&[1])).unwrap_err();
        assert!(
            e.to_string()
                .contains("positions 0 to 1 of sequence 1 were appended without tokens"),
            "{e}"
        );
        // Tokens on a later layer for positions layer 0 wrote without them.
        let c = m.new_sequence();
        append(&mut m, c, 0, 2, None);
        append(&mut m, c, 1, 2, Some(&[3, 4]));
        assert_eq!(m.sequence("sid", c as i64).unwrap().tokens, [3, 4]);
        assert!(m.pool().hash_of(blocks(&m, c)[0]).is_some());
    }

    #[test]
    fn unknown_and_freed_ids_and_layers_are_named() {
        let mut m = manager(2, 2, 3);
        let e = m.fork(0).unwrap_err();
        assert_eq!(
            e.to_string(),
            "sid=0: no such sequence: the cache has made none yet (new_sequence())"
        );
        let a = m.new_sequence();
        m.new_sequence();
        m.free(a as i64).unwrap();
        let e = m.free(a as i64).unwrap_err();
        assert_eq!(e.to_string(), "sid=0: that sequence was freed");
        assert!(matches!(e, Error::UnknownSequence { .. }));
        for id in [2, -1] {
            let e = m.plan_append(id, 0, 1, None).unwrap_err();
            assert_eq!(
                e.to_string(),
                format!("sid={id}: no such sequence: the cache has made ids 0 to 1")
            );
        }
        let e = m.check_layer(3).unwrap_err();
        assert_eq!(e.to_string(), "layer=3: the cache has 3 layer(s): 0 to 2");
        assert!(m.check_layer(-1).is_err());
        assert_eq!(m.check_layer(2), Ok(2));
    }

    /// A small deterministic generator for the random walk below.
    struct Lcg(u64);
    impl Lcg {
        fn below(&mut self, n: usize) -> usize {
            self.0 = self
                .0
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((self.0 >> 33) as usize) % n.max(1)
        }
    }

    #[test]
    fn random_operations_keep_the_invariants_and_roll_back_exactly() {
        for seed in 0..40 {
            let mut rng = Lcg(seed);
            let (layers, bs) = (1 + rng.below(3), 1 + rng.below(5));
            let mut m = manager(4 + rng.below(12), bs, layers);
            let mut live: Vec<u64> = Vec::new();
            for _ in 0..200 {
                match rng.below(6) {
                    0 => live.push(m.new_sequence()),
                    1 if !live.is_empty() => {
                        let id = live[rng.below(live.len())];
                        live.push(m.fork(id as i64).unwrap());
                    }
                    2 if !live.is_empty() => {
                        let id = live.swap_remove(rng.below(live.len()));
                        m.free(id as i64).unwrap();
                    }
                    _ if !live.is_empty() => {
                        let id = live[rng.below(live.len())];
                        let layer = rng.below(layers);
                        let n = rng.below(2 * bs + 2);
                        let seq = m.sequence("sid", id as i64).unwrap();
                        let start = seq.lengths[layer];
                        // Tokens that depend on the position only, so that
                        // sequences share prefixes often.
                        let tokens: Vec<i64> = (start..start + n).map(|p| (p % 3) as i64).collect();
                        let give = rng.below(3) > 0 && start <= seq.tokens.len();
                        let before = m.clone();
                        match m.plan_append(id as i64, layer, n, give.then_some(&tokens[..])) {
                            Ok(plan) => {
                                let committed = m.commit(&plan);
                                if rng.below(4) == 0 {
                                    // Undone, as a failed batch undoes
                                    // its rows: exactly as before.
                                    m.rollback(&plan, committed);
                                    assert_eq!(m, before);
                                }
                            }
                            Err(Error::CacheFull(_)) => assert_eq!(m, before),
                            Err(e) => panic!("{e}"),
                        }
                    }
                    _ => {}
                }
                m.check_invariants()
                    .unwrap_or_else(|e| panic!("seed {seed}: {e}"));
            }
        }
    }

    fn swap_out(m: &mut BlockManager, ids: &[i64]) -> SwapPlan {
        let plan = m.plan_swap_out(ids).unwrap();
        m.commit_swap_out(&plan);
        m.check_invariants().unwrap();
        plan
    }

    fn swap_in(m: &mut BlockManager, ids: &[i64]) -> SwapPlan {
        let plan = m.plan_swap_in(ids).unwrap();
        m.commit_swap_in(&plan);
        m.check_invariants().unwrap();
        plan
    }

    #[test]
    fn swapping_moves_each_block_once_and_restores_the_sequence() {
        // Blocks of 2, 2 layers, 3 host blocks; a sequence of 5 tokens
        // (three blocks, the last partly filled) and a fork of it.
        let mut m = manager(8, 2, 2);
        let a = m.new_sequence();
        let tokens = [1, 2, 3, 4, 5];
        append_all(&mut m, a, 5, Some(&tokens));
        let b = m.fork(a as i64).unwrap();
        let before = m.sequence("sid", a as i64).unwrap().clone();
        // Swapped out together: three moves, not six.
        let plan = swap_out(&mut m, &[a as i64, b as i64]);
        assert_eq!(plan.moves.len(), 3);
        assert_eq!(m.swap_pool().num_free(), 0);
        assert_eq!(m.pool().num_free(), 8, "every pool block is free again");
        assert_eq!(m.swapped_ids().collect::<Vec<_>>(), vec![a, b]);
        assert!(m.is_swapped("sid", a as i64).unwrap());
        assert_eq!(m.swap_pool().ref_counts(), &[2, 2, 2]);
        // Back in, together: three fresh blocks, each held twice; lengths,
        // tokens and hashes as before, and the full blocks cached again.
        let plan = swap_in(&mut m, &[a as i64, b as i64]);
        assert_eq!(plan.moves.len(), 3);
        let after = m.sequence("sid", a as i64).unwrap();
        assert_eq!(
            (&after.lengths, &after.tokens, &after.hashes),
            (&before.lengths, &before.tokens, &before.hashes)
        );
        assert_eq!(blocks(&m, a), blocks(&m, b));
        assert!(blocks(&m, a).iter().all(|&x| m.pool().ref_count(x) == 2));
        assert_eq!(m.swap_pool().num_free(), 3);
    }

    #[test]
    fn a_sequence_swapped_alone_leaves_its_fork_its_blocks() {
        let mut m = manager(8, 2, 1);
        let a = m.new_sequence();
        append_all(&mut m, a, 4, None);
        let b = m.fork(a as i64).unwrap();
        let shared = blocks(&m, a);
        swap_out(&mut m, &[a as i64]);
        // The fork keeps the pool blocks (counts down to 1); the swapped
        // sequence has host copies of them.
        assert_eq!(blocks(&m, b), shared);
        assert!(shared.iter().all(|&x| m.pool().ref_count(x) == 1));
        swap_in(&mut m, &[a as i64]);
        // Back as its own blocks: no longer shared with the fork.
        assert!(blocks(&m, a).iter().all(|x| !shared.contains(x)));
        assert_eq!(m.sequence("sid", a as i64).unwrap().lengths, vec![4]);
    }

    #[test]
    fn a_full_swap_space_or_pool_changes_nothing() {
        let mut m = manager(4, 2, 1);
        let a = m.new_sequence();
        append_all(&mut m, a, 8, None);
        // Four blocks, three host blocks.
        let before = m.clone();
        let e = m.plan_swap_out(&[a as i64]).unwrap_err().to_string();
        assert!(
            e.contains("the swap space is full") && e.contains("needs 4"),
            "{e}"
        );
        assert_eq!(m, before);
        let mut m2 = manager(4, 2, 1);
        let x = m2.new_sequence();
        append_all(&mut m2, x, 6, None);
        swap_out(&mut m2, &[x as i64]);
        let y = m2.new_sequence();
        append_all(&mut m2, y, 3, None);
        let before = m2.clone();
        let e = m2.plan_swap_in(&[x as i64]).unwrap_err();
        assert!(matches!(e, Error::CacheFull(_)), "{e}");
        assert!(
            e.to_string().contains("needs 3 free block(s) but 2 of 4"),
            "{e}"
        );
        assert_eq!(m2, before);
    }

    #[test]
    fn a_swapped_sequence_may_only_be_swapped_in_measured_or_freed() {
        let mut m = manager(4, 2, 1);
        let a = m.new_sequence();
        append_all(&mut m, a, 3, None);
        swap_out(&mut m, &[a as i64]);
        let id = a as i64;
        for e in [
            m.fork(id).unwrap_err(),
            m.plan_append(id, 0, 1, None).unwrap_err(),
            m.plan_swap_out(&[id]).unwrap_err(),
        ] {
            assert!(e.to_string().contains("is swapped out"), "{e}");
        }
        assert_eq!(m.any_sequence("sid", id).unwrap().length(), 3);
        let e = m.plan_swap_in(&[id, id]).unwrap_err().to_string();
        assert!(e.contains("seq_ids[1]") && e.contains("once"), "{e}");
        let live = m.new_sequence() as i64;
        let e = m.plan_swap_in(&[live]).unwrap_err().to_string();
        assert!(e.contains("not swapped out"), "{e}");
        m.free(id).unwrap();
        m.check_invariants().unwrap();
        assert_eq!(m.swap_pool().num_free(), 3);
        assert!(m.is_swapped("sid", id).is_err(), "freed: unknown");
    }
}
