"""KVCache swapping (PagedAttention's preemption by swap): sequences moved
to the host swap space and back keep every key, value, length, token and
prefix hash; forks stay correct; full swap spaces and pools change
nothing; what a swapped sequence may do is enforced with clear errors. The
random interleavings with every other operation are the state machine of
test_kvcache_manager.py (its model swaps too); these are the scenarios
that name each rule."""

from __future__ import annotations

import flashport
import numpy as np
import pytest
from conftest import cache_state
from flashport import (
    CacheFullError,
    InvalidArgumentError,
    ProblemTooLargeError,
    UnknownSequenceError,
    _core,
    reference,
)

# The GPU's pools hold float16 or float32; (3, 5) with one head makes a
# float16 block 15 halves long: blocks that start mid-word on the GPU.
GEOMETRIES = [(2, 4, 8, 6), (1, 3, 5, 5)]


def _normal(rng, shape, dtype):
    return rng.standard_normal(shape).astype(dtype)


def _fill(cache, sid, n, rng, tokens=None):
    """Appends ``n`` positions to every layer of ``sid`` (tokens on layer
    0): the keys and values appended, per layer."""
    appended = []
    for layer in range(cache.layers):
        k = _normal(rng, (cache.heads_kv, n, cache.head_dim), cache.dtype)
        v = _normal(rng, (cache.heads_kv, n, cache.head_dim_v), cache.dtype)
        cache.append(sid, k, v, layer=layer, tokens=tokens if layer == 0 else None)
        appended.append((k, v))
    return appended


def _held(cache, sid):
    """Sequence ``sid``'s keys and values on every layer, gathered through
    its block table: what attention reads."""
    table = cache.block_table([sid])
    out = []
    for layer in range(cache.layers):
        k_pool, v_pool = cache.read_layer(layer)
        lengths = [cache.length(sid, layer=layer)]
        out.append(reference.cached_sequence(k_pool, v_pool, lengths, 0, table))
    return out


def _same(a, b):
    return all(
        np.array_equal(x.view(np.uint8), y.view(np.uint8))
        for (xk, xv), (yk, yv) in zip(a, b, strict=True)
        for x, y in ((xk, yk), (xv, yv))
    )


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=lambda t: t.__name__)
def test_swap_out_and_in_restores_every_value_bit_for_bit(backend, geometry, dtype):
    heads_kv, block_size, d, dv = geometry
    rng = np.random.default_rng(1)
    cache = flashport.KVCache(
        8, block_size, heads_kv, d, head_dim_v=dv, layers=2, dtype=dtype,
        device=backend, swap_blocks=6,
    )  # fmt: skip
    a = cache.new_sequence()
    tokens = np.arange(3 * block_size + 1)
    _fill(cache, a, len(tokens), rng, tokens)
    before = _held(cache, a)
    q = _normal(rng, (1, 2 * heads_kv, 1, d), dtype)
    want = [np.asarray(cache.attention(q, [a], layer=layer)) for layer in range(2)]
    cache.swap_out(a)
    assert cache.is_swapped(a) and cache.swapped == [a] and a in cache
    assert cache.num_free_blocks == 8 and cache.num_free_swap_blocks == 2
    # Other sequences take the freed blocks and overwrite them.
    other = cache.new_sequence()
    _fill(cache, other, 8 * block_size, rng)
    cache.free(other)
    cache.swap_in(a)
    assert not cache.is_swapped(a) and cache.num_free_swap_blocks == 6
    assert cache.length(a) == len(tokens)
    assert _same(_held(cache, a), before)
    got = [np.asarray(cache.attention(q, [a], layer=layer)) for layer in range(2)]
    assert all(np.array_equal(w, g) for w, g in zip(want, got, strict=True))
    # Its tokens and hashes came back too: a new sequence of the same prompt
    # adopts its full blocks instead of taking new ones.
    b = cache.new_sequence()
    cache.append(b, *_fill_like(cache, len(tokens), rng), layer=0, tokens=tokens)
    assert cache.block_table([b])[0, :3].tolist() == cache.block_table([a])[0, :3].tolist()


def _fill_like(cache, n, rng):
    k = _normal(rng, (cache.heads_kv, n, cache.head_dim), cache.dtype)
    v = _normal(rng, (cache.heads_kv, n, cache.head_dim_v), cache.dtype)
    return k, v


def test_forks_swapped_together_share_their_host_blocks(backend):
    rng = np.random.default_rng(2)
    cache = flashport.KVCache(6, 4, 1, 8, layers=1, device=backend, swap_blocks=3)
    a = cache.new_sequence()
    _fill(cache, a, 10, rng)
    forks = [cache.fork(a) for _ in range(3)]
    before = _held(cache, a)
    # Three blocks held by four sequences: three host blocks, not twelve.
    cache.swap_out([a, *forks])
    assert cache.num_free_swap_blocks == 0 and cache.num_free_blocks == 6
    cache.swap_in([a, *forks])
    assert cache.ref_counts().tolist().count(4) == 3
    for sid in (a, *forks):
        assert _same(_held(cache, sid), before)


def test_a_fork_left_in_the_pool_keeps_its_blocks(backend):
    rng = np.random.default_rng(3)
    cache = flashport.KVCache(8, 4, 1, 8, layers=1, device=backend, swap_blocks=4)
    a = cache.new_sequence()
    _fill(cache, a, 6, rng)
    b = cache.fork(a)
    shared = cache.block_table([b])[0].tolist()
    before = _held(cache, a)
    cache.swap_out(a)
    # The fork still holds the shared blocks and appends to its last one
    # without a copy (it holds it alone now).
    assert cache.block_table([b])[0].tolist() == shared
    _fill(cache, b, 1, rng)
    assert cache.block_table([b])[0].tolist() == shared
    cache.swap_in(a)
    assert _same(_held(cache, a), before)
    assert not set(cache.block_table([a])[0].tolist()) & set(shared)


def test_full_swap_space_or_pool_changes_nothing(backend):
    rng = np.random.default_rng(4)
    cache = flashport.KVCache(4, 2, 1, 4, layers=2, device=backend, swap_blocks=3)
    a = cache.new_sequence()
    _fill(cache, a, 7, rng)
    state = cache_state(cache)
    with pytest.raises(CacheFullError, match=r"swap space is full.*needs 4 host block.*3 of 3"):
        cache.swap_out(a)
    assert cache_state(cache) == state
    cache.free(a)
    b = cache.new_sequence()
    _fill(cache, b, 5, rng)
    cache.swap_out(b)
    c = cache.new_sequence()
    _fill(cache, c, 3, rng)
    state = cache_state(cache)
    with pytest.raises(CacheFullError, match=r"needs 3 free block\(s\) but 2 of 4.*nothing"):
        cache.swap_in(b)
    assert cache_state(cache) == state
    cache.free(c)
    cache.swap_in(b)


def test_a_swapped_sequence_may_only_be_swapped_in_measured_or_freed(backend):
    rng = np.random.default_rng(5)
    cache = flashport.KVCache(4, 2, 1, 4, layers=1, device=backend, swap_blocks=4)
    a = cache.new_sequence()
    _fill(cache, a, 3, rng)
    cache.swap_out([a])
    k, v = _fill_like(cache, 1, rng)
    q = _normal(rng, (1, 1, 1, 4), np.float32)
    refused = [
        lambda: cache.attention(q, [a]),
        lambda: cache.append(a, k, v),
        lambda: cache.append_batch([a], k[None], v[None]),
        lambda: cache.fork(a),
        lambda: cache.block_table([a]),
        lambda: cache.swap_out(a),
    ]
    for call in refused:
        with pytest.raises(InvalidArgumentError, match=rf"sequence {a} is swapped out"):
            call()
    assert cache.length(a) == 3 and cache.is_swapped(a)
    with pytest.raises(InvalidArgumentError, match=r"seq_ids\[1\]=0.*once"):
        cache.swap_in([a, a])
    live = cache.new_sequence()
    with pytest.raises(InvalidArgumentError, match="not swapped out"):
        cache.swap_in(live)
    cache.free(a)
    assert cache.num_free_swap_blocks == 4 and a not in cache
    with pytest.raises(UnknownSequenceError, match="freed"):
        cache.swap_in(a)
    with pytest.raises(UnknownSequenceError):
        cache.is_swapped(99)


def test_swap_arguments_are_checked(backend):
    with pytest.raises(InvalidArgumentError, match="swap_blocks=-1"):
        flashport.KVCache(4, 2, 1, 4, device=backend, swap_blocks=-1)
    with pytest.raises(InvalidArgumentError, match="swap_blocks"):
        flashport.KVCache(4, 2, 1, 4, device=backend, swap_blocks=True)
    # The swap space is host memory, a budget of its own, checked at once.
    with pytest.raises(ProblemTooLargeError, match="swap space"):
        flashport.KVCache(4, 2, 1, 4, device=backend, swap_blocks=2**50)
    cache = flashport.KVCache(4, 2, 1, 4, device=backend)
    a = cache.new_sequence()
    _fill(cache, a, 1, np.random.default_rng(6))
    with pytest.raises(CacheFullError, match="0 of 0"):
        cache.swap_out(a)
    with pytest.raises(InvalidArgumentError):
        cache.swap_out(True)


def test_a_gpu_swap_in_is_one_submission(gpu):
    """However many blocks and layers, a swap-in's copies are one queued
    submission (and a swap-out's one read)."""
    rng = np.random.default_rng(7)
    cache = flashport.KVCache(16, 2, 2, 8, layers=3, device="gpu", swap_blocks=16)
    a = cache.new_sequence()
    _fill(cache, a, 19, rng)
    cache.swap_out(a)
    flashport.synchronize()
    assert _core._testing_queued_submissions() == 0
    cache.swap_in(a)
    assert _core._testing_queued_submissions() == 1
    flashport.synchronize()
