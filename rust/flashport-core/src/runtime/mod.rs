//! What every layer uses of the host: the pool of helper threads that runs
//! parallel work (`parallel.rs`: the CPU backend's tiles, the GPU
//! backend's host copies, the variants' host preparation), the reusable
//! buffers with checked allocation (`buffers.rs`) and a lock that outlives
//! a panic (`lock`). Below the backends and the validation, so that none
//! of them imports another for it.

use std::sync::{Mutex, MutexGuard};

pub(crate) mod buffers;
pub(crate) mod parallel;

/// Locks `m`, taking a poisoned lock as it is: the maps and queues kept
/// behind these locks stay consistent even if a holder panicked.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}
