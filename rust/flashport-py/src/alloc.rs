//! The extension's allocator: the system's, asking Linux for transparent
//! huge pages on every block of 4 MiB or more, as NumPy's own allocator
//! does for its arrays (`madvise(MADV_HUGEPAGE)`, same threshold).
//!
//! Why: the core's outputs are Rust vectors that become NumPy arrays as
//! they are (`PyArray::from_vec`), and a fresh vector is faulted in by the
//! kernel one 4 KiB page at a time as it is first written. Writing 64 MiB
//! that way took 16,385 page faults and 19–30 ms on the 2-core VM, against
//! 544 faults and 4–5 ms with the advice (NumPy's `empty` + `fill`: 544
//! and 3.5 ms). One allocator covers every large buffer, outputs, GPU
//! readbacks, KV-cache copies and the core's scratch alike, instead of
//! each place that makes one. Advice only: a kernel without transparent
//! huge pages, or with them set to `never`, ignores it, and allocation
//! and its failure are the system allocator's, unchanged.

use std::alloc::{GlobalAlloc, Layout, System};

/// Bytes from which a block is advised (NumPy's threshold, 4 MiB).
const HUGE_PAGES_FROM: usize = 4 << 20;

/// [`System`], with huge pages asked for large blocks.
pub(crate) struct HugePagesForLarge;

// SAFETY: every call is System's, with the same arguments; the advice
// after it changes how the kernel backs the block's pages, not its
// address, size or contents.
unsafe impl GlobalAlloc for HugePagesForLarge {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract is System's.
        let block = unsafe { System.alloc(layout) };
        advise(block, layout.size());
        block
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as in `alloc`. A large zeroed block is fresh memory
        // the C library did not touch (calloc), so the advice still
        // comes before its first write.
        let block = unsafe { System.alloc_zeroed(layout) };
        advise(block, layout.size());
        block
    }

    unsafe fn dealloc(&self, block: *mut u8, layout: Layout) {
        // SAFETY: as in `alloc`.
        unsafe { System.dealloc(block, layout) }
    }

    unsafe fn realloc(&self, block: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: as in `alloc`.
        let moved = unsafe { System.realloc(block, layout, new_size) };
        advise(moved, new_size);
        moved
    }
}

/// Asks the kernel to back the whole pages of `size` bytes at `block`
/// with huge pages, when the block is large (Linux only; the answer is
/// ignored: advice the kernel cannot take changes nothing).
#[inline]
fn advise(block: *mut u8, size: usize) {
    #[cfg(target_os = "linux")]
    if size >= HUGE_PAGES_FROM && !block.is_null() {
        // SAFETY: sysconf reads a constant of the process.
        let page = match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
            p if p > 0 => p as usize,
            _ => return,
        };
        let start = (block as usize).next_multiple_of(page);
        let end = (block as usize + size) / page * page;
        if end > start {
            // SAFETY: the pages lie inside the block just allocated, and
            // MADV_HUGEPAGE neither moves nor changes their contents.
            unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (block, size);
}
