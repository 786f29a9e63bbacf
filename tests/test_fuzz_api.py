"""Fuzzing the public API: random mixes of valid and invalid arrays and
keywords through ``flashport.attention`` and ``attention_backward`` on both
backends. Every call either returns results that match the float64
reference (by the suite's tolerance rule) or raises a ``FlashportError``
subclass other than ``InternalError``; nothing else: no built-in exception,
no crash, no inputs modified.

The "ci" profile gives it a few dozen examples per backend; a long hunt is
``HYPOTHESIS_PROFILE=fuzz pytest tests/test_fuzz_api.py`` (see conftest.py).
The core's validation has its own fuzzer in
rust/flashport-core/tests/fuzz_validation.rs."""

from __future__ import annotations

import math
from types import SimpleNamespace

import flashport
import numpy as np
from cases import _assert_unchanged, _snapshot, assert_close, naive, oracle, score_magnitude
from hypothesis import event, given
from hypothesis import strategies as st

FLOATS = [np.float32, np.float32, np.float64, np.float16]
ODD_DTYPES = [np.int32, np.bool_, np.complex64, np.uint8]

# Keyword values: (valid, invalid). Invalid ones are the kinds a caller
# gets wrong: strings, bools, sets, arrays, non-finite and huge numbers.
KEYWORDS = {
    "causal": ([False, True, np.bool_(True)], [1, "False", None, np.array([True, False])]),
    "scale": ([None, None, 0.3, -1.0, 0.0], [math.nan, math.inf, "0.5", 10**400, True, 1e300]),
    "window": (
        [None, None, (2, 1), (-1, 0), (0, -1)],
        [(1.5, 2), "ab", (1, 2, 3), {1, 2}, (2**63, 0)],
    ),
    "softcap": ([None, None, 5.0, 0.0], [-1.0, math.nan, "5"]),
    "q_offset": ([None, None, 0, 7, -3], [2**70, 1.5, True]),
    "k_offset": ([None, None, 0, 4, -2], [2**70, "1"]),
    "dropout_p": ([0.0, 0.0, 0.0, 0.3], [1.0, -0.1, math.nan, None]),
    "seed": ([3, 12345], [None, 1.5, 2**127, True]),
}


@st.composite
def arrays_and_keywords(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    # Half the calls are hostile: any argument may be wrong. The others are
    # valid, so that the results get checked.
    hostile = draw(st.booleans())
    batch = draw(st.sampled_from([1, 2, 0]))
    heads_kv = draw(st.sampled_from([1, 2]))
    heads_q = heads_kv * draw(st.sampled_from([1, 2])) + draw(st.sampled_from([0, 0, hostile]))
    seq_q, seq_k = draw(st.integers(0, 9)), draw(st.integers(0, 9))
    d, dv = draw(st.integers(1 - hostile, 8)), draw(st.integers(0, 8))
    dtype = draw(st.sampled_from(FLOATS))

    def array(shape):
        kinds = ["same"] * 8 + ["other float", "odd", "not an array"] if hostile else ["same"]
        kind = draw(st.sampled_from(kinds))
        if kind == "not an array":
            return draw(st.sampled_from([None, 1.5, "q", [[1.0, 2.0]]]))
        as_dtype = {
            "same": dtype,
            "other float": draw(st.sampled_from(FLOATS)),
            "odd": draw(st.sampled_from(ODD_DTYPES)),
        }[kind]
        ndim = len(shape) - (draw(st.sampled_from([0] * 6 + [1, 2, -1])) if hostile else 0)
        shape = shape[len(shape) - ndim :] if ndim <= len(shape) else (1, *shape)
        return (rng.standard_normal(shape) * 2).astype(as_dtype)

    q = array((batch, heads_q, seq_q, d))
    k = array((batch, heads_kv, seq_k, d))
    v = array((batch, heads_kv, seq_k, dv))
    kw = {
        name: draw(st.sampled_from(valid + invalid if hostile else valid))
        for name, (valid, invalid) in KEYWORDS.items()
    }
    mask = draw(st.sampled_from([None, None, "bool", "float", *(["bad shape"] * hostile)]))
    if mask == "bool":
        kw["mask"] = rng.random((seq_q, seq_k)) < 0.7
    elif mask == "float":
        kw["mask"] = rng.standard_normal((1, heads_q, seq_q, seq_k)).astype(np.float32)
    elif mask == "bad shape":
        kw["mask"] = np.ones((seq_q + 1, 3), bool)
    if draw(st.booleans()):
        kw["alibi_slopes"] = rng.random(heads_q + draw(st.sampled_from([0, 0, hostile])))
    if draw(st.booleans()):
        kw["sinks"] = rng.standard_normal(heads_q * draw(st.sampled_from([1, 1, 1 + hostile])))
    return q, k, v, kw


def _call(fn, *args, **kw):
    try:
        return fn(*args, **kw), None
    except flashport.FlashportError as e:
        assert not isinstance(e, flashport.InternalError), f"internal error: {e}"
        assert str(e), "an error without a message"
        return None, e


@given(arrays_and_keywords())
def test_every_call_returns_right_results_or_a_flashport_error(backend, data):
    q, k, v, kw = data
    before = _snapshot(q, k, v, kw)
    result, error = _call(flashport.attention, q, k, v, return_lse=True, device=backend, **kw)
    _assert_unchanged(before, _snapshot(q, k, v, kw))
    if error is not None:
        event(f"refused: {type(error).__name__}")
        return
    event("accepted")
    out, lse = result
    dtype = q.dtype.type
    # Here every argument was valid: the values must be right.
    names = ("window", "mask", "alibi_slopes", "softcap", "sinks")
    variants = {n: kw[n] for n in names if n in kw}
    variants.update(q_offset=kw["q_offset"], k_offset=kw["k_offset"])
    variants = {n: x for n, x in variants.items() if x is not None}
    if kw["dropout_p"]:
        variants.update(dropout_p=kw["dropout_p"], seed=kw["seed"])
    case = SimpleNamespace(causal=bool(kw["causal"]), scale=kw["scale"])
    want_out, want_lse = oracle(case, q, k, v, dtype, **variants)
    base_out, base_lse = naive(case, q, k, v, dtype, **variants)
    scores = score_magnitude(case, q, k, **variants)
    assert_close("o", out, want_out, base_out, dtype, scores)
    assert_close("lse", lse, want_lse, base_lse, dtype, scores)

    do = np.random.default_rng(1).standard_normal(out.shape).astype(out.dtype)
    grads, error = _call(flashport.attention_backward, do, q, k, v, out, lse, device=backend, **kw)
    assert error is None, f"the backward of an accepted forward failed: {error!r}"
    for grad, x in zip(grads, (q, k, v), strict=False):
        assert grad.shape == x.shape and grad.dtype == x.dtype
        assert np.isfinite(grad).all()
