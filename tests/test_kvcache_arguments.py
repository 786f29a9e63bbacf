"""KVCache's integer arguments as the Rust core checks them (the Python
class forwards them untouched): ints of Python and NumPy are taken, bools,
floats and strings are refused by name, a bare id is not a list of ids."""

from __future__ import annotations

import flashport
import numpy as np
import pytest
from flashport import InvalidArgumentError, UnknownSequenceError


def _cache():
    return flashport.KVCache(np.int64(4), np.int32(2), 2, 4, layers=np.uint8(2))


def test_numpy_integers_are_integers():
    cache = _cache()
    assert (cache.num_blocks, cache.block_size, cache.layers) == (4, 2, 2)
    s = cache.new_sequence()
    k = np.random.default_rng(0).standard_normal((2, 3, 4), dtype=np.float32)
    cache.append(np.int64(s), k, k, layer=np.int16(1))
    assert cache.length(np.uint64(s), layer=np.int8(1)) == 3
    q = np.random.default_rng(1).standard_normal((1, 2, 1, 4), dtype=np.float32)
    out = cache.attention(np.repeat(q, 2, axis=0), np.array([s, s]), layer=1)
    assert out.shape == (2, 2, 1, 4) and np.array_equal(out[0], out[1])
    assert cache.block_table(x for x in [s]).tolist() == [[0, 1]]


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda c, s: c.fork(True), "sid=True: expected an integer, got a bool"),
        (lambda c, s: c.free(float(s)), "sid=0.0: expected an integer, got a float"),
        (lambda c, s: c.length(s, layer="1"), "layer='1': expected an integer, got a string"),
        (lambda c, s: c.read_layer(np.float32(0)), "layer=.*0.*: expected an integer"),
        (lambda c, s: c.block_table([s, 1.0]), r"seq_ids\[1\]=1.0: expected an integer"),
        (lambda c, s: c.block_table("0"), "seq_ids='0': expected a sequence of sequence ids"),
        (lambda c, s: c.block_table(np.int64(s)), "seq_ids=.*: expected a sequence"),
    ],
)
def test_non_integers_are_refused_by_name(call, message):
    cache = _cache()
    s = cache.new_sequence()
    with pytest.raises(InvalidArgumentError, match=message):
        call(cache, s)


def test_integers_beyond_int64_are_no_such_sequence():
    cache = _cache()
    with pytest.raises(UnknownSequenceError, match="no such sequence"):
        cache.free(-(2**100))
