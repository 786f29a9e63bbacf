"""Problems larger than memory are a ProblemTooLargeError naming what could
not be had, never an abort or a process killed later: every large host
allocation is checked against the memory the machine and its cgroup give
a process (flashport_core::host_memory) before it is made fallibly, so
the checks hold where memory is overcommitted too; a device array's size
is checked before a strided input is copied."""

from __future__ import annotations

import sys

import flashport
import numpy as np
import pytest
from flashport import ProblemTooLargeError


def _mem_total() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            line = next(x for x in f if x.startswith("MemTotal:"))
        return int(line.split()[1]) * 1024
    except (OSError, StopIteration):
        return None


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_broadcast_query_larger_than_memory(backend):
    # A 4-byte array viewed as 512 GiB: its contiguous copy cannot be had.
    k = np.random.default_rng(0).standard_normal((1, 1, 16, 64)).astype(np.float32)
    q = np.broadcast_to(np.float32(0.5), (1, 1, 2**31, 64))
    with pytest.raises(ProblemTooLargeError, match=r"^q is not contiguous.*549755813888 bytes"):
        flashport.attention(q, k, k, device=backend)
    # Nothing is broken afterwards.
    out = flashport.attention(k, k, k, device=backend)
    np.testing.assert_allclose(out, flashport.reference.attention(k, k, k), atol=1e-5)


def test_to_device_checks_the_gpu_limit_before_copying(gpu):
    # 64 GiB as a stride-0 view: refused by the GPU's buffer limit without
    # a 64 GiB host copy first.
    with pytest.raises(ProblemTooLargeError, match=r"array \(68719476736 bytes\).*largest buffer"):
        flashport.to_device(np.broadcast_to(np.float32(0.5), (2**34,)))


def test_score_gradient_larger_than_memory():
    # return_dmask=True holds every score's gradient: 2**40 float32 here.
    n = 2**20
    x = np.random.default_rng(1).standard_normal((1, 1, n, 1)).astype(np.float32)
    lse = np.zeros((1, 1, n), np.float32)
    mask = np.array([0.25], np.float32)
    with pytest.raises(ProblemTooLargeError, match=r"return_dmask=True .*4398046511104 bytes"):
        flashport.attention_backward(x, x, x, x, x, lse, mask=mask, return_dmask=True, device="cpu")


def test_merge_of_a_broadcast_stack_of_parts(backend):
    # 2**40 parts as a stride-0 view: validation counted them by building a
    # list of 2**40 entries (an abort); now the contiguous copy is refused.
    rng = np.random.default_rng(2)
    out = rng.standard_normal((2, 3, 8)).astype(np.float32)
    lse = rng.standard_normal((2, 3)).astype(np.float32)
    outs = np.broadcast_to(out, (2**40, *out.shape))
    lses = np.broadcast_to(lse, (2**40, *lse.shape))
    with pytest.raises(ProblemTooLargeError, match=r"outs is not contiguous"):
        flashport.merge_states(outs, lses, device=backend)


def test_broadcast_mask_larger_than_memory_is_read_in_place():
    # A (seq_k,) mask repeated to 64 GiB of bools: read as the (seq_k,)
    # mask it is, not copied (it was a ProblemTooLargeError). Only the first
    # 40 keys are visible, so block skipping keeps the call short.
    rng = np.random.default_rng(3)
    heads, seq_q, seq_k = 4, 2**14, 2**20
    q = rng.standard_normal((1, heads, seq_q, 8)).astype(np.float32)
    k = rng.standard_normal((1, 1, seq_k, 8)).astype(np.float32)
    keys = np.zeros(seq_k, bool)
    keys[:40] = True
    mask = np.broadcast_to(keys, (1, heads, seq_q, seq_k))
    out = flashport.attention(q, k, k, mask=mask, device="cpu")
    want = flashport.attention(q, k[:, :, :40], k[:, :, :40], device="cpu")
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(_mem_total() is None, reason="no /proc/meminfo")
def test_kvcache_larger_than_the_machine_is_refused_at_once():
    """A CPU cache whose pools add up past the machine's memory is refused
    by its size, before anything is allocated (each pool alone could be
    reserved, and the process was killed as the cache filled)."""
    total = _mem_total()
    # float32 pools of 2 heads x 16 keys x 128 dims = 16 KiB a block each,
    # four layers: twice the machine's memory.
    blocks = 2 * total // (4 * 2 * 16 * 1024) + 1
    with pytest.raises(ProblemTooLargeError, match=r"KV cache .* takes \d+ bytes, more than"):
        flashport.KVCache(blocks, 16, 2, 128, layers=4, device="cpu")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_kvcache_takes_memory_as_it_fills():
    """A CPU cache's pools are zeroed by the allocator, not written: 1 GiB
    of pools adds little to the resident set until blocks are written."""
    before = _rss()
    cache = flashport.KVCache(2**13, 16, 8, 128, layers=2, device="cpu")  # 1 GiB
    grown = _rss() - before
    assert grown < 128 << 20, grown
    sid = cache.new_sequence()
    k = np.ones((8, 16, 128), np.float32)
    cache.append(sid, k, k)
    np.testing.assert_array_equal(cache.read_layer(0)[0][cache.block_table([sid])[0, 0]], k)


def test_gpu_kvcache_larger_than_the_gpu_is_refused_at_once(gpu):
    """A GPU cache of absurd size is refused by the GPU's memory before a
    buffer is made (lavapipe, whose device memory is lazily given host
    memory, built buffer after buffer for minutes)."""
    with pytest.raises(ProblemTooLargeError, match=r"takes \d+ bytes, more than the \d+ bytes"):
        flashport.KVCache(2**40, 16, 8, 128, device="gpu")
    # The GPU keeps working.
    cache = flashport.KVCache(4, 16, 2, 8, device="gpu")
    assert cache.num_free_blocks == 4


def _vm_flags(address: int) -> list[str] | None:
    """The VmFlags of the mapping that holds `address` (Linux), else None."""
    try:
        with open("/proc/self/smaps") as f:
            inside = False
            for line in f:
                head = line.split()[0]
                if "-" in head and not head.endswith(":"):
                    start, end = (int(x, 16) for x in head.split("-"))
                    inside = start <= address < end
                elif inside and head == "VmFlags:":
                    return line.split()[1:]
    except OSError:
        return None
    return None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux's")
def test_large_outputs_ask_for_huge_pages_as_numpy_arrays_do():
    # NumPy advises its arrays of 4 MiB or more MADV_HUGEPAGE ("hg"); the
    # extension's allocator does the same for the outputs it hands over
    # (rust/flashport-py/src/alloc.rs), which were 4 KiB page faults.
    reference = np.empty(2 << 20, dtype=np.float32)
    flags = _vm_flags(reference.ctypes.data + reference.nbytes // 2)
    if flags is None or "hg" not in flags:
        pytest.skip("NumPy's own arrays get no huge-page advice here")
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 2, 16384, 64), dtype=np.float32)
    k = rng.standard_normal((1, 2, 16, 64), dtype=np.float32)
    o = flashport.attention(q, k, k, device="cpu")
    merged, _ = flashport.merge_states(np.stack([o, o]), np.zeros((2, 1, 2, 16384), np.float32))
    for out in (o, merged):
        assert out.nbytes >= 4 << 20
        assert "hg" in (_vm_flags(out.ctypes.data + out.nbytes // 2) or [])
