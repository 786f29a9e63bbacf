"""The decode benchmark's own arithmetic (the timings are never asserted):
its paged caches hold the contiguous cache they are compared with, and the
bytes it divides by are the K and V a decode reads."""

from __future__ import annotations

import numpy as np
import pytest
from flashport import _bench_decode, reference


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("block_size", [1, 16, 256])
def test_paged_cache_gathers_back_to_the_contiguous_cache(block_size, batch):
    rng = np.random.default_rng(3)
    k = rng.standard_normal((batch, 2, 512, 4)).astype(np.float32)
    pool, table = _bench_decode.paged_cache(k, block_size)
    assert pool.shape == (batch * 512 // block_size, 2, block_size, 4)
    # As a cache manager allocates it (a strided pool is copied on each call).
    assert pool.flags.c_contiguous
    assert table.shape == (batch, 512 // block_size)
    # A permutation of the blocks, not the identity.
    assert sorted(table.ravel()) == list(range(pool.shape[0]))
    assert block_size == 256 or not np.array_equal(table.ravel(), np.arange(table.size))
    lens = np.full(batch, 512)
    for b in range(batch):
        keys, _ = reference.cached_sequence(pool, pool, lens, b, table)
        assert np.array_equal(keys, k[b])


def test_bytes_read_are_the_whole_caches():
    q, k, v = _bench_decode.make_arrays(2, 64, np.float16)
    assert q.shape == (2, 32, 1, 128) and k.shape == v.shape == (2, 8, 64, 128)
    assert q.dtype == k.dtype == np.float16
    assert _bench_decode.cache_bytes(2, 64, np.float16) == k.nbytes + v.nbytes
