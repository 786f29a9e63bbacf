"""Forward and backward against the float64 oracle, on random shapes, on
every backend: non-tile-multiple sizes, seq_q != seq_k, GQA/MQA, d != d_v,
causal rows that see no key, random scales, 2-, 3- and 4-d inputs."""

from __future__ import annotations

import flashport
import numpy as np
import pytest
from cases import (
    Case,
    assert_backends_agree,
    assert_close,
    cases,
    naive,
    naive_backward,
    oracle,
    oracle_backward,
    score_magnitude,
    term_magnitudes,
)
from flashport import reference
from hypothesis import given
from hypothesis import strategies as st

DTYPES = [np.float32, np.float64, np.float16]


def _gpu_dtypes(backend):
    # float64 is a CPU-only dtype (checked in test_errors).
    return [np.float32, np.float16] if backend == "gpu" else DTYPES


def check_forward(case: Case, dtype, backend: str) -> None:
    q, k, v, _ = case.arrays(dtype)
    out, lse = flashport.attention(
        q, k, v, causal=case.causal, scale=case.scale, return_lse=True, device=backend
    )
    want_out, want_lse = oracle(case, q, k, v, dtype)
    base_out, base_lse = naive(case, q, k, v, dtype)
    assert out.dtype == dtype
    assert lse.dtype == (np.float64 if dtype == np.float64 else np.float32)
    scores = score_magnitude(case, q, k)
    terms = term_magnitudes(case, np.ones_like(out), q, k, v)
    assert_close("o", out, want_out, base_out, dtype, scores, terms["o"])
    assert_close("lse", lse, want_lse, base_lse, dtype, scores, terms["lse"])


def check_backward(case: Case, dtype, backend: str) -> None:
    q, k, v, do = case.arrays(dtype)
    out, lse = flashport.attention(
        q, k, v, causal=case.causal, scale=case.scale, return_lse=True, device=backend
    )
    grads = flashport.attention_backward(
        do, q, k, v, out, lse, causal=case.causal, scale=case.scale, device=backend
    )
    want = oracle_backward(case, do, q, k, v, dtype)
    baseline = naive_backward(case, do, q, k, v, dtype)
    scores = score_magnitude(case, q, k)
    terms = term_magnitudes(case, do, q, k, v)
    for name, g, w, b, x in zip(("dq", "dk", "dv"), grads, want, baseline, (q, k, v), strict=True):
        assert g.shape == x.shape and g.dtype == dtype
        assert_close(name, g, w, b, dtype, scores, terms[name])


@given(data=st.data(), dtype=st.sampled_from(DTYPES))
def test_forward_matches_reference(backend, data, dtype):
    if dtype not in _gpu_dtypes(backend):
        dtype = np.float32
    check_forward(data.draw(cases(backend), label="case"), dtype, backend)


@given(data=st.data(), dtype=st.sampled_from(DTYPES))
def test_backward_matches_reference(backend, data, dtype):
    if dtype not in _gpu_dtypes(backend):
        dtype = np.float32
    check_backward(data.draw(cases(backend), label="case"), dtype, backend)


# Shapes the strategies might take long to find: tile boundaries, the
# largest head dims, MQA, and causal masks that hide whole rows.
EDGE_CASES = [
    Case(1, 1, 1, 1, 1, 1, 1, False, None, 4, 1),
    Case(1, 1, 1, 1, 1, 1, 1, True, None, 4, 2),
    Case(2, 2, 4, 37, 53, 16, 24, True, None, 4, 3),
    Case(1, 1, 8, 65, 17, 64, 32, True, 0.3, 4, 4),  # MQA, seq_q > seq_k
    Case(1, 1, 1, 5, 2, 8, 8, True, None, 2, 5),  # three rows see nothing
    Case(1, 2, 1, 64, 64, 256, 256, False, None, 3, 6),
    Case(1, 1, 2, 129, 257, 256, 8, True, None, 4, 7),
    Case(3, 1, 1, 16, 300, 1, 255, False, 1.7, 4, 8),
]


def _edge_ids():
    return [
        f"b{c.batch}h{c.heads_q}/{c.heads_kv}-s{c.seq_q}x{c.seq_k}-d{c.d}/{c.dv}"
        f"{'-causal' if c.causal else ''}"
        for c in EDGE_CASES
    ]


@pytest.mark.parametrize("case", EDGE_CASES, ids=_edge_ids())
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: t.__name__)
def test_edge_shapes(backend, case, dtype):
    if dtype not in _gpu_dtypes(backend):
        q, k, v, _ = case.arrays(dtype)
        with pytest.raises(flashport.DTypeError, match=r"float64.*device=\"cpu\""):
            flashport.attention(q, k, v, causal=case.causal, device=backend)
        return
    check_forward(case, dtype, backend)
    check_backward(case, dtype, backend)


def test_rows_without_visible_key_are_zero_with_neg_inf_lse(backend):
    rng = np.random.default_rng(11)
    q = rng.standard_normal((2, 6, 8)).astype(np.float32)
    k = rng.standard_normal((2, 3, 8)).astype(np.float32)
    v = rng.standard_normal((2, 3, 5)).astype(np.float32)
    out, lse = flashport.attention(q, k, v, causal=True, return_lse=True, device=backend)
    # seq_q=6, seq_k=3: rows 0..2 see no key under bottom-right alignment.
    assert np.all(out[:, :3] == 0) and np.all(np.isneginf(lse[:, :3]))
    assert np.all(np.isfinite(lse[:, 3:])) and np.all(out[:, 3:] != 0)
    do = rng.standard_normal(out.shape).astype(np.float32)
    dq, dk, dv = flashport.attention_backward(do, q, k, v, out, lse, causal=True, device=backend)
    assert np.all(dq[:, :3] == 0)
    assert all(np.isfinite(g).all() for g in (dq, dk, dv))


def test_one_key_gives_probability_one_exactly(backend):
    """With a single key, P = 1 whatever the score, so out = v and dv = dO
    bit for bit. The backward recomputes P = exp(s - lse): this holds only
    if the forward's lse and the backward's scores round the same score the
    same way. Large scores (|s| up to ~1e3, d up to 196) make any
    inconsistency show: a forward that rounded its scores in base 2 once
    left dv off by 6e-5 relative here."""
    rng = np.random.default_rng(17)
    for d in (4, 60, 174, 196):
        q = (3 * rng.standard_normal((2, 3, 1, d))).astype(np.float32)
        k = (3 * rng.standard_normal((2, 3, 1, d))).astype(np.float32)
        v = rng.standard_normal((2, 3, 1, d)).astype(np.float32)
        do = rng.standard_normal((2, 3, 1, d)).astype(np.float32)
        out, lse = flashport.attention(q, k, v, scale=1.0, return_lse=True, device=backend)
        dq, dk, dv = flashport.attention_backward(do, q, k, v, out, lse, scale=1.0, device=backend)
        np.testing.assert_array_equal(out, v)
        np.testing.assert_array_equal(dv, do)
        # dS = P (dP - D) with P = 1 and D = dO·o = dO·v = dP: zero but for
        # the rounding of two dot products of length d summed in different
        # orders.
        eps = np.finfo(np.float32).eps
        bound = 2 * d * eps * np.abs(do).max() * np.abs(v).max()
        assert np.abs(dq).max() <= bound * np.abs(k).max()
        assert np.abs(dk).max() <= bound * np.abs(q).max()


def test_reference_backward_matches_finite_differences():
    """The oracle's analytic gradients against central differences of its own
    forward, so that the backward tests rest on something checked."""
    rng = np.random.default_rng(5)
    for causal, (hq, hk, sq, sk, d, dv) in [
        (False, (2, 1, 4, 6, 3, 5)),
        (True, (4, 2, 5, 3, 4, 2)),
    ]:
        q = rng.standard_normal((1, hq, sq, d))
        k = rng.standard_normal((1, hk, sk, d))
        v = rng.standard_normal((1, hk, sk, dv))
        w = rng.standard_normal((1, hq, sq, dv))  # loss = sum(w * o)
        grads = reference.attention_backward(w, q, k, v, causal=causal, scale=0.7)
        for x, g in zip((q, k, v), grads, strict=True):
            numeric = np.zeros_like(x)
            for idx in np.ndindex(x.shape):
                saved = x[idx]
                x[idx] = saved + 1e-6
                plus = np.sum(w * reference.attention(q, k, v, causal=causal, scale=0.7))
                x[idx] = saved - 1e-6
                minus = np.sum(w * reference.attention(q, k, v, causal=causal, scale=0.7))
                x[idx] = saved
                numeric[idx] = (plus - minus) / 2e-6
            np.testing.assert_allclose(g, numeric, rtol=1e-6, atol=1e-8)


def test_zero_length_sequences_give_empty_results(backend):
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 4, 0, 8)).astype(np.float32)
    k = rng.standard_normal((2, 2, 5, 8)).astype(np.float32)
    v = rng.standard_normal((2, 2, 5, 3)).astype(np.float32)
    out, lse = flashport.attention(q, k, v, return_lse=True, device=backend)
    assert out.shape == (2, 4, 0, 3) and lse.shape == (2, 4, 0)
    dq, dk, dv = flashport.attention_backward(out, q, k, v, out, lse, device=backend)
    assert dq.shape == q.shape and np.all(dk == 0) and np.all(dv == 0)

    q = rng.standard_normal((2, 4, 7, 8)).astype(np.float32)
    k, v = k[:, :, :0], v[:, :, :0]
    out, lse = flashport.attention(q, k, v, return_lse=True, device=backend)
    assert out.shape == (2, 4, 7, 3) and np.all(out == 0) and np.all(np.isneginf(lse))
    do = rng.standard_normal(out.shape).astype(np.float32)
    dq, dk, dv = flashport.attention_backward(do, q, k, v, out, lse, device=backend)
    assert np.all(dq == 0) and dk.shape == k.shape and dv.shape == v.shape


def test_reference_handles_empty_batches_with_gqa():
    rng = np.random.default_rng(4)
    q = rng.standard_normal((0, 4, 3, 8))
    k, v = rng.standard_normal((0, 2, 5, 8)), rng.standard_normal((0, 2, 5, 6))
    out, lse = reference.attention(q, k, v, return_lse=True)
    dq, dk, dv = reference.attention_backward(out, q, k, v, out, lse)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


@given(data=st.data(), dtype=st.sampled_from([np.float32, np.float16]))
def test_cpu_and_gpu_agree(gpu, data, dtype):
    """The two backends compute the same function: their float32 results
    differ by at most what each may differ from the oracle (twice a naive
    float32 implementation's error, plus the floor), added up."""
    case = data.draw(cases(gpu), label="case")
    q, k, v, do = case.arrays(dtype)
    results = {}
    for device in ("cpu", gpu):
        out, lse = flashport.attention(
            q, k, v, causal=case.causal, scale=case.scale, return_lse=True, device=device
        )
        grads = flashport.attention_backward(
            do, q, k, v, out, lse, causal=case.causal, scale=case.scale, device=device
        )
        results[device] = (out, *grads)
    assert_backends_agree(case, results, q, k, v, do, dtype)
