//! Process-wide state that a forked child does not inherit.
//!
//! `fork()` copies the memory of a process but only the thread that called
//! it. A child that reused the parent's CPU thread pool would hand work to
//! threads that do not exist and wait for them forever; one that reused
//! the parent's GPU device would wait on the driver's threads, gone too;
//! and a lock held by any other thread of the parent at the moment of the
//! fork stays locked in the child for good. `multiprocessing`'s default
//! start method on Linux, PyTorch's DataLoader workers and many Dask
//! setups all fork a process that has already computed.
//!
//! So each piece of such state lives in a [`ForkLocal`]: a value behind a
//! lock that belongs to the process that made it. A handler registered
//! with `pthread_atfork` counts forks in the child; a `ForkLocal` made
//! before the latest fork is forgotten (leaked, never dropped: dropping a
//! thread pool or a device would wait for threads the child does not have)
//! and a fresh value is made in its place, with a lock of its own. The
//! cost outside a fork is an atomic load per access.

use std::marker::PhantomData;
use std::sync::atomic::{AtomicPtr, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, Once};

/// Forks since this library was first used, as the current process sees
/// them: its ancestors' forks, and its own.
static FORKS: AtomicU64 = AtomicU64::new(0);

/// The number of forks between the first use of this library and the
/// current process: state made under another number belongs to an
/// ancestor.
pub fn generation() -> u64 {
    static REGISTER: Once = Once::new();
    REGISTER.call_once(register);
    FORKS.load(Ordering::Acquire)
}

#[cfg(unix)]
fn register() {
    // Runs in the child right after fork(), while it has a single thread,
    // where only async-signal-safe work is allowed: one atomic add.
    extern "C" fn in_child() {
        FORKS.fetch_add(1, Ordering::AcqRel);
    }
    extern "C" {
        fn pthread_atfork(
            prepare: Option<extern "C" fn()>,
            parent: Option<extern "C" fn()>,
            child: Option<extern "C" fn()>,
        ) -> std::ffi::c_int;
    }
    // SAFETY: registers a handler that lives as long as the process (this
    // library is never unloaded: Python does not unload extensions).
    let failed = unsafe { pthread_atfork(None, None, Some(in_child)) } != 0;
    // Only ENOMEM fails here; a child would then hang as before this
    // module existed, which is better than failing every call.
    debug_assert!(!failed, "pthread_atfork failed");
}

#[cfg(not(unix))]
fn register() {}

/// A value of type `T` (made by `T::default()` on first use) behind a
/// lock, both replaced by fresh ones in a forked child.
pub struct ForkLocal<T> {
    current: AtomicPtr<Owned<T>>,
    _owns: PhantomData<Box<Owned<T>>>,
}

struct Owned<T> {
    generation: u64,
    value: Mutex<T>,
}

// SAFETY: the value is only reached through its Mutex.
unsafe impl<T: Send> Sync for ForkLocal<T> {}
unsafe impl<T: Send> Send for ForkLocal<T> {}

impl<T: Default> ForkLocal<T> {
    pub const fn new() -> Self {
        ForkLocal {
            current: AtomicPtr::new(std::ptr::null_mut()),
            _owns: PhantomData,
        }
    }

    /// The value of the current process, locked (a poisoned lock is taken
    /// as it is: every holder leaves the value consistent).
    pub fn lock(&self) -> MutexGuard<'_, T> {
        self.get()
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn get(&self) -> &Mutex<T> {
        let generation = generation();
        loop {
            let seen = self.current.load(Ordering::Acquire);
            // SAFETY: a published `Owned` is never freed (see below).
            if let Some(owned) = unsafe { seen.as_ref() } {
                if owned.generation == generation {
                    return &owned.value;
                }
            }
            let fresh = Box::into_raw(Box::new(Owned {
                generation,
                value: Mutex::new(T::default()),
            }));
            match self
                .current
                .compare_exchange(seen, fresh, Ordering::AcqRel, Ordering::Acquire)
            {
                // The ancestor's value, if any, is leaked on purpose (see
                // the module's comment): a few bytes per fork, and whatever
                // pages of the parent it holds, which the child shares.
                // SAFETY: published just now, never freed.
                Ok(_) => return unsafe { &(*fresh).value },
                // Another thread published first: use its value.
                // SAFETY: `fresh` was never shared.
                Err(_) => drop(unsafe { Box::from_raw(fresh) }),
            }
        }
    }
}

/// Makes this forked child end, once its interpreter has finished, without
/// the C exit handlers registered before this call (called where a child
/// first opens a GPU: the parent's driver registered them).
///
/// Why: a GPU driver registers an `atexit` handler that joins its worker
/// threads (Mesa's queues). In a child forked from a process that used the
/// GPU, that handler also waits for the parent's threads, which the child
/// does not have, so a child that touched the GPU never exited: a plain
/// `os.fork()` then `sys.exit()` hung (on lavapipe and NVIDIA alike).
/// `multiprocessing`'s workers end with `os._exit` for the same reason.
/// This registers, with glibc's `on_exit`, a handler that runs before the
/// earlier ones (they run newest first): it flushes C's streams and ends
/// the process with the status `exit` was given. Python has finalized by
/// then (its own exit work runs before C's handlers). Elsewhere than glibc
/// nothing is registered.
pub fn end_child_before_driver_exit_handlers() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        use std::ffi::{c_int, c_void};
        // The generation the handler was registered in, plus one (0: none).
        static REGISTERED: AtomicU64 = AtomicU64::new(0);
        let generation = generation();
        if generation == 0 || REGISTERED.swap(generation + 1, Ordering::AcqRel) == generation + 1 {
            return;
        }
        extern "C" {
            fn on_exit(function: extern "C" fn(c_int, *mut c_void), arg: *mut c_void) -> c_int;
            fn fflush(stream: *mut c_void) -> c_int;
            fn _exit(status: c_int) -> !;
        }
        extern "C" fn end(status: c_int, _: *mut c_void) {
            // SAFETY: flushing every C stream and ending the process, as
            // exit() would after its handlers.
            unsafe {
                fflush(std::ptr::null_mut());
                _exit(status)
            }
        }
        // SAFETY: registers a function that lives as long as the process;
        // it runs only at exit().
        unsafe { on_exit(end, std::ptr::null_mut()) };
    }
}

impl<T: Default> Default for ForkLocal<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> Drop for ForkLocal<T> {
    fn drop(&mut self) {
        let owned = *self.current.get_mut();
        // SAFETY: `&mut self`: no reference into the value is left.
        if let Some(owned) = (!owned.is_null()).then(|| unsafe { Box::from_raw(owned) }) {
            // An ancestor's value is leaked, as in `get`.
            if owned.generation != FORKS.load(Ordering::Acquire) {
                std::mem::forget(owned);
            }
        }
    }
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;

    extern "C" {
        fn fork() -> i32;
        fn waitpid(pid: i32, status: *mut i32, options: i32) -> i32;
        fn _exit(code: i32) -> !;
    }

    #[test]
    fn a_forked_child_gets_fresh_values_and_the_parent_keeps_its_own() {
        let local: ForkLocal<Vec<u32>> = ForkLocal::new();
        local.lock().push(1);
        let before = generation();
        // A lock held at the fork (by a thread the child will not have).
        let held = local.lock();
        // SAFETY: the child only touches atomics, its own allocations and
        // _exit before it exits.
        let pid = unsafe { fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            let ok = generation() == before + 1 && local.lock().is_empty();
            unsafe { _exit(if ok { 0 } else { 1 }) };
        }
        drop(held);
        let mut status = 0;
        assert_eq!(unsafe { waitpid(pid, &mut status, 0) }, pid);
        assert_eq!(status, 0, "the child saw its parent's value or lock");
        assert_eq!(generation(), before);
        assert_eq!(*local.lock(), [1]);
    }
}
