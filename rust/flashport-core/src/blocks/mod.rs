//! The blocks of a paged KV cache, on block ids alone: the pool of blocks
//! with their reference counts and free queue (`pool`, `free_queue`), the
//! prefix hashes (`hash`), the sequences and the plan of each append
//! (`manager`, `plan`), batches of appends (`batch`), the host blocks of
//! sequences swapped out (`swap_pool`), the geometry of a
//! cache's pools (`shape`), and the contract of a storage that holds the
//! blocks' keys and values (`storage`).
//!
//! This is the floor under both backends and the cache itself: the KV
//! cache ([`crate::kvcache`], where the rules of sharing are written) ties
//! a block manager to a storage, and the storages, the CPU's
//! (`crate::kvcache::cpu_storage`) and the GPU's (`gpu/kv_pool.rs`),
//! implement the contract here without importing the cache that uses them.

pub mod batch;
pub mod free_queue;
pub mod hash;
pub mod manager;
pub mod plan;
pub mod pool;
pub mod shape;
pub mod storage;
pub mod swap_pool;

pub use manager::{BlockManager, Sequence};
pub use shape::{CacheArgs, CacheShape};
pub use storage::Storage;
