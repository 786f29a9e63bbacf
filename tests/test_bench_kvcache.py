"""The KV cache benchmark's own arithmetic (timings are never asserted):
its KVCache and its contiguous cache hold the same keys and grow together,
so the two attentions it times compute the same thing, whether its step
appends with append_batch or one append per sequence."""

from __future__ import annotations

import numpy as np
import pytest
from flashport import reference
from flashport._bench import kvcache as _bench_kvcache


@pytest.mark.parametrize("per_sequence", [False, True], ids=["append_batch", "append"])
def test_both_caches_hold_the_same_sequences_as_they_grow(backend, per_sequence):
    pair = _bench_kvcache.Pair(
        batch=2, context=40, block_size=16, rounds=3, device=backend, per_sequence=per_sequence
    )
    for _ in range(3):
        pair.cache_step()
        pair.contiguous_step()
    assert pair.lens.tolist() == [43, 43]
    assert pair.agree() <= 1e-6
    want = reference.attention(pair.q, pair.k[:, :, :43], pair.v[:, :, :43])
    np.testing.assert_allclose(pair.cache_attention(), want, atol=2e-5, rtol=0)
    # The appended position is the new one, not a copy of an old one.
    assert np.array_equal(pair.k[:, :, 42], pair.new_k[:, :, 0])
