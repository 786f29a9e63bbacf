"""Problems larger than memory are a ProblemTooLargeError naming what could
not be had, never an abort: every large host allocation is fallible, and a
device array's size is checked before a strided input is copied."""

from __future__ import annotations

import flashport
import numpy as np
import pytest
from flashport import ProblemTooLargeError


def _overcommit_always() -> bool:
    try:
        with open("/proc/sys/vm/overcommit_memory") as f:
            return f.read().strip() == "1"
    except OSError:
        return False


# With overcommit_memory=1 the kernel grants any allocation and kills the
# process when it is touched: nothing a library can turn into an error.
pytestmark = pytest.mark.skipif(_overcommit_always(), reason="vm.overcommit_memory=1")


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
