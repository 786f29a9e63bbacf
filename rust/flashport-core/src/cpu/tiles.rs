//! The one place where CPU tile sizes are chosen.
//!
//! FlashAttention sizes its key tiles so that the working set of a tile
//! step fits the fast memory: `B_c = M / (4 d)` with `M` the cache of one
//! core. On the CPU the cache in question is the core's private L2, read at
//! run time; the query tile is then shrunk if the problem would otherwise
//! give some threads no work.

use std::sync::OnceLock;

use crate::problem::Problem;

/// Rows of a query tile and of a key/value tile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TileSizes {
    /// Query rows of one parallel task (forward, dQ). Follows the thread
    /// count, which is harmless: no sum runs across query rows there.
    pub q_rows: usize,
    /// Query rows per step of a dK/dV task. These steps are summed into
    /// dK and dV in registers, so their size must not follow the thread
    /// count, or the summation order (and the bits) would.
    pub q_block: usize,
    pub k_rows: usize,
}

const FALLBACK_CACHE_BYTES: usize = 512 * 1024;
const MIN_CACHE_BYTES: usize = 64 * 1024;
const MAX_CACHE_BYTES: usize = 4 * 1024 * 1024;
const MIN_KEY_ROWS: usize = 16;
const MAX_KEY_ROWS: usize = 256;
const MAX_QUERY_ROWS: usize = 64;
const MIN_QUERY_ROWS: usize = 8;
/// Tasks per thread below which query tiles are shrunk, so that rayon's
/// work stealing can even out causal tiles of unequal cost.
const TASKS_PER_THREAD: usize = 4;

/// Size in bytes of the largest cache private to one core (L2 on current
/// x86 and Arm parts), read once from sysfs; a conservative default where
/// it cannot be read.
pub fn per_core_cache_bytes() -> usize {
    static CACHE: OnceLock<usize> = OnceLock::new();
    // Virtual machines sometimes report a host-wide figure as the L2 of one
    // vCPU (300 MiB was seen on a cloud VM): clamp to what any core has.
    *CACHE.get_or_init(|| {
        read_per_core_cache()
            .unwrap_or(FALLBACK_CACHE_BYTES)
            .clamp(MIN_CACHE_BYTES, MAX_CACHE_BYTES)
    })
}

fn read_per_core_cache() -> Option<usize> {
    let base = std::path::Path::new("/sys/devices/system/cpu/cpu0/cache");
    let mut best = None;
    for entry in std::fs::read_dir(base).ok()? {
        let dir = entry.ok()?.path();
        let read = |name: &str| std::fs::read_to_string(dir.join(name)).ok();
        let kind = read("type").unwrap_or_default();
        let Some(level) = read("level").and_then(|l| l.trim().parse::<u32>().ok()) else {
            continue;
        };
        // L1 and L2 are private to a core on current x86 and Arm server
        // parts, L3 is shared. The sharing list cannot tell them apart: on
        // a small VM the shared L3 lists only the VM's own CPUs.
        if kind.trim() == "Instruction" || level > 2 {
            continue;
        }
        let size = parse_size(read("size")?.trim())?;
        best = Some(best.map_or(size, |b: usize| b.max(size)));
    }
    best
}

fn parse_size(text: &str) -> Option<usize> {
    let (digits, unit) = text.split_at(text.find(|c: char| !c.is_ascii_digit())?);
    let n: usize = digits.parse().ok()?;
    match unit {
        "K" => Some(n * 1024),
        "M" => Some(n * 1024 * 1024),
        _ => None,
    }
}

/// Row stride, in elements, of a backward tile of scores `n` keys wide.
///
/// The products `dV += Pᵀ·dO` and `dK += dSᵀ·Q` read these tiles down
/// their columns, six columns at a time across every query row. With rows
/// a power of two of bytes apart (1 KiB at 256 keys of float32) those
/// reads fall into a few of L1's 64 sets and evict each other before the
/// next six columns reuse the lines: the product ran at 87 GFLOP/s against
/// 93 with rows an odd number of 64-byte lines apart, which spreads them
/// over every set.
pub fn score_stride(n: usize, element_bytes: usize) -> usize {
    const LINE: usize = 64;
    let lines = (n * element_bytes).div_ceil(LINE);
    let lines = lines + (1 - lines % 2);
    lines * LINE / element_bytes
}

/// Backward tasks wanted in all: enough to occupy a many-core machine.
const BACKWARD_TASKS: usize = 16;
/// Each chunk costs a dQ partial as large as the head group's dQ.
const MAX_BACKWARD_CHUNKS: usize = 8;

/// Chunks of key tiles per key/value head in the backward. A function of
/// the problem alone, never of the thread count: the dQ partials are summed
/// per chunk, so the chunking fixes the bits.
pub fn backward_key_chunks(kv_heads: usize, key_tiles: usize) -> usize {
    BACKWARD_TASKS
        .div_ceil(kv_heads.max(1))
        .min(MAX_BACKWARD_CHUNKS)
        .min(key_tiles)
        .max(1)
}

/// Tile sizes for a problem run on `threads` threads.
pub fn choose(problem: &Problem, threads: usize, element_bytes: usize) -> TileSizes {
    choose_for_cache(problem, threads, element_bytes, per_core_cache_bytes())
}

fn choose_for_cache(
    problem: &Problem,
    threads: usize,
    element_bytes: usize,
    cache_bytes: usize,
) -> TileSizes {
    let widest = problem.head_dim.max(problem.value_dim).max(1);
    let k_rows = (cache_bytes / (4 * widest * element_bytes))
        .clamp(MIN_KEY_ROWS, MAX_KEY_ROWS)
        // Packed key panels are 16 columns wide: tiles start on a panel.
        .next_multiple_of(16);
    let rows_per_head = problem.batch * problem.heads_q;
    let wanted_tasks = threads * TASKS_PER_THREAD;
    let tiles_per_head = wanted_tasks.div_ceil(rows_per_head.max(1));
    let q_rows = problem
        .seq_q
        .div_ceil(tiles_per_head)
        .next_multiple_of(MIN_QUERY_ROWS)
        .clamp(MIN_QUERY_ROWS, MAX_QUERY_ROWS);
    TileSizes {
        q_rows,
        q_block: MAX_QUERY_ROWS,
        k_rows,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::problem::{validate_forward, ArrayInfo, Options};

    fn problem(heads: usize, seq: usize, d: usize) -> Problem {
        let q = [1, heads, seq, d];
        validate_forward(
            ArrayInfo::new(&q, "float32"),
            ArrayInfo::new(&q, "float32"),
            ArrayInfo::new(&q, "float32"),
            &Options::default(),
        )
        .unwrap()
    }

    #[test]
    fn key_tiles_follow_the_cache() {
        let small = choose_for_cache(&problem(8, 4096, 64), 2, 4, 256 * 1024);
        let large = choose_for_cache(&problem(8, 4096, 64), 2, 4, 1024 * 1024);
        assert_eq!(small.k_rows, 256 * 1024 / (4 * 64 * 4));
        assert!(large.k_rows >= small.k_rows);
        assert!(large.k_rows <= MAX_KEY_ROWS);
        let wide = choose_for_cache(&problem(8, 4096, 256), 2, 4, 256 * 1024);
        assert_eq!(wide.k_rows, 64);
    }

    #[test]
    fn one_head_is_split_across_threads() {
        let t = choose_for_cache(&problem(1, 1000, 64), 8, 4, 512 * 1024);
        assert!(1000usize.div_ceil(t.q_rows) >= 8);
    }

    #[test]
    fn backward_chunks_follow_the_heads_and_stay_bounded() {
        assert_eq!(backward_key_chunks(1, 32), MAX_BACKWARD_CHUNKS);
        assert_eq!(backward_key_chunks(1, 3), 3);
        assert_eq!(backward_key_chunks(4, 32), BACKWARD_TASKS / 4);
        assert_eq!(backward_key_chunks(64, 32), 1);
        assert_eq!(backward_key_chunks(2, 0), 1);
    }

    #[test]
    fn score_rows_are_an_odd_number_of_lines_apart() {
        for bytes in [4, 8] {
            let mut last = 0;
            for n in 0..600 {
                let ld = score_stride(n, bytes);
                assert!(ld >= n && ld >= last, "{n} {bytes}");
                assert_eq!(ld * bytes % 64, 0);
                assert_eq!(ld * bytes / 64 % 2, 1);
                last = ld;
            }
        }
        assert_eq!(score_stride(256, 4), 272);
    }

    #[test]
    fn parses_sysfs_sizes() {
        assert_eq!(parse_size("512K"), Some(512 * 1024));
        assert_eq!(parse_size("32M"), Some(32 * 1024 * 1024));
        assert_eq!(parse_size("abc"), None);
    }
}
