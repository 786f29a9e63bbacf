//! How much memory this process can have: the machine's physical memory
//! (`MemTotal`) or its cgroup's limit, whichever is smaller.
//!
//! Why: a size check that waits for an allocation to fail does not work
//! where memory is overcommitted (`vm.overcommit_memory=1`, most
//! containers, many servers). There the allocation of a 512 GiB copy
//! succeeds, the work starts, and the process runs for minutes or is
//! killed when it touches the pages. Every large host allocation asks
//! [`admits`] first, so that a problem larger than the machine is a
//! `ProblemTooLargeError` at once, whatever the kernel's policy.
//! Elsewhere than Linux nothing is known here, and the allocator's
//! failure is the check, as before.

use std::sync::OnceLock;

/// The bytes this process can have, if known (read once).
pub fn limit() -> Option<u64> {
    static LIMIT: OnceLock<Option<u64>> = OnceLock::new();
    *LIMIT.get_or_init(|| {
        let total = std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|text| mem_total(&text));
        let cgroup = cgroup_limit();
        match (total, cgroup) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    })
}

/// Whether `bytes` can be had at all: no more than [`limit`].
pub fn admits(bytes: u128) -> bool {
    limit().is_none_or(|limit| bytes <= limit as u128)
}

/// What a refusal adds to its message: the limit it met.
pub fn why() -> String {
    match limit() {
        Some(limit) => format!(" (this machine and its cgroup give a process {limit} bytes)"),
        None => String::new(),
    }
}

/// `MemTotal` of /proc/meminfo's text, in bytes.
fn mem_total(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    let mut words = line.split_whitespace().skip(1);
    let kib: u64 = words.next()?.parse().ok()?;
    (words.next() == Some("kB")).then_some(kib.checked_mul(1024)?)
}

/// The smallest memory limit on this process's cgroup and its ancestors:
/// cgroup v2's `memory.max` along the path /proc/self/cgroup gives for
/// the unified hierarchy (`0::/path`), and v1's `memory.limit_in_bytes`
/// along the memory controller's path (`N:memory:/path`; a huge value
/// there means none). Hybrid systems list both.
fn cgroup_limit() -> Option<u64> {
    let cgroups = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let mut smallest: Option<u64> = None;
    for line in cgroups.lines() {
        let mut fields = line.splitn(3, ':');
        let (_, controllers, path) = (fields.next(), fields.next()?, fields.next()?);
        let (root, file) = match controllers {
            "" => ("/sys/fs/cgroup", "memory.max"),
            c if c.split(',').any(|c| c == "memory") => {
                ("/sys/fs/cgroup/memory", "memory.limit_in_bytes")
            }
            _ => continue,
        };
        let mut dir = format!("{root}{}", path.trim_end_matches('/'));
        loop {
            let limit = std::fs::read_to_string(format!("{dir}/{file}"))
                .ok()
                .and_then(|text| limit_value(&text));
            if let Some(limit) = limit {
                smallest = Some(smallest.map_or(limit, |s| s.min(limit)));
            }
            match dir.rfind('/') {
                Some(cut) if dir.len() > root.len() => dir.truncate(cut),
                _ => break,
            }
        }
    }
    smallest
}

/// A limit file's value: bytes, or none for v2's "max" and v1's huge
/// "unlimited" (2^63 rounded down to a page).
fn limit_value(text: &str) -> Option<u64> {
    text.trim()
        .parse::<u64>()
        .ok()
        .filter(|&limit| limit < 1 << 60)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mem_total_is_read_in_bytes() {
        let text = "MemTotal:       24567892 kB\nMemFree:          123 kB\n";
        assert_eq!(mem_total(text), Some(24567892 * 1024));
        assert_eq!(mem_total("MemFree: 1 kB\n"), None);
        assert_eq!(mem_total("MemTotal: many kB\n"), None);
    }

    #[test]
    fn unlimited_cgroups_have_no_limit() {
        assert_eq!(limit_value("max\n"), None);
        assert_eq!(limit_value("9223372036854771712\n"), None);
        assert_eq!(limit_value("1073741824\n"), Some(1 << 30));
    }

    #[test]
    fn this_machine_has_a_limit_on_linux() {
        if cfg!(target_os = "linux") {
            let limit = limit().expect("MemTotal on Linux");
            assert!(limit > 1 << 26, "{limit}");
            assert!(admits(1 << 20));
            assert!(!admits(u128::from(limit) + 1));
        }
    }
}
