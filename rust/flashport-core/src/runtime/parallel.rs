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

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use crate::error::{Error, Result};
use crate::fork::ForkLocal;
use crate::interrupt;

/// The threads beyond the calling one that serve a call: `count` of the
/// pool's threads (the pool may have more, for calls that ask for more).
#[derive(Clone)]
pub struct Helpers {
    pub pool: Arc<rayon::ThreadPool>,
    pub count: usize,
}

/// Whether the call a thread works for must stop (`interrupt.rs`).
#[derive(Clone)]
enum Stop {
    /// The calling thread, which asks the caller's check.
    Caller(Rc<Poll>),
    /// A helper, which follows the calling thread's verdict.
    Helper(Arc<AtomicBool>),
}

struct Poll {
    stop: Arc<AtomicBool>,
    check: interrupt::Check,
    next: Cell<Instant>,
}

impl Poll {
    fn stopping(&self) -> bool {
        if self.stop.load(Ordering::Relaxed) {
            return true;
        }
        if Instant::now() < self.next.get() {
            return false;
        }
        if (self.check.ask)() {
            self.stop.store(true, Ordering::Relaxed);
            return true;
        }
        // From the end of the check: it may have waited for Python's lock.
        self.next.set(Instant::now() + self.check.every);
        false
    }
}

thread_local! {
    /// The helper threads of the call running on this thread, if any.
    static HELPERS: RefCell<Option<Helpers>> = const { RefCell::new(None) };
    /// Whether the call this thread works for must stop; none when its
    /// caller gave no check.
    static STOP: RefCell<Option<Stop>> = const { RefCell::new(None) };
}

/// Runs `f` with the thread-local `state` set to `value`, then restores
/// the one it had (also when `f` panics).
fn with_local<S: 'static, R>(
    state: &'static std::thread::LocalKey<RefCell<Option<S>>>,
    value: Option<S>,
    f: impl FnOnce() -> R,
) -> R {
    struct Restore<S: 'static>(
        &'static std::thread::LocalKey<RefCell<Option<S>>>,
        Option<S>,
    );
    impl<S> Drop for Restore<S> {
        fn drop(&mut self) {
            let previous = self.1.take();
            self.0.with(|s| *s.borrow_mut() = previous);
        }
    }
    let _restore = Restore(state, state.with(|s| s.replace(value)));
    f()
}

/// Runs `f`, one call of the CPU backend, with `helpers` serving the
/// [`for_each`] calls made on this thread, stopping early (those return
/// [`Error::Interrupted`]) when the caller's interrupt check says so.
pub fn with_helpers<R>(helpers: Option<Helpers>, f: impl FnOnce() -> R) -> R {
    let stop = interrupt::current().map(|check| {
        Stop::Caller(Rc::new(Poll {
            stop: Arc::default(),
            // Not in the call's first interval: a short call never asks.
            next: Cell::new(Instant::now() + check.every),
            check,
        }))
    });
    with_local(&HELPERS, helpers, || with_local(&STOP, stop, f))
}

/// Whether the current call must stop, for a long loop inside one item of
/// [`for_each`] (it also checks between items). On the calling thread
/// this may run the caller's check; elsewhere it reads an atomic.
pub fn stopping() -> bool {
    let caller = STOP.with(|s| match &*s.borrow() {
        None => Err(false),
        Some(Stop::Helper(stop)) => Err(stop.load(Ordering::Relaxed)),
        Some(Stop::Caller(poll)) => Ok(poll.clone()),
    });
    // Outside the borrow: the check may run code that calls in again.
    match caller {
        Ok(poll) => poll.stopping(),
        Err(stopping) => stopping,
    }
}

/// Calls `f` on every item, on this thread and the helpers (on this
/// thread alone without helpers, or when called from a helper), unless
/// the call is to stop: then each thread stops before its next item and
/// this returns [`Error::Interrupted`], with some items never visited.
pub fn for_each<I: Send>(items: Vec<I>, f: impl Fn(I) + Sync) -> Result<()> {
    run(items, f, true);
    finished()
}

/// [`for_each`] for a pass that must visit every item (it initialises
/// memory that is used afterwards) and is short: it never stops early.
pub fn for_every<I: Send>(items: Vec<I>, f: impl Fn(I) + Sync) {
    run(items, f, false);
}

fn run<I: Send>(items: Vec<I>, f: impl Fn(I) + Sync, interruptible: bool) {
    let stopping = || interruptible && stopping();
    let count = items.len();
    let helpers = match HELPERS.with(|h| h.borrow().clone()) {
        Some(helpers) if count > 1 && helpers.count > 0 => Some(helpers),
        _ => None,
    };
    let Some(Helpers {
        pool,
        count: wanted,
    }) = helpers
    else {
        for item in items {
            if stopping() {
                break;
            }
            f(item);
        }
        return;
    };
    let queue = Mutex::new(items.into_iter());
    let next = || queue.lock().unwrap_or_else(PoisonError::into_inner).next();
    let work = || {
        while !stopping() {
            match next() {
                Some(item) => f(item),
                None => break,
            }
        }
    };
    let helpers = wanted.min(pool.current_num_threads()).min(count - 1);
    let overrides = crate::overrides::current();
    let stop = STOP.with(|s| match &*s.borrow() {
        Some(Stop::Caller(poll)) => Some(poll.stop.clone()),
        _ => None,
    });
    // A panic in any of them reaches the caller once all have stopped.
    pool.in_place_scope(|scope| {
        for _ in 0..helpers {
            let stop = stop.clone();
            scope.spawn(move |_| {
                crate::overrides::on_helper(overrides, || {
                    with_local(&STOP, stop.map(Stop::Helper), work)
                })
            });
        }
        work();
    });
}

/// What a [`for_each`] returns once every thread has left it.
fn finished() -> Result<()> {
    let stopped = STOP.with(|s| match &*s.borrow() {
        Some(Stop::Caller(poll)) => poll.stop.load(Ordering::Relaxed),
        Some(Stop::Helper(stop)) => stop.load(Ordering::Relaxed),
        None => false,
    });
    // Once the check said stop, the call must say so even if every item
    // was done: the caller's check may have consumed the interrupt.
    match stopped {
        true => Err(Error::Interrupted),
        false => Ok(()),
    }
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
    use std::sync::atomic::AtomicUsize;
    use std::time::Duration;

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
                })
            })
            .unwrap();
            assert!(hits.iter().all(|&h| h == 1));
            assert_eq!(calls.into_inner(), 100);
        }
        // Restored after the call: no helpers outside it.
        assert!(HELPERS.with(|h| h.borrow().is_none()));
    }

    fn pool(threads: usize) -> Arc<rayon::ThreadPool> {
        Arc::new(
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap(),
        )
    }

    #[test]
    fn a_check_that_says_stop_ends_the_call_early_and_the_helpers_stay_usable() {
        let pool = pool(3);
        let helpers = || {
            Some(Helpers {
                pool: pool.clone(),
                count: 3,
            })
        };
        for helpers in [None, helpers()] {
            let asked = Rc::new(Cell::new(0));
            let counter = asked.clone();
            let done = AtomicUsize::new(0);
            let item = |_| {
                std::thread::sleep(Duration::from_micros(200));
                done.fetch_add(1, Ordering::Relaxed);
            };
            let every = Duration::from_millis(5);
            let (first, second) = interrupt::with_check_every(
                every,
                move || {
                    counter.set(counter.get() + 1);
                    true
                },
                || {
                    with_helpers(helpers.clone(), || {
                        let first = for_each((0..10_000).collect(), item);
                        // The verdict holds for the rest of the call.
                        (first, for_each((0..10).collect(), item))
                    })
                },
            );
            assert_eq!(first, Err(Error::Interrupted));
            assert_eq!(second, Err(Error::Interrupted));
            assert_eq!(asked.get(), 1, "asked again after it said stop");
            let done = done.into_inner();
            assert!(done > 0 && done < 1000, "{done} items ran");
            // The next call runs to the end on the same helpers.
            let hits = AtomicUsize::new(0);
            let all = with_helpers(helpers, || {
                for_each((0..100).collect(), |_: i32| {
                    hits.fetch_add(1, Ordering::Relaxed);
                })
            });
            assert_eq!(all, Ok(()));
            assert_eq!(hits.into_inner(), 100);
        }
    }

    #[test]
    fn a_short_call_never_asks() {
        let never = || -> bool { panic!("a short call asked whether to stop") };
        let result = interrupt::with_check(never, || {
            with_helpers(
                Some(Helpers {
                    pool: pool(2),
                    count: 2,
                }),
                || {
                    for_each((0..1000).collect(), |x: u64| {
                        std::hint::black_box(x * x);
                    })
                },
            )
        });
        assert_eq!(result, Ok(()));
    }

    #[test]
    fn a_check_that_says_go_on_is_asked_again_and_the_call_completes() {
        let asked = Rc::new(Cell::new(0));
        let counter = asked.clone();
        let done = AtomicUsize::new(0);
        let result = interrupt::with_check_every(
            Duration::from_millis(1),
            move || {
                counter.set(counter.get() + 1);
                false
            },
            || {
                with_helpers(
                    Some(Helpers {
                        pool: pool(2),
                        count: 1,
                    }),
                    || {
                        for_each((0..200).collect(), |_: i32| {
                            std::thread::sleep(Duration::from_micros(100));
                            done.fetch_add(1, Ordering::Relaxed);
                        })
                    },
                )
            },
        );
        assert_eq!(result, Ok(()));
        assert_eq!(done.into_inner(), 200);
        assert!(asked.get() >= 2, "asked {} times", asked.get());
    }
}
