//! What an append does, computed in full before anything changes: the
//! blocks it adopts, takes and copies, and where each new token goes. The
//! manager commits the bookkeeping (a commit can be rolled back: a batch
//! whose later row fails, a storage that refuses), and the storage carries
//! out the copies and the writes. A plan that cannot be carried out (too
//! few free blocks) is never made: planning fails with
//! [`crate::error::Error::CacheFull`] instead.

use std::ops::Range;

use super::hash::BlockHash;

/// Copy-on-write: block `src`'s keys and values, on every layer, into the
/// fresh block `dst`, before any new token is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockCopy {
    pub src: usize,
    pub dst: usize,
}

/// New tokens `source` (indices into the appended `k` and `v`, along
/// their token axis) go to consecutive slots of one block from `offset`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriteRun {
    pub block: usize,
    pub offset: usize,
    pub source: Range<usize>,
}

/// An append of `positions` to one layer of one sequence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AppendPlan {
    pub sequence: u64,
    pub layer: usize,
    /// The sequence positions the append covers on its layer.
    pub positions: Range<usize>,
    /// Cached blocks the sequence adopts, each with the block index it
    /// fills: `(block, index)`.
    pub adopted: Vec<(usize, usize)>,
    /// Blocks taken from the free queue, in the order taken (the
    /// copy-on-write targets first, then new blocks).
    pub fresh: Vec<usize>,
    /// Copy-on-write of shared blocks the append writes into: the block
    /// index in the sequence and the copy.
    pub copies: Vec<(usize, BlockCopy)>,
    /// Blocks the sequence's table grows by, in order (adopted or fresh).
    pub new_blocks: Vec<usize>,
    /// Where the new tokens go. Positions in cached blocks (adopted, or
    /// full on every layer) are not written: the block holds them already.
    pub writes: Vec<WriteRun>,
    /// Tokens recorded for positions past those known before.
    pub new_tokens: Vec<i64>,
    /// Chain hashes of blocks whose tokens became known.
    pub new_hashes: Vec<BlockHash>,
}

impl AppendPlan {
    /// The copies for the storage, in order.
    pub fn block_copies(&self) -> Vec<BlockCopy> {
        self.copies.iter().map(|&(_, c)| c).collect()
    }

    /// Blocks the append needs from the free queue, fresh or adopted.
    pub fn blocks_needed(&self) -> usize {
        self.fresh.len() + self.adopted.len()
    }
}

/// Sequences swapped out of the pools together, or back in: the sequences
/// and each distinct block moved, `(pool block, host block)`, in the order
/// the storage copies them (out: pool to host; in: host to fresh pool
/// blocks). A block the sequences share moves once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SwapPlan {
    pub sequences: Vec<u64>,
    pub moves: Vec<(usize, usize)>,
}

impl SwapPlan {
    /// The pool blocks, in the order of the moves.
    pub fn pool_blocks(&self) -> Vec<usize> {
        self.moves.iter().map(|&(pool, _)| pool).collect()
    }

    /// The host blocks, in the order of the moves.
    pub fn host_blocks(&self) -> Vec<usize> {
        self.moves.iter().map(|&(_, host)| host).collect()
    }
}
