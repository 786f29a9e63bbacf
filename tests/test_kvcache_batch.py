"""KVCache.append_batch against the same appends one sequence at a time, on
each backend: the same block tables, counts and lengths, the same bits in
the pools (read_layer, the GPU's NaN poison in unwritten slots included)
and in attention, through forks (copy-on-write inside a batch) and shared
prompts (a block one row caches adopted by a later row of the same call);
and every refused batch, whichever row fails, leaves the cache exactly as
it was. (The state machine in test_kvcache_manager.py checks batches
against its model too.)"""

from __future__ import annotations

import flashport
import numpy as np
import pytest
from conftest import cache_state, overrides
from flashport import (
    CacheFullError,
    DTypeError,
    InvalidArgumentError,
    ProblemTooLargeError,
    ShapeError,
    UnknownSequenceError,
)

HEADS_KV, HEADS_Q, D, DV = 2, 4, 5, 3


def _cache(device: str, num_blocks: int = 24, block_size: int = 3) -> flashport.KVCache:
    return flashport.KVCache(
        num_blocks, block_size, HEADS_KV, D, head_dim_v=DV, layers=2, device=device
    )


class Pair:
    """A cache appended to in batches and one appended to row by row."""

    def __init__(self, device: str, **kw) -> None:
        self.batched, self.single = _cache(device, **kw), _cache(device, **kw)
        self.rng = np.random.default_rng(11)

    def new_sequence(self) -> int:
        sid = self.batched.new_sequence()
        assert self.single.new_sequence() == sid
        return sid

    def fork(self, sid: int) -> int:
        child = self.batched.fork(sid)
        assert self.single.fork(sid) == child
        return child

    def free(self, sid: int) -> None:
        self.batched.free(sid)
        self.single.free(sid)

    def step(self, ids: list[int], n: int, layer: int, tokens=None) -> None:
        k = self.rng.standard_normal((len(ids), HEADS_KV, n, D), dtype=np.float32)
        v = self.rng.standard_normal((len(ids), HEADS_KV, n, DV), dtype=np.float32)
        k_was, v_was = k.copy(), v.copy()
        self.batched.append_batch(ids, k, v, layer=layer, tokens=tokens)
        assert np.array_equal(k, k_was) and np.array_equal(v, v_was), "inputs unchanged"
        for r, sid in enumerate(ids):
            row_tokens = None if tokens is None else tokens[r]
            self.single.append(sid, k[r], v[r], layer=layer, tokens=row_tokens)
        self.check()

    def check(self) -> None:
        assert cache_state(self.batched) == cache_state(self.single)
        ids = self.batched.sequences
        q = self.rng.standard_normal((len(ids), HEADS_Q, 2, D), dtype=np.float32)
        for layer in range(2):
            got, got_lse = self.batched.attention(q, ids, layer=layer, return_lse=True)
            want, want_lse = self.single.attention(q, ids, layer=layer, return_lse=True)
            assert got.tobytes() == want.tobytes()
            assert got_lse.tobytes() == want_lse.tobytes()


def test_a_batch_is_the_appends_in_order(backend):
    pair = Pair(backend)
    prompt = np.arange(100, 107)
    a, b = pair.new_sequence(), pair.new_sequence()
    # Prefill of two prompts in one call, layer by layer: a's full blocks
    # are cached when layer 1 fills them.
    for layer in range(2):
        pair.step([a, b], 7, layer, tokens=np.stack([prompt, prompt + 50]))
    # Decode steps of a and its forks: each fork's first write copies the
    # shared partly filled block, inside the batch.
    c, d = pair.fork(a), pair.fork(a)
    for t in range(4):
        for layer in range(2):
            pair.step([c, a, d, b][t % 2 :], 1, layer)
    # A new sequence with a's prompt behind a row that extends a: its
    # blocks are adopted, not written.
    e = pair.new_sequence()
    used = pair.batched.num_used_blocks
    pair.step([e], 7, 0, tokens=prompt[None])
    assert pair.batched.num_used_blocks == used + 1, "two full blocks adopted, one taken"
    pair.step([e], 7, 1)
    pair.free(c)
    # Rows of several positions, spanning blocks, and an empty step.
    for layer in range(2):
        pair.step([d, e, b, a], 4, layer)
        pair.step([a, d], 0, layer)
    assert pair.batched.length(a) == 7 + 4 + 4


def test_a_prefix_a_row_caches_is_adopted_by_a_later_row(backend):
    # Blocks of 1 token. a's prompt [7, 8] is cached; x adopts it.
    pair = Pair(backend, block_size=1)
    a, x = pair.new_sequence(), pair.new_sequence()
    for layer in range(2):
        pair.step([a], 2, layer, tokens=[[7, 8]])
    pair.step([x], 2, 0, tokens=[[7, 8]])
    pair.step([x], 2, 1)
    pair.step([a], 1, 0, tokens=[[9]])
    # Layer 1 of a's row fills a's block 2 on every layer, which caches it;
    # x's row, the same prefix [7, 8, 9], then adopts it in the same call.
    # (In the other order, x's row would come first and take a fresh block.)
    used = pair.batched.num_used_blocks
    pair.step([a, x], 1, 1, tokens=[[9], [9]])
    table = pair.batched.block_table([a, x])
    assert table[0].tolist() == table[1].tolist() and pair.batched.num_used_blocks == used
    assert pair.batched.ref_counts()[table[0]].tolist() == [2, 2, 2]


def test_a_refused_batch_changes_nothing(backend):
    rng = np.random.default_rng(5)
    cache = _cache(backend, num_blocks=8, block_size=2)
    a = cache.new_sequence()
    k1 = rng.standard_normal((HEADS_KV, 3, D), dtype=np.float32)
    v1 = rng.standard_normal((HEADS_KV, 3, DV), dtype=np.float32)
    cache.append(a, k1, v1, tokens=[1, 2, 3])
    f = cache.fork(a)
    b = cache.new_sequence()
    cache.append(b, k1[:, :1], v1[:, :1])  # without tokens
    gone = cache.new_sequence()
    cache.free(gone)
    before = cache_state(cache)
    k = rng.standard_normal((3, HEADS_KV, 2, D), dtype=np.float32)
    v = rng.standard_normal((3, HEADS_KV, 2, DV), dtype=np.float32)
    k_was, v_was = k.copy(), v.copy()
    cases = [
        (dict(seq_ids=[a, f, a]), InvalidArgumentError, r"seq_ids\[2\]=0: sequence 0 is also"),
        (dict(seq_ids=[a, 9, b]), UnknownSequenceError, r"seq_ids\[1\]=9: no such sequence"),
        (dict(seq_ids=[a, gone, b]), UnknownSequenceError, "that sequence was freed"),
        (dict(seq_ids=a), InvalidArgumentError, "seq_ids=0: expected a sequence"),
        (dict(layer=2), InvalidArgumentError, "layer=2"),
        (
            dict(k=k[0]),
            ShapeError,
            r"k has shape \(2, 2, 5\); expected \(len\(seq_ids\), heads_kv, n, head_dim\) = "
            r"\(3, 2, n, 5\)",
        ),
        (dict(v=v[:2]), ShapeError, r"v has shape \(2, 2, 2, 3\)"),
        (dict(v=v[:, :, :1]), ShapeError, "k holds 2 positions but v holds 1"),
        (dict(k=k.astype(np.float64)), DTypeError, "k has dtype float64"),
        (dict(tokens=[4, 5]), ShapeError, r"tokens has shape \(2,\); expected .* \(3, 2\)"),
        (dict(tokens=np.ones((3, 2))), DTypeError, "tokens has dtype float64"),
        # Rows that copy (a, f share block 1) and take blocks, then a
        # refused row: b's position 0 has no token.
        (
            dict(tokens=[[4, 5], [4, 9], [1, 2]]),
            InvalidArgumentError,
            r"tokens\[2\]=.*without tokens",
        ),
        # On layer 1, a's row copies the shared block 0 (a's tokens agree),
        # then f's row contradicts f's known token 2 at position 1.
        (
            dict(tokens=[[1, 2], [1, 7], [5, 6]], layer=1),
            InvalidArgumentError,
            r"tokens\[1, 1\]=7: position 1 of sequence 1 holds token 2",
        ),
    ]
    if backend == "gpu":
        cases.append(
            (
                dict(tokens=flashport.to_device(np.ones((3, 2), np.float32))),
                InvalidArgumentError,
                "host",
            )
        )
    for change, error, message in cases:
        args = dict(seq_ids=[a, f, b], k=k, v=v, layer=0, tokens=None)
        args.update(change)
        with pytest.raises(error, match=message):
            cache.append_batch(
                args["seq_ids"], args["k"], args["v"], layer=args["layer"], tokens=args["tokens"]
            )
        assert cache_state(cache) == before, change
    assert np.array_equal(k, k_was) and np.array_equal(v, v_was), "inputs unchanged"
    # The cache is full for the last row only, after the rows before it
    # took the 5 free blocks (a: a copy of the shared block 1 and 2 new, f:
    # 2 new; b needs 2).
    k4 = rng.standard_normal((3, HEADS_KV, 4, D), dtype=np.float32)
    v4 = rng.standard_normal((3, HEADS_KV, 4, DV), dtype=np.float32)
    with pytest.raises(
        CacheFullError, match=r"sequence 2 \(seq_ids\[2\], after the blocks.* 0 of 8 are free"
    ):
        cache.append_batch([a, f, b], k4, v4)
    assert cache_state(cache) == before
    # Each row alone fits; the first two together too.
    cache.append_batch([a, f], k4[:2], v4[:2])
    assert cache.num_free_blocks == 0


def test_the_gpu_takes_device_arrays_and_refuses_whole_batches(gpu):
    rng = np.random.default_rng(8)
    pair = Pair(gpu)
    ids = [pair.new_sequence() for _ in range(3)]
    for layer in range(2):
        pair.step(ids, 4, layer)
    k = rng.standard_normal((3, HEADS_KV, 1, D), dtype=np.float32)
    v = rng.standard_normal((3, HEADS_KV, 1, DV), dtype=np.float32)
    pair.batched.append_batch(ids, flashport.to_device(k), flashport.to_device(v))
    pair.single.append_batch(ids, k, v)
    pair.check()
    # A batch whose keys exceed the binding limit in force is refused after
    # its rows were planned (a fork's copy among them): nothing changed,
    # not even the copy's target block.
    f = pair.fork(ids[0])
    before = cache_state(pair.batched)
    with overrides(binding_limit=64), pytest.raises(ProblemTooLargeError, match="k \\("):
        pair.batched.append_batch([f, *ids], np.concatenate([k, k[:1]]), np.concatenate([v, v[:1]]))
    assert cache_state(pair.batched) == before
