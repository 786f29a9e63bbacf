"""Any memory layout gives the same result; inputs are never modified; the
GIL is released and concurrent calls are safe."""

from __future__ import annotations

import threading

import flashport
import numpy as np
import pytest

rng = np.random.default_rng(8)
Q = rng.standard_normal((2, 4, 33, 16)).astype(np.float32)
K = rng.standard_normal((2, 2, 45, 16)).astype(np.float32)
V = rng.standard_normal((2, 2, 45, 12)).astype(np.float32)


def _expected(backend):
    out, lse = flashport.attention(Q, K, V, causal=True, return_lse=True, device=backend)
    do = np.cos(out)
    return (
        out,
        lse,
        do,
        flashport.attention_backward(do, Q, K, V, out, lse, causal=True, device=backend),
    )


LAYOUTS = {
    "fortran": np.asfortranarray,
    "strided": lambda x: np.repeat(x, 2, axis=-1)[..., ::2],
    "negative-stride": lambda x: np.ascontiguousarray(x[:, :, ::-1])[:, :, ::-1],
    "transposed-view": lambda x: np.ascontiguousarray(x.swapaxes(1, 2)).swapaxes(1, 2),
    "big-endian": lambda x: x.astype(x.dtype.newbyteorder(">")),
    "read-only": lambda x: _read_only(x.copy()),
}


def _read_only(x):
    x.setflags(write=False)
    return x


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_give_identical_results(backend, layout):
    out, lse, do, grads = _expected(backend)
    convert = LAYOUTS[layout]
    q, k, v = convert(Q), convert(K), convert(V)
    got_out, got_lse = flashport.attention(q, k, v, causal=True, return_lse=True, device=backend)
    assert got_out.tobytes() == out.tobytes() and got_lse.tobytes() == lse.tobytes()
    got = flashport.attention_backward(
        convert(do), q, k, v, convert(out), convert(lse), causal=True, device=backend
    )
    for a, b in zip(got, grads, strict=True):
        assert a.tobytes() == b.tobytes()


def test_nested_lists_are_accepted_as_float64():
    out = flashport.attention(Q.tolist(), K.tolist(), V.tolist(), device="cpu")
    want = flashport.attention(Q.astype(np.float64), K.astype(np.float64), V.astype(np.float64))
    assert out.dtype == np.float64 and out.tobytes() == want.tobytes()


def test_inputs_are_not_modified(backend):
    arrays = [x.copy() for x in (Q, K, V)]
    out, lse = flashport.attention(*arrays, return_lse=True, device=backend)
    do = np.sin(out)
    saved = [x.copy() for x in (*arrays, do, out, lse)]
    flashport.attention_backward(do, *arrays, out, lse, device=backend)
    for before, after in zip(saved, (*arrays, do, out, lse), strict=True):
        assert before.tobytes() == after.tobytes()


def test_outputs_are_fresh_writeable_arrays(backend):
    out, lse = flashport.attention(Q, K, V, return_lse=True, device=backend)
    for x in (out, lse):
        assert x.flags.c_contiguous and x.flags.writeable
        assert not np.shares_memory(x, Q)


def test_gil_is_released_during_compute():
    q = rng.standard_normal((1, 4, 1024, 64)).astype(np.float32)
    worker = threading.Thread(target=flashport.attention, args=(q, q, q), kwargs={"device": "cpu"})
    worker.start()
    spins = 0
    while worker.is_alive():
        spins += 1
    worker.join()
    # Holding the GIL would freeze this loop for the whole call.
    assert spins > 1000


def test_concurrent_calls_agree_with_serial(backend):
    expected = _expected(backend)
    results = [None] * 6

    def work(i):
        results[i] = _expected(backend)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(results))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for got in results:
        assert got is not None
        assert got[0].tobytes() == expected[0].tobytes()
        for a, b in zip(got[3], expected[3], strict=True):
            assert a.tobytes() == b.tobytes()


def test_value_dim_zero_with_a_window_and_offsets(backend):
    # d_v = 0 leaves the CPU's packed value panels empty; a key tile past the
    # first indexed past them (an InternalError; found by the core's fuzzer,
    # rust/flashport-core/tests/fuzz_validation.rs).
    rng = np.random.default_rng(5)
    q = rng.standard_normal((1, 1, 3, 2)).astype(np.float32)
    k = rng.standard_normal((1, 1, 19, 2)).astype(np.float32)
    v = np.empty((1, 1, 19, 0), np.float32)
    kw = dict(window=(23, -1), q_offset=46, k_offset=5)
    o, lse = flashport.attention(q, k, v, return_lse=True, device=backend, **kw)
    _, ref_lse = flashport.reference.attention(q, k, v, return_lse=True, **kw)
    assert o.shape == (1, 1, 3, 0)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5)


def test_gradients_without_query_key_pairs_are_zero(backend):
    # No query rows, or no keys: every gradient is zero, shaped like its input.
    rng = np.random.default_rng(6)
    for seq_q, seq_k in [(0, 5), (4, 0)]:
        q = rng.standard_normal((2, 2, seq_q, 3)).astype(np.float32)
        k = rng.standard_normal((2, 1, seq_k, 3)).astype(np.float32)
        v = rng.standard_normal((2, 1, seq_k, 4)).astype(np.float32)
        o, lse = flashport.attention(q, k, v, return_lse=True, device=backend)
        do = rng.standard_normal(o.shape).astype(np.float32)
        dq, dk, dv = flashport.attention_backward(do, q, k, v, o, lse, device=backend)
        for grad, x in [(dq, q), (dk, k), (dv, v)]:
            assert grad.shape == x.shape
            assert not grad.any()
