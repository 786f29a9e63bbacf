"""Position offsets (``q_offset``, ``k_offset``) on every backend: against
the oracle with causal, windows, ALiBi, softcap, masks, sinks and dropout;
keys cut into blocks, each with its ``k_offset``, give the whole attention
(forward: merged with merge_states; backward: per block with the whole
``o`` and ``lse``, dK/dV by block and dQ as the sum of the blocks'
shares); explicit defaults give the bits of no offsets; offsets far apart
(up to ±2**62) hide or show every key exactly; bad values are refused by
name."""

from __future__ import annotations

import dataclasses

import flashport
import numpy as np
import pytest
from cases import (
    Case,
    assert_close,
    cases,
    check_against_oracle,
    naive,
    naive_backward,
    naive_merge,
    oracle,
    oracle_backward,
    score_magnitude,
    splits,
    term_magnitudes,
    variants,
)
from flashport import InvalidArgumentError, ProblemTooLargeError, reference
from hypothesis import given
from hypothesis import strategies as st

DTYPES = [np.float32, np.float64, np.float16]

# As in test_variants: the oracle runs on the full score matrix.
MAX_WORK = {"cpu": 2e7, "gpu": 3e6}


def _dtype_for(backend, dtype):
    return np.float32 if backend == "gpu" and dtype == np.float64 else dtype


@st.composite
def positions(draw, case: Case, far: bool = True) -> dict:
    """``q_offset`` and ``k_offset`` (either may be left out): mostly with
    a diagonal where causal and windows cut inside the problem, sometimes
    far away (all keys hidden or shown), around small or large positions."""
    k_offset = draw(
        st.one_of(st.none(), st.integers(-40, 40), st.integers(-(2**40), 2**40), st.just(0))
    )
    near = st.integers(-case.seq_q - 3, case.seq_k + 3)
    diagonals = [near, near, st.just(case.seq_k - case.seq_q)]
    if far:
        diagonals.append(st.integers(-(2**41), 2**41))
    diagonal = draw(st.one_of(*diagonals))
    kw = {"q_offset": diagonal + (k_offset or 0)}
    if k_offset is not None:
        kw["k_offset"] = k_offset
    if abs(k_offset or 0) <= 40 and draw(st.integers(0, 4)) == 0:
        del kw["q_offset"]  # the default, seq_k - seq_q
    return kw


@given(data=st.data(), dtype=st.sampled_from(DTYPES))
def test_offsets_match_reference(backend, data, dtype):
    dtype = _dtype_for(backend, dtype)
    case = data.draw(cases(backend, max_work=MAX_WORK[backend]), label="case")
    var = data.draw(variants(case), label="variants")
    kw = var.kwargs(case, dtype)
    # ALiBi with a far diagonal only subtracts a huge constant per row.
    kw.update(data.draw(positions(case, far="alibi_slopes" not in kw), label="positions"))
    check_against_oracle(case, kw, dtype, backend)


@given(data=st.data(), dtype=st.sampled_from(DTYPES))
def test_key_blocks_give_the_whole_attention(backend, data, dtype):
    """Ring attention's pieces: per key block (with its k_offset), the
    forward merged by merge_states, and the backward with the whole o and
    lse giving that block's dK, dV and a share of dQ."""
    dtype = _dtype_for(backend, dtype)
    case = data.draw(cases(backend, max_work=MAX_WORK[backend]), label="case")
    var = data.draw(variants(case, ("window", "alibi", "softcap")), label="variants")
    kw = var.kwargs(case, dtype)
    where = data.draw(positions(case, far="alibi_slopes" not in kw), label="positions")
    q_offset = where.get("q_offset", case.seq_k - case.seq_q)
    k_offset = where.get("k_offset", 0)
    blocks = data.draw(splits(case.seq_k), label="blocks")
    q, k, v, do = case.arrays(dtype)
    common = {"causal": case.causal, "scale": case.scale, "device": backend, **kw}
    whole = {"q_offset": q_offset, "k_offset": k_offset, **kw}
    out, lse = flashport.attention(q, k, v, return_lse=True, **where, **common)

    outs, lses, naive_outs, naive_lses, grads = [], [], [], [], []
    for start, end in blocks:
        at = {"q_offset": q_offset, "k_offset": k_offset + start}
        kb, vb = k[..., start:end, :], v[..., start:end, :]
        o_b, lse_b = flashport.attention(q, kb, vb, return_lse=True, **at, **common)
        outs.append(o_b)
        lses.append(lse_b)
        part = dataclasses.replace(case, seq_k=end - start)
        n_o, n_lse = naive(part, q, kb, vb, dtype, **at, **kw)
        naive_outs.append(n_o)
        naive_lses.append(n_lse)
        grads.append(flashport.attention_backward(do, q, kb, vb, out, lse, **at, **common))
    merged, merged_lse = flashport.merge_states(outs, lses, device=backend)

    scores = score_magnitude(case, q, k, **whole)
    terms = term_magnitudes(case, do, q, k, v, **whole)
    want_out, want_lse = oracle(case, q, k, v, dtype, **whole)
    base_out, base_lse = naive_merge(naive_outs, naive_lses, dtype)
    assert_close("o", merged, want_out, base_out, dtype, scores, terms["o"])
    assert_close("lse", merged_lse, want_lse, base_lse, dtype, scores, terms["lse"])

    dq = grads[0][0]
    for g in grads[1:]:
        dq = dq + g[0]
    dk = np.concatenate([g[1] for g in grads], axis=-2)
    dv = np.concatenate([g[2] for g in grads], axis=-2)
    want = oracle_backward(case, do, q, k, v, dtype, **whole)
    baseline = naive_backward(case, do, q, k, v, dtype, **whole)
    for name, g, w, b in zip(("dq", "dk", "dv"), (dq, dk, dv), want, baseline, strict=True):
        assert g.dtype == dtype
        assert_close(name, g, w, b, dtype, scores, terms[name])


def _problem(dtype=np.float32):
    rng = np.random.default_rng(5)
    q = rng.standard_normal((2, 4, 13, 8)).astype(dtype)
    k = rng.standard_normal((2, 2, 21, 8)).astype(dtype)
    v = rng.standard_normal((2, 2, 21, 6)).astype(dtype)
    do = rng.standard_normal((2, 4, 13, 6)).astype(dtype)
    return q, k, v, do


KEYWORDS = {
    "plain": {},
    "causal": {"causal": True},
    "window": {"window": (3, 2)},
    "everything": {
        "causal": True,
        "window": (4, None),
        "alibi_slopes": np.array([0.5, 0.25, 0.125, 1.0], np.float32),
        "softcap": 3.0,
        "dropout_p": 0.2,
        "seed": 9,
    },
}


@pytest.mark.parametrize("name", KEYWORDS)
def test_explicit_defaults_give_the_same_bits(backend, name):
    q, k, v, do = _problem()
    kw = {"device": backend, **KEYWORDS[name]}
    defaults = {"q_offset": 21 - 13, "k_offset": 0}
    out, lse = flashport.attention(q, k, v, return_lse=True, **kw)
    out2, lse2 = flashport.attention(q, k, v, return_lse=True, **defaults, **kw)
    assert out.tobytes() == out2.tobytes() and lse.tobytes() == lse2.tobytes()
    grads = flashport.attention_backward(do, q, k, v, out, lse, **kw)
    grads2 = flashport.attention_backward(do, q, k, v, out, lse, **defaults, **kw)
    for g, g2 in zip(grads, grads2, strict=True):
        assert g.tobytes() == g2.tobytes()
    # Shifting both positions alike changes nothing either.
    shifted = {"q_offset": 8 + 10**15, "k_offset": 10**15}
    out3 = flashport.attention(q, k, v, **shifted, **kw)
    assert out3.tobytes() == out.tobytes()


@pytest.mark.parametrize(
    "q_offset,k_offset,sees",
    [
        (2**62, -(2**62), "all"),
        (-(2**62), 2**62, "none"),
        (2**62, 2**62 - 12, "diagonal"),
        (np.int64(-5), np.int16(-5), "diagonal"),
    ],
)
def test_extreme_positions(backend, q_offset, k_offset, sees):
    """At the ends of the range, causal shows every key, none, or the
    top-left diagonal (equal positions), exactly."""
    q, k, v, do = _problem()
    kw = {"causal": True, "q_offset": q_offset, "k_offset": k_offset}
    out, lse = flashport.attention(q, k, v, return_lse=True, device=backend, **kw)
    want, want_lse = reference.attention(q, k, v, return_lse=True, **kw)
    if sees == "none":
        assert np.all(out == 0) and np.all(np.isneginf(lse))
    else:
        np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(lse, want_lse, rtol=1e-5)
    if sees == "all":
        plain = flashport.attention(q, k, v, device=backend)
        np.testing.assert_allclose(out, plain, rtol=1e-5, atol=1e-6)
    grads = flashport.attention_backward(do, q, k, v, out, lse, device=backend, **kw)
    for g, w in zip(grads, reference.attention_backward(do, q, k, v, **kw), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "value,fragment",
    [
        (True, "bool"),
        (np.True_, "bool"),
        (1.0, "float"),
        (np.float32(2), "float"),
        ("3", "string"),
        (2**62 + 1, "2**62"),
        (-(2**62) - 1, "2**62"),
        (2**200, "out of range"),
    ],
)
@pytest.mark.parametrize("name", ["q_offset", "k_offset"])
def test_bad_offsets_are_refused_by_name(backend, name, value, fragment):
    q, k, v, do = _problem()
    with pytest.raises(InvalidArgumentError, match=name) as info:
        flashport.attention(q, k, v, device=backend, **{name: value})
    assert fragment in str(info.value)
    out, lse = flashport.attention(q, k, v, return_lse=True, device=backend)
    with pytest.raises(InvalidArgumentError, match=name):
        flashport.attention_backward(do, q, k, v, out, lse, device=backend, **{name: value})


def test_alibi_positions_beyond_32_bits_are_too_large_for_the_gpu(gpu):
    """The GPU measures ALiBi distances in i32: a diagonal too far away is a
    ProblemTooLargeError there, computed on the CPU, and without ALiBi any
    offsets run on the GPU (the uniform holds them clamped)."""
    q, k, v, _ = _problem()
    slopes = np.full(4, 1e-9, np.float32)
    kw = {"alibi_slopes": slopes, "q_offset": 2**31, "k_offset": 0}
    with pytest.raises(ProblemTooLargeError, match="q_offset"):
        flashport.attention(q, k, v, device=gpu, **kw)
    out = flashport.attention(q, k, v, device="cpu", **kw)
    np.testing.assert_allclose(out, reference.attention(q, k, v, **kw), rtol=1e-4, atol=1e-5)
    kw = {"causal": True, "q_offset": 2**40, "k_offset": 2**40 + 3}
    np.testing.assert_allclose(
        flashport.attention(q, k, v, device=gpu, **kw),
        reference.attention(q, k, v, **kw),
        rtol=1e-4,
        atol=1e-5,
    )
