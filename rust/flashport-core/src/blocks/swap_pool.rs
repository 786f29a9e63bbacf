//! The swap space's bookkeeping: host blocks that hold the blocks of
//! sequences swapped out of a KV cache's pools (PagedAttention's swapping,
//! vLLM's CPU swap space), a reference count per host block and the queue
//! of free ones. Block ids only; the keys and values are the cache's
//! (`crate::kvcache::swap_space`).
//!
//! A host block is taken for each distinct pool block of the sequences
//! swapped out together, and its count is the number of swapped sequences
//! that hold it (forks swapped out together share it, as they shared the
//! pool block); swapping in or freeing counts it down, and at 0 it joins
//! the back of the free queue. Taking is from the front: deterministic.

use std::collections::VecDeque;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SwapPool {
    counts: Vec<usize>,
    free: VecDeque<usize>,
}

impl SwapPool {
    /// `num_blocks` free host blocks, queued in id order.
    pub fn new(num_blocks: usize) -> Self {
        SwapPool {
            counts: vec![0; num_blocks],
            free: (0..num_blocks).collect(),
        }
    }

    pub fn num_blocks(&self) -> usize {
        self.counts.len()
    }

    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    pub fn ref_counts(&self) -> &[usize] {
        &self.counts
    }

    /// The ids the next `count` takes would get, or `None` if fewer are
    /// free. Changes nothing.
    pub fn next_free(&self, count: usize) -> Option<Vec<usize>> {
        (count <= self.free.len()).then(|| self.free.iter().take(count).copied().collect())
    }

    /// Takes the front free block for one holder (the one
    /// [`Self::next_free`] named first).
    pub fn take(&mut self) -> usize {
        let block = self.free.pop_front().expect("planned with next_free");
        self.counts[block] = 1;
        block
    }

    /// One more holder of a taken block.
    pub fn share(&mut self, block: usize) {
        debug_assert!(self.counts[block] > 0);
        self.counts[block] += 1;
    }

    /// One holder fewer; at 0 the block joins the back of the free queue.
    pub fn release(&mut self, block: usize) {
        self.counts[block] -= 1;
        if self.counts[block] == 0 {
            self.free.push_back(block);
        }
    }

    /// The free queue, front first.
    pub fn free_order(&self) -> impl Iterator<Item = usize> + '_ {
        self.free.iter().copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_taken_in_queue_order_and_return_at_zero() {
        let mut s = SwapPool::new(3);
        assert_eq!(s.next_free(2), Some(vec![0, 1]));
        assert_eq!(s.next_free(4), None);
        let (a, b) = (s.take(), s.take());
        assert_eq!((a, b, s.num_free()), (0, 1, 1));
        s.share(a);
        s.release(a);
        assert_eq!(s.ref_counts(), &[1, 1, 0]);
        s.release(a);
        s.release(b);
        assert_eq!(s.free_order().collect::<Vec<_>>(), vec![2, 0, 1]);
        assert_eq!(s.next_free(1), Some(vec![2]));
    }
}
