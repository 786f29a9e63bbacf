"""Attention variants (sliding window, boolean and float masks, ALiBi,
softcap, sinks, dropout) against the float64 oracle, on every backend: each
variant alone and in random combinations with causal, GQA, seq_q != seq_k,
d != d_v and sizes that are not tile multiples; the gradients of sinks and
of a float mask; the dropout generator; finite differences; bad arguments."""

from __future__ import annotations

import flashport
import numpy as np
import pytest
from cases import (
    VARIANT_NAMES,
    Case,
    Variants,
    assert_backends_agree,
    cases,
    check_against_oracle,
    variants,
)
from flashport import (
    BackendUnavailableError,
    DTypeError,
    InvalidArgumentError,
    ShapeError,
    reference,
)
from hypothesis import given, settings
from hypothesis import strategies as st

DTYPES = [np.float32, np.float64, np.float16]

# Each example runs the kernel forward and backward and the oracle (in
# extended precision for float64) on the full score matrix: smaller
# problems than test_properties keep this file to a minute or two.
MAX_WORK = {"cpu": 2e7, "gpu": 3e6}

# The per-variant tests split the profile's examples between them; the
# combined test gets the profile's full count.
PER_VARIANT = settings(max_examples=max(8, settings.default.max_examples // 3))


def _dtype_for(backend, dtype):
    # float64 is a CPU-only dtype (checked in test_properties).
    return np.float32 if backend == "gpu" and dtype == np.float64 else dtype


def check_variants(case: Case, var: Variants, dtype, backend: str) -> None:
    """Forward (o, lse) and backward (dq, dk, dv, dsinks, dmask) of ``case``
    with the variants ``var`` against the oracle, with test_properties'
    tolerance rule."""
    check_against_oracle(case, var.kwargs(case, dtype), dtype, backend)


@pytest.mark.parametrize("name", VARIANT_NAMES)
@PER_VARIANT
@given(data=st.data(), dtype=st.sampled_from(DTYPES))
def test_each_variant_matches_reference(backend, name, data, dtype):
    dtype = _dtype_for(backend, dtype)
    case = data.draw(cases(backend, max_work=MAX_WORK[backend]), label="case")
    var = data.draw(variants(case, (name,), each=True), label="variants")
    check_variants(case, var, dtype, backend)


@given(data=st.data(), dtype=st.sampled_from(DTYPES))
def test_combined_variants_match_reference(backend, data, dtype):
    dtype = _dtype_for(backend, dtype)
    case = data.draw(cases(backend, max_work=MAX_WORK[backend]), label="case")
    var = data.draw(variants(case), label="variants")
    check_variants(case, var, dtype, backend)


# Shapes and variants the strategies might take long to find.
EDGE_CASES = [
    # Window narrower than a tile, seq_q > seq_k: the first rows see nothing.
    (Case(1, 2, 2, 70, 33, 16, 8, False, None, 4, 1), Variants(window=(2, 0), seed=1)),
    # Window and causal together, GQA, every side bounded.
    (Case(2, 1, 3, 45, 61, 8, 12, True, 0.5, 4, 2), Variants(window=(5, 3), seed=2)),
    # (seq_q, seq_k) bool mask with a dead row, sinks: lse = sink there.
    (
        Case(1, 2, 1, 19, 23, 8, 8, False, None, 4, 3),
        Variants(mask="bool", mask_shape=(19, 23), mask_dead_row=True, sinks=True, seed=3),
    ),
    # Key-padding float mask (seq_k,) with -inf, ALiBi per batch, softcap.
    (
        Case(3, 2, 2, 17, 40, 16, 16, True, None, 4, 4),
        Variants(
            mask="float",
            mask_shape=(40,),
            mask_density=0.7,
            alibi="batch",
            softcap=5.0,
            seed=4,
        ),
    ),
    # Everything at once, 3-d inputs, a float mask broadcast over heads.
    (
        Case(1, 2, 2, 33, 29, 24, 20, True, 0.3, 3, 5),
        Variants(
            window=(None, 4),
            mask="float",
            mask_shape=(1, 33, 29),
            mask_dead_row=True,
            alibi="heads",
            softcap=2.0,
            sinks=True,
            sink_scale=4.0,
            dropout_p=0.25,
            dropout_seed=2**63 + 12345,
            seed=5,
        ),
    ),
    # Dropout on 2-d inputs with one key; a (1, 1, seq_q, 1) float mask.
    (
        Case(1, 1, 1, 9, 1, 4, 4, False, None, 2, 6),
        Variants(mask="float", mask_shape=(1, 1, 9, 1), dropout_p=0.5, dropout_seed=7, seed=6),
    ),
]


@pytest.mark.parametrize("index", range(len(EDGE_CASES)))
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=lambda t: t.__name__)
def test_variant_edge_cases(backend, index, dtype):
    case, var = EDGE_CASES[index]
    check_variants(case, var, _dtype_for(backend, dtype), backend)


def _rows_without_keys_problem():
    rng = np.random.default_rng(21)
    q = rng.standard_normal((2, 3, 7, 8)).astype(np.float32)
    k = rng.standard_normal((2, 3, 4, 8)).astype(np.float32)
    v = rng.standard_normal((2, 3, 4, 5)).astype(np.float32)
    do = rng.standard_normal((2, 3, 7, 5)).astype(np.float32)
    return q, k, v, do


# seq_q=7, seq_k=4 (off = -3): the keywords below hide every key of rows
# 0..2 (and only those).
HIDING = {
    "causal": {"causal": True},
    "window": {"window": (1, 0)},
    "bool-mask": {"mask": np.repeat(np.arange(7)[:, None] >= 3, 4, axis=1)},
    "float-mask": {
        "mask": np.repeat(np.where(np.arange(7)[:, None] >= 3, 0.5, -np.inf), 4, axis=1).astype(
            np.float32
        )
    },
}


@pytest.mark.parametrize("hiding", HIDING, ids=list(HIDING))
@pytest.mark.parametrize("with_sinks", [False, True], ids=["no-sinks", "sinks"])
def test_rows_without_visible_key(backend, hiding, with_sinks):
    """A row that sees no key has output 0, dq 0, and lse -inf, or lse =
    sink exactly with sinks; the other rows are finite."""
    q, k, v, do = _rows_without_keys_problem()
    kw = dict(HIDING[hiding])
    sinks = np.array([0.5, -1.0, 3.0], np.float32)
    if with_sinks:
        kw["sinks"] = sinks
    out, lse = flashport.attention(q, k, v, return_lse=True, device=backend, **kw)
    assert np.all(out[:, :, :3] == 0)
    if with_sinks:
        assert np.array_equal(lse[:, :, :3], np.broadcast_to(sinks[:, None], (2, 3, 3)))
    else:
        assert np.all(np.isneginf(lse[:, :, :3]))
    assert np.isfinite(lse[:, :, 3:]).all() and np.all(out[:, :, 3:] != 0)
    grads = flashport.attention_backward(do, q, k, v, out, lse, device=backend, **kw)
    assert np.all(grads[0][:, :, :3] == 0)
    assert all(np.isfinite(g).all() for g in grads)
    want = reference.attention_backward(do, q, k, v, **kw)
    for g, w in zip(grads, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_sink_of_minus_infinity_is_no_sink(backend):
    q, k, v, do = _rows_without_keys_problem()
    sinks = np.full(3, -np.inf, np.float32)
    out, lse = flashport.attention(q, k, v, causal=True, return_lse=True, device=backend)
    out_s, lse_s = flashport.attention(
        q, k, v, causal=True, sinks=sinks, return_lse=True, device=backend
    )
    np.testing.assert_array_equal(out_s, out)
    np.testing.assert_array_equal(lse_s, lse)
    *_grads, dsinks = flashport.attention_backward(
        do, q, k, v, out, lse, causal=True, sinks=sinks, device=backend
    )
    assert np.all(dsinks == 0)


# ---------------------------------------------------------------- dropout


KNOWN_ANSWERS = [
    ([0, 0, 0, 0], [0, 0], [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
    ([0xFFFFFFFF] * 4, [0xFFFFFFFF] * 2, [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
    (
        [0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344],
        [0xA4093822, 0x299F31D0],
        [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1],
    ),
]


@pytest.mark.parametrize("counter,key,want", KNOWN_ANSWERS)
def test_philox_matches_random123_known_answers(counter, key, want):
    assert [int(w) for w in reference.philox4x32_10(counter, key)] == want


def test_dropout_keep_layout():
    """dropout_keep, element by element: word j % 4 of the generator at
    counter [j // 4, i, b·heads_q + h, 0] and key [seed low, seed high]
    against floor(p · 2³²)."""
    seed, p, shape = 2**40 + 2**33 + 977, 0.37, (2, 3, 5, 11)
    keep = reference.dropout_keep(seed, p, shape)
    assert keep.shape == shape and keep.dtype == np.bool_
    threshold = int(np.floor(p * 2**32))
    for b, h, i, j in np.ndindex(shape):
        counter = [j // 4, i, b * shape[1] + h, 0]
        words = reference.philox4x32_10(counter, [seed & 0xFFFFFFFF, seed >> 32])
        assert keep[b, h, i, j] == (int(words[j % 4]) >= threshold)
    assert reference.dropout_keep(seed, 0.0, shape).all()
    assert not np.array_equal(keep, reference.dropout_keep(seed + 1, p, shape))


def _kept(backend, p, seed, dtype=np.float32):
    """The library's dropout mask, read through v = identity: o[i, j] =
    P_ij · Z_ij, and every P_ij > 0 here."""
    rng = np.random.default_rng(4)
    seq_q, seq_k = 64, 72
    q = rng.standard_normal((2, 4, seq_q, 8)).astype(dtype)
    k = rng.standard_normal((2, 2, seq_k, 8)).astype(dtype)
    v = np.broadcast_to(np.eye(seq_k, dtype=dtype), (2, 2, seq_k, seq_k))
    out = flashport.attention(q, k, v, dropout_p=p, seed=seed, device=backend)
    p_full = reference.attention(q, k, v)
    np.testing.assert_allclose(out, np.where(out != 0, p_full / (1 - p), 0), rtol=1e-5, atol=1e-7)
    return out != 0


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_keeps_one_minus_p_and_matches_the_reference_mask(backend, p):
    seed = 2**64 - 1 - int(p * 1000)
    kept = _kept(backend, p, seed)
    np.testing.assert_array_equal(kept, reference.dropout_keep(seed, p, kept.shape))
    n = kept.size
    fraction = kept.mean()
    sigma = np.sqrt(p * (1 - p) / n)
    assert abs(fraction - (1 - p)) < 5 * sigma, (fraction, 1 - p, sigma)


def test_dropout_seed_changes_the_result(backend):
    q, k, v, _do = _rows_without_keys_problem()

    def run(seed):
        return flashport.attention(q, k, v, dropout_p=0.3, seed=seed, device=backend)

    base = run(5)
    assert run(5).tobytes() == base.tobytes()
    assert not np.array_equal(run(6), base)
    assert not np.array_equal(run(5 + 2**32), base)  # the key's high word counts


def test_dropout_p_zero_ignores_the_seed(backend):
    q, k, v, _do = _rows_without_keys_problem()
    plain = flashport.attention(q, k, v, device=backend)
    assert flashport.attention(q, k, v, dropout_p=0.0, seed=9, device=backend).tobytes() == (
        plain.tobytes()
    )


def test_dropout_mask_is_the_same_on_cpu_and_gpu(gpu):
    for p, seed in [(0.2, 1), (0.6, 2**50 + 3)]:
        np.testing.assert_array_equal(_kept("cpu", p, seed), _kept(gpu, p, seed))


@given(data=st.data())
def test_cpu_and_gpu_agree_with_dropout(gpu, data):
    """With dropout (and other variants), the two backends' results differ
    by at most what each may differ from the oracle, added up."""
    dtype = np.float32
    case = data.draw(cases(gpu, max_work=MAX_WORK[gpu]), label="case")
    var = data.draw(variants(case), label="variants")
    var = Variants(**{**var.__dict__, "dropout_p": 0.4, "dropout_seed": case.seed})
    q, k, v, do = case.arrays(dtype)
    kw = var.kwargs(case, dtype)
    common = {"causal": case.causal, "scale": case.scale, **kw}
    results = {}
    for device in ("cpu", gpu):
        out, lse = flashport.attention(q, k, v, return_lse=True, device=device, **common)
        grads = flashport.attention_backward(do, q, k, v, out, lse, device=device, **common)
        results[device] = (out, *grads[:3])
    assert_backends_agree(case, results, q, k, v, do, dtype, **kw)


# ------------------------------------------------------ finite differences


def _numeric_gradient(loss, x, h=1e-6):
    grad = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        saved = x[idx]
        x[idx] = saved + h
        plus = loss()
        x[idx] = saved - h
        minus = loss()
        x[idx] = saved
        grad[idx] = (plus - minus) / (2 * h)
    return grad


def _fd_problem(seed=5):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, 4, 5, 3))
    k = rng.standard_normal((2, 2, 6, 3))
    v = rng.standard_normal((2, 2, 6, 4))
    w = rng.standard_normal((2, 4, 5, 4))  # loss = sum(w * o)
    return rng, q, k, v, w


FD_VARIANTS = {
    "softcap": lambda rng: {"softcap": 0.8},
    "sinks": lambda rng: {"sinks": rng.standard_normal(4)},
    "float-mask": lambda rng: {"mask": rng.standard_normal((4, 1, 6))},
    "alibi+window": lambda rng: {"alibi_slopes": rng.random((2, 4)), "window": (1, 2)},
    "dropout": lambda rng: {"dropout_p": 0.4, "seed": 99},
    "all": lambda rng: {
        "causal": True,
        "softcap": 1.3,
        "sinks": rng.standard_normal(4),
        "mask": np.where(rng.random((5, 6)) < 0.2, -np.inf, rng.standard_normal((5, 6))),
        "alibi_slopes": rng.random(4),
        "window": (3, None),
        "dropout_p": 0.3,
        "seed": 2**40,
    },
}


def _fd_check(forward, backward, variant):
    rng, q, k, v, w = _fd_problem()
    kw = FD_VARIANTS[variant](rng)
    has_mask = "mask" in kw
    out, lse = forward(q, k, v, **kw)
    grads = backward(w, q, k, v, out, lse, return_dmask=has_mask, **kw)
    wrt = [q, k, v]
    if "sinks" in kw:
        wrt.append(kw["sinks"])
    if has_mask:
        wrt.append(kw["mask"])
    assert len(grads) == len(wrt)
    for x, g in zip(wrt, grads, strict=True):
        numeric = _numeric_gradient(lambda: np.sum(w * forward(q, k, v, **kw)[0]), x)
        finite = np.isfinite(x) if x is kw.get("mask") else np.ones(x.shape, bool)
        np.testing.assert_allclose(g[finite], numeric[finite], rtol=1e-6, atol=1e-8)
        assert np.all(g[~finite] == 0)


@pytest.mark.parametrize("variant", FD_VARIANTS)
def test_reference_gradients_match_finite_differences(variant):
    """The oracle's analytic gradients (dq, dk, dv, dsinks, dmask) against
    central differences of its own forward."""
    _fd_check(
        lambda *a, **kw: reference.attention(*a, return_lse=True, **kw),
        lambda *a, **kw: reference.attention_backward(*a, **kw),
        variant,
    )


@pytest.mark.parametrize("variant", ["softcap", "sinks", "float-mask", "all"])
def test_cpu_float64_gradients_match_finite_differences(variant):
    """The library's own float64 gradients against central differences of
    the library's forward: independent of the oracle."""
    _fd_check(
        lambda *a, **kw: flashport.attention(*a, return_lse=True, device="cpu", **kw),
        lambda *a, **kw: flashport.attention_backward(*a, device="cpu", **kw),
        variant,
    )


# ------------------------------------------------------------------ errors

rng = np.random.default_rng(7)
Q = rng.standard_normal((2, 4, 10, 8)).astype(np.float32)
K = rng.standard_normal((2, 2, 12, 8)).astype(np.float32)
V = rng.standard_normal((2, 2, 12, 6)).astype(np.float32)

ERRORS = {
    "window-minus-2": ({"window": (-2, 0)}, InvalidArgumentError, ["window", "-2"]),
    "window-right-minus-2": ({"window": (3, -2)}, InvalidArgumentError, ["window", "-2"]),
    "window-not-a-pair": ({"window": 3}, InvalidArgumentError, ["window"]),
    "softcap-negative": ({"softcap": -1.0}, InvalidArgumentError, ["softcap", "-1"]),
    "softcap-nan": ({"softcap": float("nan")}, InvalidArgumentError, ["softcap"]),
    "dropout-1": ({"dropout_p": 1.0, "seed": 1}, InvalidArgumentError, ["dropout_p", "1"]),
    "dropout-negative": ({"dropout_p": -0.1, "seed": 1}, InvalidArgumentError, ["dropout_p"]),
    "dropout-no-seed": ({"dropout_p": 0.1}, InvalidArgumentError, ["seed", "dropout_p"]),
    "seed-negative": ({"dropout_p": 0.1, "seed": -1}, InvalidArgumentError, ["seed", "-1"]),
    "seed-too-large": ({"dropout_p": 0.1, "seed": 2**64}, InvalidArgumentError, ["seed"]),
    "seed-negative-no-dropout": ({"seed": -5}, InvalidArgumentError, ["seed", "-5"]),
    "mask-wrong-shape": ({"mask": np.ones((10, 11), bool)}, ShapeError, ["mask", "(10, 11)"]),
    "mask-too-many-dims": ({"mask": np.ones((1, 2, 4, 10, 12), bool)}, ShapeError, ["mask"]),
    "mask-wrong-heads": ({"mask": np.ones((3, 10, 12), bool)}, ShapeError, ["mask", "(3, 10, 12)"]),
    "mask-int": ({"mask": np.ones((10, 12), np.int32)}, DTypeError, ["mask", "int32"]),
    "sinks-wrong-shape": ({"sinks": np.zeros(2, np.float32)}, ShapeError, ["sinks", "(2,)"]),
    "sinks-2d": ({"sinks": np.zeros((2, 4), np.float32)}, ShapeError, ["sinks", "(2, 4)"]),
    "sinks-int": ({"sinks": np.zeros(4, np.int64)}, DTypeError, ["sinks", "int64"]),
    "alibi-wrong-shape": ({"alibi_slopes": np.ones(3)}, ShapeError, ["alibi_slopes", "(3,)"]),
    "alibi-wrong-batch": ({"alibi_slopes": np.ones((3, 4))}, ShapeError, ["alibi_slopes"]),
    "alibi-int": ({"alibi_slopes": np.ones(4, np.int32)}, DTypeError, ["alibi_slopes", "int32"]),
}


def _check_error(call, error, fragments):
    with pytest.raises(error) as info:
        call()
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


@pytest.mark.parametrize("which", ERRORS, ids=list(ERRORS))
def test_bad_variant_arguments(backend, which):
    kw, error, fragments = ERRORS[which]
    _check_error(lambda: flashport.attention(Q, K, V, device=backend, **kw), error, fragments)
    out, lse = flashport.attention(Q, K, V, return_lse=True, device="cpu")
    _check_error(
        lambda: flashport.attention_backward(Q[..., :6], Q, K, V, out, lse, device=backend, **kw),
        error,
        fragments,
    )


@pytest.mark.parametrize("mask", [None, np.ones((10, 12), bool)], ids=["no-mask", "bool-mask"])
def test_return_dmask_needs_a_float_mask(backend, mask):
    out, lse = flashport.attention(Q, K, V, return_lse=True, device="cpu")
    do = np.cos(out)
    with pytest.raises(InvalidArgumentError) as info:
        flashport.attention_backward(
            do, Q, K, V, out, lse, mask=mask, return_dmask=True, device=backend
        )
    assert "return_dmask" in str(info.value)
    assert ("bool" if mask is not None else "mask=None") in str(info.value)


def test_library_keeps_working_after_variant_errors(backend):
    for kw, error, _ in ERRORS.values():
        with pytest.raises(error):
            flashport.attention(Q, K, V, device=backend, **kw)
    out = flashport.attention(Q, K, V, device=backend)
    assert np.isfinite(out).all()


def test_gpu_errors_name_an_unsupported_variant_only_after_validation(gpu):
    """Bad arguments get the validation error on the GPU too, never
    BackendUnavailableError; a supported GPU gives results."""
    try:
        flashport.attention(Q, K, V, softcap=2.0, device=gpu)
    except BackendUnavailableError as e:
        assert "softcap" in str(e)
    with pytest.raises(InvalidArgumentError):
        flashport.attention(Q, K, V, softcap=-2.0, device=gpu)


@pytest.mark.parametrize("value", [True, False, -0.75], ids=["true", "false", "float"])
def test_zero_dimensional_mask_broadcasts(backend, value):
    """A 0-d mask broadcasts to every score, as NumPy's rules say: the same
    result as that value broadcast to the full shape."""
    mask = np.array(value) if isinstance(value, bool) else np.array(value, np.float32)
    full = np.broadcast_to(mask, (2, 4, 10, 12)).copy()
    out, lse = flashport.attention(Q, K, V, mask=mask, return_lse=True, device=backend)
    expected, expected_lse = flashport.attention(
        Q, K, V, mask=full, return_lse=True, device=backend
    )
    np.testing.assert_array_equal(out, expected)
    np.testing.assert_array_equal(lse, expected_lse)
    np.testing.assert_allclose(out, flashport.reference.attention(Q, K, V, mask=mask), atol=1e-5)
    if mask.dtype == np.float32:
        do = rng.standard_normal(out.shape).astype(np.float32)
        *_, dmask = flashport.attention_backward(
            do, Q, K, V, out, lse, mask=mask, return_dmask=True, device=backend
        )
        *_, expected_dmask = flashport.reference.attention_backward(
            do, Q, K, V, mask=mask, return_dmask=True
        )
        assert dmask.shape == ()
        np.testing.assert_allclose(dmask, expected_dmask, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("seq_k", [1, 3])
def test_softcap_of_small_scores_keeps_float32_precision(backend, seq_k, seed):
    """Scores far below the cap: tanh's argument is small, where a tanh
    computed as (e^2x - 1) / (e^2x + 1) (lavapipe's builtin) lost ~10 ulps
    of lse and failed the tolerance rule for 5 of these 12 cases."""
    case = Case(1, 1, 1, 1, seq_k, 32, 32, False, None, 4, seed)
    check_against_oracle(case, {"softcap": 30.0}, np.float32, backend)
