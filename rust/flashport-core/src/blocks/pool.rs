//! The block pool's bookkeeping: a reference count per block, the queue
//! of free blocks in eviction order, and the map from prefix hashes to
//! the blocks that hold them (prefix reuse). No storage: block ids only.
//!
//! A block is *used* while its count is above 0 and *free* at 0, when it
//! is in the free queue. A block may hold a prefix hash (be *cached*)
//! whether used or free: a freed cached block keeps its hash and can be
//! adopted again until the allocator takes it for fresh data, which
//! evicts the hash. The allocator takes from the front of the queue, so
//! the cached blocks freed longest ago are evicted first (LRU).
//!
//! Each change returns an [`Undo`]: what it replaced. Undone last first
//! ([`BlockPool::undo`]), they leave the pool exactly as it was, the free
//! queue's order included; this is how a batch of appends that fails part
//! way changes nothing.

use std::collections::HashMap;

use super::free_queue::{FreeQueue, Place};
use super::hash::BlockHash;

/// What one change of the pool replaced, for [`BlockPool::undo`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Undo {
    /// [`BlockPool::take`]: the block left the queue from `place`, and its
    /// cached prefix `evicted` (if any) with it.
    Take {
        block: usize,
        place: Place,
        evicted: Option<BlockHash>,
    },
    /// [`BlockPool::share`]: count up, out of the queue from `place` if the
    /// block was free.
    Share { block: usize, place: Option<Place> },
    /// [`BlockPool::release`]: count down, into the back of the queue if
    /// it reached 0.
    Release { block: usize, queued: bool },
    /// [`BlockPool::register`] that recorded the block's prefix.
    Register { block: usize },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockPool {
    counts: Vec<usize>,
    hashes: Vec<Option<BlockHash>>,
    cached: HashMap<BlockHash, usize>,
    free: FreeQueue,
}

impl BlockPool {
    /// `num_blocks` free blocks, none cached, queued in id order.
    pub fn new(num_blocks: usize) -> Self {
        BlockPool {
            counts: vec![0; num_blocks],
            hashes: vec![None; num_blocks],
            cached: HashMap::new(),
            free: FreeQueue::new(num_blocks),
        }
    }

    pub fn num_blocks(&self) -> usize {
        self.counts.len()
    }

    /// Blocks with count 0 (cached or not).
    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    pub fn num_used(&self) -> usize {
        self.num_blocks() - self.num_free()
    }

    /// Blocks holding a prefix hash, used or free.
    pub fn num_cached(&self) -> usize {
        self.cached.len()
    }

    pub fn ref_count(&self, block: usize) -> usize {
        self.counts[block]
    }

    pub fn ref_counts(&self) -> &[usize] {
        &self.counts
    }

    /// The prefix hash a block holds, if it is cached.
    pub fn hash_of(&self, block: usize) -> Option<BlockHash> {
        self.hashes[block]
    }

    /// The cached block holding the prefix `hash`, if any.
    pub fn lookup(&self, hash: BlockHash) -> Option<usize> {
        self.cached.get(&hash).copied()
    }

    /// The free queue, front (next taken) first.
    pub fn free_order(&self) -> impl Iterator<Item = usize> + '_ {
        self.free.iter()
    }

    /// The `count` blocks the allocator would take next once the blocks
    /// of `adopting` (free blocks about to be adopted) have left the
    /// queue; `None` if there are not that many. Changes nothing.
    pub fn next_fresh(&self, count: usize, adopting: &[usize]) -> Option<Vec<usize>> {
        let fresh: Vec<usize> = self
            .free
            .iter()
            .filter(|b| !adopting.contains(b))
            .take(count)
            .collect();
        (fresh.len() == count).then_some(fresh)
    }

    /// Takes a free block for fresh data: out of the queue, its cached
    /// prefix (if any) evicted, count 1.
    pub fn take(&mut self, block: usize) -> Undo {
        debug_assert_eq!(self.counts[block], 0, "block {block} is in use");
        let place = self.free.remove(block);
        let evicted = self.hashes[block];
        self.evict(block);
        self.counts[block] = 1;
        Undo::Take {
            block,
            place,
            evicted,
        }
    }

    /// One more holder of a block: a fork, or the adoption of a cached
    /// block (out of the free queue if it was free; its hash stays).
    pub fn share(&mut self, block: usize) -> Undo {
        let place = (self.counts[block] == 0).then(|| self.free.remove(block));
        self.counts[block] += 1;
        Undo::Share { block, place }
    }

    /// One holder fewer; at 0 the block joins the back of the free queue,
    /// keeping its cached prefix.
    pub fn release(&mut self, block: usize) -> Undo {
        debug_assert!(self.counts[block] > 0, "block {block} is already free");
        self.counts[block] -= 1;
        let queued = self.counts[block] == 0;
        if queued {
            self.free.push_back(block);
        }
        Undo::Release { block, queued }
    }

    /// Undoes one change. Changes must be undone last first: each then
    /// finds the pool as that change left it.
    pub fn undo(&mut self, undo: Undo) {
        match undo {
            Undo::Take {
                block,
                place,
                evicted,
            } => {
                self.counts[block] = 0;
                if let Some(hash) = evicted {
                    self.hashes[block] = Some(hash);
                    self.cached.insert(hash, block);
                }
                self.free.restore(block, place);
            }
            Undo::Share { block, place } => {
                self.counts[block] -= 1;
                if let Some(place) = place {
                    self.free.restore(block, place);
                }
            }
            Undo::Release { block, queued } => {
                if queued {
                    // The back of the queue: no later change is left.
                    self.free.remove(block);
                }
                self.counts[block] += 1;
            }
            Undo::Register { block } => self.evict(block),
        }
    }

    /// Records that a used block holds the full prefix `hash`, unless
    /// another block already does (then this one stays uncached, a
    /// duplicate, as in vLLM). Returns whether it was recorded.
    pub fn register(&mut self, block: usize, hash: BlockHash) -> bool {
        debug_assert!(self.hashes[block].is_none(), "block {block} is cached");
        if self.cached.contains_key(&hash) {
            return false;
        }
        self.cached.insert(hash, block);
        self.hashes[block] = Some(hash);
        true
    }

    /// Forgets a block's cached prefix, if it has one.
    pub fn evict(&mut self, block: usize) {
        if let Some(hash) = self.hashes[block].take() {
            self.cached.remove(&hash);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_and_the_free_queue_agree() {
        let mut pool = BlockPool::new(4);
        assert_eq!((pool.num_free(), pool.num_used()), (4, 0));
        assert_eq!(pool.next_fresh(2, &[]), Some(vec![0, 1]));
        pool.take(0);
        pool.take(1);
        pool.share(1);
        assert_eq!(pool.ref_counts(), [1, 2, 0, 0]);
        assert_eq!((pool.num_free(), pool.num_used()), (2, 2));
        pool.release(1);
        assert_eq!(pool.ref_count(1), 1);
        pool.release(1);
        pool.release(0);
        // Freed in the order 1, 0: behind the blocks that were never used.
        assert_eq!(pool.free_order().collect::<Vec<_>>(), [2, 3, 1, 0]);
        assert_eq!(pool.next_fresh(5, &[]), None);
        assert_eq!(pool.next_fresh(3, &[3]), Some(vec![2, 1, 0]));
    }

    #[test]
    fn changes_undone_last_first_restore_the_pool_exactly() {
        let mut pool = BlockPool::new(5);
        pool.take(3);
        assert!(pool.register(3, BlockHash(7)));
        pool.release(3);
        pool.take(0);
        pool.take(1);
        pool.share(1);
        let before = pool.clone();
        // Adopt the free cached block 3, take 4 then 2 (evicting nothing),
        // free 0 (to the back), take it again, register, and take block 3
        // itself once released (evicting its prefix).
        let mut undo = vec![pool.share(3), pool.take(4), pool.take(2), pool.release(0)];
        undo.push(pool.take(0));
        assert!(pool.register(2, BlockHash(8)));
        undo.push(Undo::Register { block: 2 });
        undo.push(pool.release(1));
        undo.push(pool.release(3));
        undo.push(pool.take(3));
        assert_eq!((pool.lookup(BlockHash(7)), pool.num_free()), (None, 0));
        for u in undo.into_iter().rev() {
            pool.undo(u);
        }
        assert_eq!(pool, before);
        assert_eq!(pool.free_order().collect::<Vec<_>>(), [2, 4, 3]);
    }

    #[test]
    fn a_freed_cached_block_stays_adoptable_until_taken() {
        let mut pool = BlockPool::new(3);
        let h = BlockHash(42);
        pool.take(2);
        assert!(pool.register(2, h));
        // A second block with the same prefix is a duplicate.
        pool.take(0);
        assert!(!pool.register(0, h));
        assert_eq!((pool.lookup(h), pool.hash_of(0)), (Some(2), None));
        pool.release(2);
        assert_eq!((pool.num_free(), pool.num_cached()), (2, 1));
        // Adopted from the middle of the free queue: used again, still cached.
        pool.share(2);
        assert_eq!((pool.ref_count(2), pool.num_free()), (1, 1));
        assert_eq!(pool.free_order().collect::<Vec<_>>(), [1]);
        pool.release(2);
        // Taken for fresh data: the prefix is evicted.
        pool.take(1);
        assert_eq!(pool.lookup(h), Some(2));
        pool.take(2);
        assert_eq!(
            (pool.lookup(h), pool.hash_of(2), pool.num_cached()),
            (None, None, 0)
        );
    }
}
