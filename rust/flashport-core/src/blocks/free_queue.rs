//! The queue of free blocks, in eviction order: a doubly linked list
//! threaded through the block ids (vLLM's `FreeKVCacheBlockQueue`), so
//! that a block can leave from the middle in O(1) when a sequence adopts a
//! free block that still holds a cached prefix.
//!
//! Freed blocks join the back; allocation takes from the front. The front
//! is therefore the block freed longest ago (least recently used), and
//! the order is a function of the calls alone: deterministic.

/// No block: the end of the list.
const NONE: usize = usize::MAX;

/// Where a block stood in the queue when it left: its neighbours then.
/// [`FreeQueue::restore`] puts it back there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Place {
    prev: usize,
    next: usize,
}

/// The free blocks of a pool of `capacity` blocks, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FreeQueue {
    prev: Vec<usize>,
    next: Vec<usize>,
    /// Whether each block is in the queue.
    queued: Vec<bool>,
    head: usize,
    tail: usize,
    len: usize,
}

impl FreeQueue {
    /// All `capacity` blocks free, in id order (block 0 at the front).
    pub fn new(capacity: usize) -> Self {
        let mut queue = FreeQueue {
            prev: vec![NONE; capacity],
            next: vec![NONE; capacity],
            queued: vec![false; capacity],
            head: NONE,
            tail: NONE,
            len: 0,
        };
        for block in 0..capacity {
            queue.push_back(block);
        }
        queue
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn contains(&self, block: usize) -> bool {
        self.queued[block]
    }

    /// Appends a block that is not in the queue.
    pub fn push_back(&mut self, block: usize) {
        debug_assert!(!self.queued[block], "block {block} is already free");
        self.prev[block] = self.tail;
        self.next[block] = NONE;
        match self.tail {
            NONE => self.head = block,
            tail => self.next[tail] = block,
        }
        self.tail = block;
        self.queued[block] = true;
        self.len += 1;
    }

    /// Removes a block that is in the queue, wherever it is; returns
    /// where it was.
    pub fn remove(&mut self, block: usize) -> Place {
        debug_assert!(self.queued[block], "block {block} is not free");
        let (prev, next) = (self.prev[block], self.next[block]);
        match prev {
            NONE => self.head = next,
            p => self.next[p] = next,
        }
        match next {
            NONE => self.tail = prev,
            n => self.prev[n] = prev,
        }
        self.prev[block] = NONE;
        self.next[block] = NONE;
        self.queued[block] = false;
        self.len -= 1;
        Place { prev, next }
    }

    /// Undoes the `remove` that returned `place`. Changes are undone last
    /// first (as dancing links are): the queue is then as it was just after
    /// that removal, so the block's old neighbours are adjacent again and
    /// it goes back between them; the links end exactly as before.
    pub fn restore(&mut self, block: usize, place: Place) {
        debug_assert!(!self.queued[block], "block {block} is already free");
        let Place { prev, next } = place;
        debug_assert_eq!(
            (
                prev == NONE || self.next[prev] == next,
                next == NONE || self.prev[next] == prev
            ),
            (true, true),
            "block {block}'s neighbours moved"
        );
        match prev {
            NONE => self.head = block,
            p => self.next[p] = block,
        }
        match next {
            NONE => self.tail = block,
            n => self.prev[n] = block,
        }
        self.prev[block] = prev;
        self.next[block] = next;
        self.queued[block] = true;
        self.len += 1;
    }

    /// Takes the front block (the least recently freed), if any.
    pub fn pop_front(&mut self) -> Option<usize> {
        let head = self.head;
        if head == NONE {
            return None;
        }
        self.remove(head);
        Some(head)
    }

    /// The queue from front to back.
    pub fn iter(&self) -> impl Iterator<Item = usize> + '_ {
        std::iter::successors((self.head != NONE).then_some(self.head), |&b| {
            let next = self.next[b];
            (next != NONE).then_some(next)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn order(q: &FreeQueue) -> Vec<usize> {
        q.iter().collect()
    }

    #[test]
    fn starts_in_id_order_and_pops_from_the_front() {
        let mut q = FreeQueue::new(4);
        assert_eq!(order(&q), [0, 1, 2, 3]);
        assert_eq!(q.pop_front(), Some(0));
        assert_eq!(q.pop_front(), Some(1));
        assert_eq!((q.len(), order(&q)), (2, vec![2, 3]));
        assert!(!q.contains(0) && q.contains(2));
    }

    #[test]
    fn freed_blocks_go_to_the_back_in_the_order_freed() {
        let mut q = FreeQueue::new(5);
        let taken: Vec<_> = (0..5).map(|_| q.pop_front().unwrap()).collect();
        assert_eq!(taken, [0, 1, 2, 3, 4]);
        assert!(q.is_empty() && q.pop_front().is_none());
        for b in [3, 0, 4] {
            q.push_back(b);
        }
        assert_eq!(order(&q), [3, 0, 4]);
        assert_eq!(q.pop_front(), Some(3));
        q.push_back(1);
        assert_eq!(order(&q), [0, 4, 1]);
    }

    #[test]
    fn removals_undone_last_first_restore_the_queue_exactly() {
        let mut q = FreeQueue::new(6);
        q.remove(4);
        q.push_back(4);
        let before = q.clone();
        // Front, middle, back, and a neighbour of one already removed.
        let places: Vec<_> = [2, 3, 1, 4].iter().map(|&b| (b, q.remove(b))).collect();
        assert_eq!(order(&q), [0, 5]);
        for (b, place) in places.into_iter().rev() {
            q.restore(b, place);
        }
        assert_eq!(order(&q), [0, 1, 2, 3, 5, 4]);
        assert_eq!(q, before, "links, flags and ends as before");
        // Down to an empty queue and back.
        let places: Vec<_> = order(&before)
            .into_iter()
            .map(|b| (b, q.remove(b)))
            .collect();
        assert!(q.is_empty());
        for (b, place) in places.into_iter().rev() {
            q.restore(b, place);
        }
        assert_eq!(q, before);
    }

    #[test]
    fn removes_from_the_front_middle_and_back() {
        let mut q = FreeQueue::new(6);
        q.remove(2);
        assert_eq!(order(&q), [0, 1, 3, 4, 5]);
        q.remove(0);
        assert_eq!(order(&q), [1, 3, 4, 5]);
        q.remove(5);
        assert_eq!(order(&q), [1, 3, 4]);
        q.push_back(2);
        q.push_back(0);
        assert_eq!(order(&q), [1, 3, 4, 2, 0]);
        for b in [1, 3, 4, 2, 0] {
            q.remove(b);
        }
        assert!(q.is_empty() && order(&q).is_empty());
        q.push_back(5);
        assert_eq!((q.len(), order(&q)), (1, vec![5]));
    }
}
