//! Stopping a long call early when its caller is interrupted (Ctrl-C).
//!
//! A caller that can be interrupted runs the call inside [`with_check`],
//! giving a function that says whether to stop (the Python binding's runs
//! Python's signal handlers). The CPU's parallel loop (`runtime/parallel.rs`)
//! calls it on the calling thread, between units of work, at most once
//! every [`POLL_INTERVAL`] and never in a call's first one: a short call
//! never pays for it. Once it says stop, each thread of the call stops
//! before its next unit and the call returns [`Error::Interrupted`]: no
//! output, inputs as they were, the helper threads idle and ready for the
//! next call.
//!
//! Polling the caller's own check, rather than installing a signal
//! handler here, leaves signals to whoever owns them (Python's handlers,
//! including one a program installed, decide what Ctrl-C means), and only
//! the thread that made the call ever runs it.
//!
//! [`Error::Interrupted`]: crate::error::Error::Interrupted

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

/// How often a long call asks whether to stop. A stop is noticed within
/// this and one unit of work (a tile of query rows, or a block of them in
/// the backward), well under a second for a Ctrl-C.
pub const POLL_INTERVAL: Duration = Duration::from_millis(50);

/// A caller's "should this call stop?", and how often to ask it.
#[derive(Clone)]
pub(crate) struct Check {
    pub ask: Rc<dyn Fn() -> bool>,
    pub every: Duration,
}

thread_local! {
    static CHECK: RefCell<Option<Check>> = const { RefCell::new(None) };
}

/// Runs `f` (a call of this crate, on this thread) with `check` asked,
/// on this thread only, whether to stop; see the module's comment.
pub fn with_check<R>(check: impl Fn() -> bool + 'static, f: impl FnOnce() -> R) -> R {
    with_check_every(POLL_INTERVAL, check, f)
}

/// [`with_check`], asking every `every` (tests ask at once).
pub(crate) fn with_check_every<R>(
    every: Duration,
    check: impl Fn() -> bool + 'static,
    f: impl FnOnce() -> R,
) -> R {
    struct Restore(Option<Check>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let previous = self.0.take();
            CHECK.with(|c| *c.borrow_mut() = previous);
        }
    }
    let check = Check {
        ask: Rc::new(check),
        every,
    };
    let _restore = Restore(CHECK.with(|c| c.replace(Some(check))));
    f()
}

/// The check of the call running on this thread, if its caller gave one.
pub(crate) fn current() -> Option<Check> {
    CHECK.with(|c| c.borrow().clone())
}
