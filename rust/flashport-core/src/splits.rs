//! Split-KV (Flash-Decoding): how the keys a sequence's rows see are cut
//! into consecutive splits, and how many the CPU makes. Below both
//! backends (the GPU's count is `gpu::decode::select::gpu_splits`, of the
//! shape and the adapter); see [`crate::decode`] for how the splits'
//! states are merged. Functions of the arguments only, never of the thread
//! count or of timing, so that the bits are reproducible.

use std::ops::Range;

use crate::problem::KvCacheProblem;

/// Split boundaries fall on multiples of this many keys from the start of
/// the keys read, so that tiles stay whole inside a split.
pub const SPLIT_GRANULE: usize = 16;

/// The keys of split `s` of `splits` of `keys`: consecutive ranges of
/// `ceil(keys.len() / splits)` keys rounded up to [`SPLIT_GRANULE`], the
/// last ones empty when there are more splits than that makes.
pub fn split_keys(keys: Range<usize>, splits: usize, s: usize) -> Range<usize> {
    let per = keys
        .len()
        .div_ceil(splits.max(1))
        .next_multiple_of(SPLIT_GRANULE);
    let start = keys.start + (s * per).min(keys.len());
    start..(start + per).min(keys.end)
}

/// Tasks the CPU's default split count aims for: enough for the threads of
/// a large machine to finish together when sequences differ in length.
pub const CPU_TASKS: usize = 16;

/// The fewest keys a CPU split gets from the default: a split costs a
/// task hand-over and a partial state to merge.
pub const CPU_MIN_SPLIT_KEYS: usize = 256;

/// The CPU's key splits per sequence: the caller's, else enough for about
/// [`CPU_TASKS`] tasks over (sequence, key/value head, split), with no
/// split under [`CPU_MIN_SPLIT_KEYS`] keys of the longest sequence. A
/// function of the shape only (not of the thread count, which must not
/// change the bits).
pub fn cpu_splits(p: &KvCacheProblem) -> usize {
    if let Some(n) = p.num_splits {
        return n;
    }
    let heads = (p.batch() * p.heads_kv()).max(1);
    let longest = (0..p.batch())
        .map(|b| p.keys_read(b).len())
        .max()
        .unwrap_or(0);
    let by_tasks = CPU_TASKS.div_ceil(heads);
    let by_keys = (longest / CPU_MIN_SPLIT_KEYS).max(1);
    by_tasks.min(by_keys).max(1)
}
