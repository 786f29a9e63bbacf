//! Fork-join with the calling thread as one of the workers.
//!
//! With `rayon::ThreadPool::install` the caller hands the whole call to a
//! pool thread and sleeps; that thread then wakes the next one. After the
//! pause between two calls (any application that does something else
//! between attention calls, and the benchmark), the Linux scheduler often
//! queued that second wake-up on the busy CPU of the first, next to it,
//! until a load balance moved it milliseconds later: a 2-thread
//! (1,8,1024,64) causal forward took 14 ms after a 0.3 s pause and 7.7 ms
//! back to back. Here the caller keeps computing while it wakes the
//! helpers, so a woken helper finds its own CPU busy and goes to an idle
//! one, and a call on one thread involves no other thread at all.
//!
//! Items are taken one at a time from a shared queue by whichever thread is
//! free. What an item computes must not depend on the thread that runs it
//! (every CPU task writes only outputs it owns, and sums across tasks are
//! made afterwards in a fixed order), so the results do not depend on the
//! thread count or on scheduling.

use std::cell::RefCell;
use std::sync::{Arc, Mutex, PoisonError};

use crate::fork::ForkLocal;

/// The threads beyond the calling one that serve a call: `count` of the
/// pool's threads (the pool may have more, for calls that ask for more).
#[derive(Clone)]
pub struct Helpers {
    pub pool: Arc<rayon::ThreadPool>,
    pub count: usize,
}

thread_local! {
    /// The helper threads of the call running on this thread, if any.
    static HELPERS: RefCell<Option<Helpers>> = const { RefCell::new(None) };
}

/// Runs `f` with `helpers` serving [`for_each`] calls made on this thread.
pub fn with_helpers<R>(helpers: Option<Helpers>, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<Helpers>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let previous = self.0.take();
            HELPERS.with(|h| *h.borrow_mut() = previous);
        }
    }
    let _restore = Restore(HELPERS.with(|h| h.replace(helpers)));
    f()
}

/// Calls `f` on every item, on this thread and the helpers (on this
/// thread alone without helpers, or when called from a helper).
pub fn for_each<I: Send>(items: Vec<I>, f: impl Fn(I) + Sync) {
    let count = items.len();
    let Helpers {
        pool,
        count: wanted,
    } = match HELPERS.with(|h| h.borrow().clone()) {
        Some(helpers) if count > 1 && helpers.count > 0 => helpers,
        _ => return items.into_iter().for_each(f),
    };
    let queue = Mutex::new(items.into_iter());
    let next = || queue.lock().unwrap_or_else(PoisonError::into_inner).next();
    let work = || {
        while let Some(item) = next() {
            f(item);
        }
    };
    let helpers = wanted.min(pool.current_num_threads()).min(count - 1);
    let overrides = crate::overrides::current();
    // A panic in any of them reaches the caller once all have stopped.
    pool.in_place_scope(|scope| {
        for _ in 0..helpers {
            scope.spawn(|_| crate::overrides::on_helper(overrides, work));
        }
        work();
    });
}

/// Runs `op` on the pool that serves rayon's parallel iterators in this
/// crate (converting a mask, copying a GPU transfer), sized as rayon's
/// global pool would be.
///
/// Never rayon's global pool itself: a process forked after using it
/// keeps the pool without its threads, and a parallel iterator there waits
/// for ever; this one is the current process's own (`fork.rs`). Handing
/// `op` to the pool costs what a parallel iterator called from outside
/// rayon's global pool cost: a wake-up and a wait.
pub(crate) fn install<R: Send>(op: impl FnOnce() -> R + Send) -> R {
    static POOL: ForkLocal<Option<Arc<rayon::ThreadPool>>> = ForkLocal::new();
    let pool = {
        let mut slot = POOL.lock();
        match slot.as_ref() {
            Some(pool) => Some(pool.clone()),
            None => rayon::ThreadPoolBuilder::new()
                .thread_name(|i| format!("flashport-rayon-{i}"))
                .build()
                .ok()
                .map(|pool| slot.insert(Arc::new(pool)).clone()),
        }
    };
    match pool {
        Some(pool) => pool.install(op),
        // Threads could not be started: rayon's global pool, as before.
        None => op(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn every_item_runs_once_with_and_without_helpers() {
        let pool = Arc::new(
            rayon::ThreadPoolBuilder::new()
                .num_threads(3)
                .build()
                .unwrap(),
        );
        let helpers = |count| {
            Some(Helpers {
                pool: pool.clone(),
                count,
            })
        };
        for helpers in [None, helpers(3), helpers(1)] {
            let mut hits = vec![0usize; 100];
            let calls = AtomicUsize::new(0);
            with_helpers(helpers, || {
                for_each(hits.iter_mut().collect(), |h| {
                    *h += 1;
                    calls.fetch_add(1, Ordering::Relaxed);
                });
            });
            assert!(hits.iter().all(|&h| h == 1));
            assert_eq!(calls.into_inner(), 100);
        }
        // Restored after the call: no helpers outside it.
        assert!(HELPERS.with(|h| h.borrow().is_none()));
    }
}
