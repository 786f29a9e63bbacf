//! How many threads a CPU call runs on (`FLASHPORT_NUM_THREADS`), and
//! running a call's work on them (`runtime/parallel.rs`).

#[cfg(target_arch = "x86_64")]
use super::{simd, tiles};
use std::sync::Arc;

use super::tiles::TileSizes;
use crate::error::{Error, Result};
use crate::fork::ForkLocal;
use crate::problem::Problem;
use crate::runtime::parallel;

/// Environment variable that sets the number of CPU threads.
pub const NUM_THREADS_ENV: &str = "FLASHPORT_NUM_THREADS";

/// The most threads `FLASHPORT_NUM_THREADS` may ask for, unless the
/// machine has more cores.
///
/// This compute-bound work gains nothing from more threads than cores,
/// but the bound is not a multiple of this machine's cores: a setting
/// written for a large server should still work on a 2-core runner
/// (slower, oversubscribed), not fail there. 1024 is above the hardware
/// threads of today's largest two-socket servers (768) and far below what
/// exhausts a process (each helper holds a stack and a kernel task), while
/// a typo such as `4294967297` would otherwise spawn threads until the
/// machine gives out.
pub const MAX_THREADS: usize = 1024;

/// The thread count of the next call: `FLASHPORT_NUM_THREADS` when set,
/// otherwise every available core. Read on every call so that it can be
/// changed at run time.
pub fn num_threads() -> Result<usize> {
    parse_num_threads(
        std::env::var_os(NUM_THREADS_ENV).as_deref(),
        available_cores(),
    )
}

fn available_cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// `FLASHPORT_NUM_THREADS`'s value (`None`: unset) on a machine of `cores`.
/// Every value set is checked, including an empty one or one that is not
/// text: a setting that is silently ignored looks like one that works.
fn parse_num_threads(value: Option<&std::ffi::OsStr>, cores: usize) -> Result<usize> {
    let Some(value) = value else {
        return Ok(cores);
    };
    let max = MAX_THREADS.max(cores);
    match value.to_str().map(|text| text.trim().parse::<usize>()) {
        Some(Ok(n)) if (1..=max).contains(&n) => Ok(n),
        _ => Err(Error::Value {
            argument: NUM_THREADS_ENV.to_string(),
            value: format!("{:?}", value.to_string_lossy()),
            reason: format!(
                "expected a whole number of threads from 1 to {max} (this machine has {cores} \
                 cores), or unset for all of them"
            ),
        }),
    }
}

/// Whether float32 runs the AVX2+FMA kernels on this CPU.
pub fn simd_kernels() -> bool {
    #[cfg(target_arch = "x86_64")]
    return simd::available();
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// `threads` helper threads: those of the one pool, grown first if it has
/// fewer. A call that asks for fewer leaves the rest idle.
///
/// One pool, not one per thread count: a program that tries counts one
/// after another (a benchmark over 1..64) kept every pool and 2,018
/// threads. Growing replaces the pool; the old one's threads exit once the
/// calls still using it are done, so the threads never exceed the largest
/// count asked for, plus those of pools on their way out. A forked child
/// starts a pool of its own (`fork.rs`).
fn helper_threads(threads: usize) -> Result<parallel::Helpers> {
    static POOL: ForkLocal<Option<Arc<rayon::ThreadPool>>> = ForkLocal::new();
    let mut pool = POOL.lock();
    let pool = match pool.as_ref() {
        Some(p) if p.current_num_threads() >= threads => p.clone(),
        _ => {
            let grown = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .thread_name(|i| format!("flashport-{i}"))
                .build()
                .map_err(|e| Error::Value {
                    argument: NUM_THREADS_ENV.to_string(),
                    value: (threads + 1).to_string(),
                    reason: format!("could not start the thread pool: {e}"),
                })?;
            pool.insert(Arc::new(grown)).clone()
        }
    };
    Ok(parallel::Helpers {
        pool,
        count: threads,
    })
}

/// Runs `f` on this thread with the configured number of threads in all
/// (see `runtime/parallel.rs`), with tiles chosen for them.
pub(super) fn run_on_pool<R: Send>(
    problem: &Problem,
    element_bytes: usize,
    f: impl FnOnce(TileSizes) -> R + Send,
) -> Result<R> {
    let threads = num_threads()?;
    let tiles = tiles::choose(problem, threads, element_bytes);
    run_with(threads, || f(tiles))
}

/// Runs `f` on this thread with `threads` threads in all serving its
/// `parallel::for_each` calls.
pub(super) fn run_with<R: Send>(threads: usize, f: impl FnOnce() -> R + Send) -> Result<R> {
    let helpers = match threads {
        1 => None,
        _ => Some(helper_threads(threads - 1)?),
    };
    Ok(parallel::with_helpers(helpers, f))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::OsStr;

    #[test]
    fn thread_counts_are_bounded_and_every_bad_value_is_an_error() {
        let parse = |text: &str| parse_num_threads(Some(OsStr::new(text)), 2);
        assert_eq!(parse_num_threads(None, 6), Ok(6));
        assert_eq!(parse("3"), Ok(3));
        assert_eq!(parse(" 64 "), Ok(64));
        assert_eq!(parse("1024"), Ok(MAX_THREADS));
        // A machine with more cores than the bound may use them all.
        assert_eq!(parse_num_threads(Some(OsStr::new("2048")), 2048), Ok(2048));
        for bad in [
            "4294967297",
            "1025",
            "0",
            "-1",
            "",
            "  ",
            "two",
            "1.5",
            "99999999999999999999999",
        ] {
            match parse(bad) {
                Err(Error::Value {
                    argument,
                    value,
                    reason,
                }) => {
                    assert_eq!(argument, NUM_THREADS_ENV);
                    assert_eq!(value, format!("{bad:?}"));
                    assert!(reason.contains("from 1 to 1024"), "{reason}");
                }
                other => panic!("{bad:?} gave {other:?}"),
            }
        }
    }

    #[cfg(unix)]
    #[test]
    fn a_value_that_is_not_text_is_an_error() {
        use std::os::unix::ffi::OsStrExt;
        let err = parse_num_threads(Some(OsStr::from_bytes(b"4\xff")), 2).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("FLASHPORT_NUM_THREADS=\"4\u{fffd}\""),
            "{err}"
        );
    }
}
