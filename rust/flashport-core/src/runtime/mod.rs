//! What every layer uses of the host: the pool of helper threads that runs
//! parallel work (`parallel.rs`: the CPU backend's tiles, the GPU
//! backend's host copies, the variants' host preparation) and the reusable
//! buffers with checked allocation (`buffers.rs`). Below the backends and
//! the validation, so that none of them imports another for it.

pub(crate) mod buffers;
pub(crate) mod parallel;
