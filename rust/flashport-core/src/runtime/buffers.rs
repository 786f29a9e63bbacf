//! Working memory kept from one call to the next.
//!
//! A small problem (a few heads of 1024 tokens) computes for a few
//! milliseconds, and fresh memory for its packed keys and values and its
//! per-thread tiles cost it about a tenth of that: each call's pages were
//! zeroed by the allocator and then faulted in by the kernel, one 4 KiB
//! page at a time. Keeping them makes the second call reuse warm pages.
//! What is kept is bounded: the packed copies of inputs and the backward's
//! dQ partials up to [`MAX_KEPT_BYTES`] in all (a large problem computes
//! for long enough not to notice), and one set of tiles per thread that
//! computes (the helper threads and each thread that calls in).
//!
//! Memory that is new (outputs, which go to the caller, and buffers too
//! large to keep) is not zeroed up front: the parallel tasks that own its
//! parts initialise them (see [`zero_init`]), so that its page faults are
//! taken by all threads at once instead of by one before the tasks start.

use std::mem::MaybeUninit;
use std::ops::{Deref, DerefMut};

use crate::fork::ForkLocal;

/// Bytes of packed-input buffers kept between calls, in all.
const MAX_KEPT_BYTES: usize = 16 << 20;

/// Buffers of one element type that outlive a call (not across a fork:
/// a lock the parent held at the fork would never be released).
pub struct BufferPool<T> {
    free: ForkLocal<Vec<Vec<T>>>,
}

impl<T: Copy + Default> BufferPool<T> {
    pub const fn new() -> Self {
        BufferPool {
            free: ForkLocal::new(),
        }
    }

    /// The smallest kept buffer with room for `len` (so that a large one
    /// stays available for a large request), or a new empty one.
    fn reuse(&self, len: usize) -> Vec<T> {
        let mut free = self.free.lock();
        let best = free
            .iter()
            .enumerate()
            .filter(|(_, b)| b.capacity() >= len)
            .min_by_key(|(_, b)| b.capacity())
            .map(|(i, _)| i);
        best.map(|i| free.swap_remove(i)).unwrap_or_default()
    }

    /// A buffer with room for `len` elements, returned to the pool when
    /// dropped: either `len` elements long, holding what an earlier call
    /// left there (for a caller that overwrites all of them), or empty, its
    /// spare capacity to be initialised by parallel tasks (see [`spare`]).
    /// The room is reserved fallibly: an error naming `what` when it
    /// cannot be had.
    pub fn take(&'static self, len: usize, what: &str) -> crate::error::Result<Pooled<T>> {
        let mut data = self.reuse(len);
        if data.len() >= len {
            data.truncate(len);
        } else {
            data.clear();
            let bytes = len as u128 * std::mem::size_of::<T>() as u128;
            if !crate::host_memory::admits(bytes) || data.try_reserve_exact(len).is_err() {
                return Err(crate::error::Error::TooLarge(format!(
                    "{what} needs {bytes} bytes of host memory, which could not be allocated{}",
                    crate::host_memory::why()
                )));
            }
        }
        Ok(Pooled { data, pool: self })
    }

    fn give_back(&self, buffer: Vec<T>) {
        let bytes = |b: &Vec<T>| b.capacity() * std::mem::size_of::<T>();
        if bytes(&buffer) > MAX_KEPT_BYTES {
            return;
        }
        let mut free = self.free.lock();
        free.push(buffer);
        // Over the bound, drop the smallest first: the large ones are the
        // ones whose page faults cost most.
        while free.iter().map(bytes).sum::<usize>() > MAX_KEPT_BYTES {
            let smallest = (0..free.len()).min_by_key(|&i| free[i].capacity());
            match smallest {
                Some(i) => drop(free.swap_remove(i)),
                None => break,
            }
        }
    }
}

/// A buffer on loan from a [`BufferPool`].
pub struct Pooled<T: Copy + Default + 'static> {
    data: Vec<T>,
    pool: &'static BufferPool<T>,
}

impl<T: Copy + Default + 'static> Pooled<T> {
    pub fn vec_mut(&mut self) -> &mut Vec<T> {
        &mut self.data
    }
}

/// An empty vector with room for `len` elements, or an error naming
/// `what` when the memory cannot be had: an output of a problem larger
/// than memory is a ProblemTooLargeError, not an abort.
pub fn try_with_capacity<T>(len: usize, what: &str) -> crate::error::Result<Vec<T>> {
    let mut v = Vec::new();
    let bytes = len as u128 * std::mem::size_of::<T>() as u128;
    if crate::host_memory::admits(bytes) && v.try_reserve_exact(len).is_ok() {
        return Ok(v);
    }
    Err(crate::error::Error::TooLarge(format!(
        "{what} needs {bytes} bytes of host memory, which could not be allocated{}",
        crate::host_memory::why()
    )))
}

/// `len` zeros, or an error naming `what` (see [`try_with_capacity`]).
pub fn try_zeros<T: Copy + Default>(len: usize, what: &str) -> crate::error::Result<Vec<T>> {
    let mut v = try_with_capacity(len, what)?;
    v.resize(len, T::default());
    Ok(v)
}

/// The first `len` elements of `v`'s spare capacity (`v` must be empty
/// with room for `len`), to be initialised by the tasks that own them.
pub fn spare<T>(v: &mut Vec<T>, len: usize) -> &mut [MaybeUninit<T>] {
    debug_assert!(v.is_empty());
    &mut v.spare_capacity_mut()[..len]
}

/// Zero-fills `part` and views it as initialised.
pub fn zero_init<T: Copy + Default>(part: &mut [MaybeUninit<T>]) -> &mut [T] {
    part.fill(MaybeUninit::new(T::default()));
    // SAFETY: every element was written just above, and `MaybeUninit<T>`
    // has the layout of `T`.
    unsafe { &mut *(part as *mut [MaybeUninit<T>] as *mut [T]) }
}

impl<T: Copy + Default + 'static> Deref for Pooled<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.data
    }
}

impl<T: Copy + Default + 'static> DerefMut for Pooled<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        &mut self.data
    }
}

impl<T: Copy + Default + 'static> Drop for Pooled<T> {
    fn drop(&mut self) {
        self.pool.give_back(std::mem::take(&mut self.data));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_reused_and_bounded() {
        static POOL: BufferPool<f32> = BufferPool::new();
        let mut first = POOL.take(1000, "test").unwrap();
        let address = first.vec_mut().as_ptr();
        assert!(first.vec_mut().capacity() >= 1000);
        let part = zero_init(spare(first.vec_mut(), 1000));
        assert!(part.iter().all(|&x| x == 0.0));
        drop(first);
        let mut second = POOL.take(500, "test").unwrap();
        assert_eq!(second.len(), 0, "never initialised: empty");
        assert_eq!(
            second.vec_mut().as_ptr(),
            address,
            "the kept buffer is reused"
        );
        drop(second);
        // Too large to keep: the pool still holds only the first buffer.
        drop(POOL.take(MAX_KEPT_BYTES / 4 + 1, "test").unwrap());
        let free = POOL.free.lock();
        assert_eq!(free.len(), 1);
        assert!(free.iter().all(|b| b.capacity() * 4 <= MAX_KEPT_BYTES));
    }
}
