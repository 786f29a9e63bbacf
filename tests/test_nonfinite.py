"""Non-finite inputs (docs/design.md#non-finite-inputs) on every backend and
in the float64 reference: a key hidden from a row (causal, the window, a
bool mask, a float mask's -inf, a packed batch's other sequences, cache
positions past a sequence's length) never reaches it, whatever NaN or
infinity its k and v hold, forward and backward; visible NaN scores and
sinks give NaN rows, visible +inf ones lse = +inf and o = NaN; a NaN or
infinity in a visible key's v makes the row's o NaN; a backward given a NaN
or +inf lse returns NaN gradients for that row; a row that sees no key
still gets o = 0, lse = -inf and zero gradients.

On the GPU each case runs on the default tier (tiled on lavapipe) and on
the simple kernels. Only the simple kernels follow these rules; a screen
sends every call whose inputs hold NaN or infinities to them
(src/gpu/screen.rs), so "the clean call" a result must equal bit for bit
runs on the simple kernels there (`_clean`). Decoding and merge_states
follow the rules themselves."""

from __future__ import annotations

import flashport
import numpy as np
import pytest
from conftest import overrides
from flashport import _core, reference

POISONS = [np.nan, np.inf, -np.inf]
# (batch, heads_q, heads_kv, seq_q, seq_k, d, d_v): several key tiles on
# each backend (the CPU's tiles are larger), GQA, d != d_v.
SHAPES = {"cpu": (1, 4, 2, 70, 300, 16, 12), "gpu": (1, 2, 1, 24, 72, 8, 12)}


def _dtypes(backend):
    return [np.float32, np.float64] if backend == "cpu" else [np.float32]


def _tiers(backend):
    return [None] if backend == "cpu" else [None, "simple"]


def _clean(backend, tier, f, *args, **kw):
    """``f`` with finite data on the kernels a call with NaN or infinities
    runs: on the GPU the simple ones, whose results differ from the tiled
    and cooperative kernels' by rounding only."""
    return _run(backend, "simple" if backend == "gpu" else tier, f, *args, **kw)


def _run(backend, tier, f, *args, **kw):
    """``f(backend, *args, **kw)``, on the GPU with kernels up to ``tier``."""
    if tier is None:
        return f(backend, *args, **kw)
    with overrides(max_tier=tier):
        return f(backend, *args, **kw)


def _data(rng, shape, dtype):
    """Random values of magnitude 0.25 to 1 and random signs: never 0."""
    x = rng.uniform(0.25, 1.0, shape) * rng.choice([-1.0, 1.0], shape)
    return x.astype(dtype)


def _arrays(backend, dtype, seed=0, heads_kv=None, seq_k=None):
    """q, k, v, do of the backend's shape (its kv heads or keys replaced
    where given)."""
    b, hq, hkv, sq, sk, d, dv = SHAPES[backend]
    hkv, sk = heads_kv or hkv, seq_k or sk
    rng = np.random.default_rng(seed)
    q = _data(rng, (b, hq, sq, d), dtype)
    k = _data(rng, (b, hkv, sk, d), dtype)
    v = _data(rng, (b, hkv, sk, dv), dtype)
    do = _data(rng, (b, hq, sq, dv), dtype)
    return q, k, v, do


def _poison(x, keys, value, rng):
    """A copy of ``x`` (``(..., seq, width)``) with ``value`` in rows
    ``keys``: the whole row for every other key, one element for the rest."""
    x = x.copy()
    for n, j in enumerate(keys):
        if n % 2:
            x[..., j, rng.integers(x.shape[-1])] = value
        else:
            x[..., j, :] = value
    return x


def _tol(dtype):
    return {np.float32: 2e-4, np.float64: 1e-9}[dtype]


def _assert_like(actual, expected, dtype, what):
    """Same NaN and infinity positions (and signs), finite values close."""
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape, what
    np.testing.assert_array_equal(np.isnan(actual), np.isnan(expected), err_msg=what)
    finite = np.isfinite(expected)
    np.testing.assert_array_equal(actual[~finite], expected[~finite], err_msg=what)
    tol = _tol(dtype)
    np.testing.assert_allclose(actual[finite], expected[finite], rtol=tol, atol=tol, err_msg=what)


def _forward_backward(device, q, k, v, do, return_dmask=False, **kw):
    o, lse = flashport.attention(q, k, v, return_lse=True, device=device, **kw)
    grads = flashport.attention_backward(
        do, q, k, v, o, lse, device=device, return_dmask=return_dmask, **kw
    )
    return (o, lse, *grads)


def _reference(q, k, v, do, return_dmask=False, **kw):
    o, lse = reference.attention(q, k, v, return_lse=True, **kw)
    grads = reference.attention_backward(do, q, k, v, return_dmask=return_dmask, **kw)
    return (o, lse, *grads)


def _forward(device, q, k, v, **kw):
    return flashport.attention(q, k, v, return_lse=True, device=device, **kw)


def _backward_with_lse(device, q, k, v, do, o, lse, lse_value, **kw):
    """The backward from ``o`` and ``lse``, with ``lse_value`` as the lse
    of row 4 of head 1 (unless None)."""
    if lse_value is not None:
        lse = lse.copy()
        lse[0, 1, 4] = lse_value
    return flashport.attention_backward(do, q, k, v, o, lse, device=device, **kw)


def _varlen(device, q, k, v, do, cu_q, cu_k):
    o, lse = flashport.attention_varlen(
        q, k, v, cu_q, cu_k, causal=True, return_lse=True, device=device
    )
    grads = flashport.attention_varlen_backward(
        do, q, k, v, o, lse, cu_q, cu_k, causal=True, device=device
    )
    return (o, lse, *grads)


def _kvcache(device, q, k_cache, v_cache, lens, splits):
    return flashport.attention_with_kvcache(
        q, k_cache, v_cache, lens, return_lse=True, num_splits=splits, device=device
    )


NAMES = ("o", "lse", "dq", "dk", "dv", "dsinks", "dmask")


def _hidden_everywhere(backend, mechanism):
    """Keyword arguments that hide ``keys`` from every query row, and the
    keys."""
    sq, sk = SHAPES[backend][3:5]
    rng = np.random.default_rng(1)
    # Keys in several tiles, runs and single keys, hidden from every row.
    keys = sorted({1, 2, 3, sk // 2, sk // 2 + 1, sk - 1} | set(rng.choice(sk, 6).tolist()))
    if mechanism == "bool_mask":
        mask = np.ones(sk, bool)
        mask[keys] = False
        return {"mask": mask}, keys
    if mechanism == "float_mask":
        mask = rng.uniform(-0.5, 0.5, (sq, sk)).astype(np.float32)
        mask[:, keys] = -np.inf
        return {"mask": mask}, keys
    if mechanism == "causal":
        # Top-left aligned: keys from seq_q on are in no row's past.
        return {"causal": True, "q_offset": 0, "k_offset": 0}, list(range(sq, sk))
    if mechanism == "window":
        # Bottom-right aligned: row 0 sees keys from seq_k - seq_q - 3 on.
        return {"window": (3, 2)}, list(range(sk - sq - 3))
    raise AssertionError(mechanism)


MECHANISMS = ["bool_mask", "float_mask", "causal", "window"]


@pytest.mark.parametrize("value", POISONS, ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_keys_hidden_from_every_row_never_contribute(backend, mechanism, value):
    """NaN or an infinity in the k and v of keys no row sees changes
    nothing, forward and backward: every result equals the call with those
    keys' data finite (and the float64 reference)."""
    kw, keys = _hidden_everywhere(backend, mechanism)
    for dtype in _dtypes(backend):
        q, k, v, do = _arrays(backend, dtype)
        rng = np.random.default_rng(2)
        bad_k = _poison(k, keys, value, rng)
        bad_v = _poison(v, keys, value, rng)
        want = _reference(q, k, v, do, **kw)
        for tier in _tiers(backend):
            clean = _clean(backend, tier, _forward_backward, q, k, v, do, **kw)
            for bk, bv in [(bad_k, v), (k, bad_v), (bad_k, bad_v)]:
                got = _run(backend, tier, _forward_backward, q, bk, bv, do, **kw)
                for name, g, c, w in zip(NAMES, got, clean, want, strict=False):
                    what = f"{name} ({dtype.__name__}, tier {tier})"
                    assert np.isfinite(g).all(), what
                    np.testing.assert_array_equal(g, c, err_msg=what)
                    _assert_like(g, w, dtype, what)


@pytest.mark.parametrize("value", POISONS, ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("mechanism", ["causal", "window", "bool_mask", "float_mask"])
def test_keys_hidden_from_some_rows(backend, mechanism, value):
    """Keys hidden from some rows only: rows that do not see them equal the
    clean call; rows that see them follow the reference (a NaN or infinity
    in a visible v makes the row NaN; in a visible k, the scores say)."""
    sq, sk = SHAPES[backend][3:5]
    rng = np.random.default_rng(3)
    keys = [sk - sq + 2, sk - sq + sq // 2, sk - 2]
    if mechanism == "causal":
        kw = {"causal": True}
    elif mechanism == "window":
        kw = {"window": (5, 0)}
    elif mechanism == "bool_mask":
        mask = rng.uniform(size=(sq, sk)) < 0.7
        mask[:2, keys] = False
        kw = {"mask": mask}
    else:
        mask = np.where(rng.uniform(size=(sq, sk)) < 0.7, 0.25, -np.inf).astype(np.float32)
        mask[-2:, keys] = -np.inf
        kw = {"mask": mask, "causal": True}
    for dtype in _dtypes(backend):
        q, k, v, do = _arrays(backend, dtype, seed=4)
        for bk, bv in [(_poison(k, keys, value, rng), v), (k, _poison(v, keys, value, rng))]:
            want = _reference(q, bk, bv, do, **kw)
            for tier in _tiers(backend):
                got = _run(backend, tier, _forward_backward, q, bk, bv, do, **kw)
                for name, g, w in zip(NAMES, got, want, strict=False):
                    _assert_like(g, w, dtype, f"{name} ({dtype.__name__}, tier {tier})")
                clean = _clean(backend, tier, _forward_backward, q, k, v, do, **kw)
                # Rows that see no poisoned key are those of the clean call.
                sees = reference._scores(
                    q.astype(np.float64),
                    k.astype(np.float64),
                    kw.get("causal", False),
                    None,
                    window=kw.get("window"),
                    mask=kw.get("mask"),
                )[1][..., keys].any(axis=-1)
                o, lse = got[0], got[1]
                np.testing.assert_array_equal(o[~sees], clean[0][~sees])
                np.testing.assert_array_equal(lse[~sees], clean[1][~sees])
                assert sees.any() and (~sees).any()


def test_plus_infinity_and_nan_scores(backend):
    """A visible NaN score (a NaN float mask entry) makes its row's o and
    lse NaN; a visible +inf one gives lse = +inf and o = NaN; other rows
    are those of the clean call. The backward from those o and lse: NaN
    gradients for the rows and the keys they see, the rest unchanged."""
    sq, sk = SHAPES[backend][3:5]
    for dtype in _dtypes(backend):
        q, k, v, do = _arrays(backend, dtype, seed=5)
        mask = np.zeros((sq, sk), np.float32)
        mask[:, sk - 5] = -np.inf
        clean_mask = mask.copy()
        mask[3, 7] = np.nan
        mask[5, 9] = np.inf
        mask[6, 2] = np.inf
        mask[6, 4] = np.nan
        kw = {"causal": True, "mask": mask}
        want = _reference(q, k, v, do, **kw)
        rows = np.zeros(sq, bool)
        rows[[3, 5, 6]] = True
        assert np.isnan(want[1][..., [3, 6]]).all() and (want[1][..., 5] == np.inf).all()
        assert np.isnan(want[0][..., rows, :]).all()
        for tier in _tiers(backend):
            got = _run(backend, tier, _forward_backward, q, k, v, do, **kw)
            for name, g, w in zip(NAMES, got, want, strict=False):
                _assert_like(g, w, dtype, f"{name} ({dtype.__name__}, tier {tier})")
            clean = _clean(
                backend,
                tier,
                _forward_backward,
                q,
                k,
                v,
                do,
                causal=True,
                mask=clean_mask,
            )
            np.testing.assert_array_equal(got[0][..., ~rows, :], clean[0][..., ~rows, :])
            np.testing.assert_array_equal(got[1][..., ~rows], clean[1][..., ~rows])
            np.testing.assert_array_equal(got[2][..., ~rows, :], clean[2][..., ~rows, :])
            # Keys the three rows see get NaN; the masked-out key and those
            # past the rows' diagonals do not.
            seen_end = sk - sq + 6 + 1
            assert np.isnan(got[3][..., :seen_end, :]).all()
            assert np.isnan(got[4][..., :seen_end, :]).all()
            assert np.isfinite(got[3][..., seen_end:, :]).all()
            assert np.isfinite(got[4][..., seen_end:, :]).all()


@pytest.mark.parametrize("value", [np.nan, np.inf], ids=["nan", "inf"])
def test_nonfinite_sinks_propagate(backend, value):
    """A NaN sink gives NaN lse and o on its head's rows, a +inf sink
    lse = +inf and o = NaN; the backward's gradients of those rows and of
    the keys they see are NaN, and so is the sink's own gradient; another
    head's rows are unchanged."""
    hq = SHAPES[backend][1]
    for dtype in _dtypes(backend):
        q, k, v, do = _arrays(backend, dtype, seed=6, heads_kv=hq)
        sinks = np.linspace(-1.0, 1.0, hq)
        clean_kw = {"causal": True, "sinks": sinks}
        sinks = sinks.copy()
        sinks[0] = value
        kw = {"causal": True, "sinks": sinks}
        want = _reference(q, k, v, do, **kw)
        for tier in _tiers(backend):
            got = _run(backend, tier, _forward_backward, q, k, v, do, **kw)
            for name, g, w in zip(NAMES, got, want, strict=False):
                _assert_like(g, w, dtype, f"{name} ({dtype.__name__}, tier {tier})")
            o, lse, dq, dk, dv_, dsinks = got
            assert np.isnan(o[:, 0]).all() and np.isnan(dq[:, 0]).all()
            assert np.isnan(dk[:, 0]).all() and np.isnan(dv_[:, 0]).all()
            assert (np.isnan(lse[:, 0]) if np.isnan(value) else lse[:, 0] == np.inf).all()
            assert np.isnan(dsinks[0]) and np.isfinite(dsinks[1:]).all()
            clean = _clean(backend, tier, _forward_backward, q, k, v, do, **clean_kw)
            for g, c in zip(got[:5], clean[:5], strict=True):
                np.testing.assert_array_equal(g[:, 1:], c[:, 1:])


@pytest.mark.parametrize("value", [np.nan, np.inf], ids=["nan", "inf"])
def test_backward_of_a_nan_or_infinite_lse_row_is_nan(backend, value):
    """attention_backward given lse = NaN or +inf for a row: that row's dq
    and the dk, dv of the keys it sees are NaN, never silently finite;
    other rows' dq are unchanged."""
    _, hq, hkv, sq, sk = SHAPES[backend][:5]
    for dtype in _dtypes(backend):
        q, k, v, do = _arrays(backend, dtype, seed=7)
        kw = {"causal": True}
        for tier in _tiers(backend):
            o, lse = _run(backend, tier, _forward, q, k, v, **kw)
            clean = _clean(backend, tier, _backward_with_lse, q, k, v, do, o, lse, None, **kw)
            dq, dk, dv_ = _run(backend, tier, _backward_with_lse, q, k, v, do, o, lse, value, **kw)
            assert np.isnan(dq[0, 1, 4]).all()
            others = np.ones(sq, bool)
            others[4] = False
            np.testing.assert_array_equal(dq[0, 1, others], clean[0][0, 1, others])
            np.testing.assert_array_equal(dq[0, 0], clean[0][0, 0])
            # Row 4 sees keys up to sk - sq + 4; head 1 reads kv head 1 // 2.
            kv = 1 // (hq // hkv)
            seen = sk - sq + 4 + 1
            assert np.isnan(dk[0, kv, :seen]).all() and np.isnan(dv_[0, kv, :seen]).all()
            np.testing.assert_array_equal(dk[0, kv, seen:], clean[1][0, kv, seen:])
            np.testing.assert_array_equal(dv_[0, kv, seen:], clean[2][0, kv, seen:])


def test_rows_that_see_no_key(backend):
    """A row that sees no key (causal with seq_q > seq_k; a float mask row
    of -inf) has o = 0 and lse = -inf, and zero gradients, whatever NaN the
    hidden keys hold."""
    sq = SHAPES[backend][3]
    sk = sq // 2
    for dtype in _dtypes(backend):
        q, k, v, do = _arrays(backend, dtype, seed=8, seq_k=sk)
        # Bottom-right causal: rows below seq_q - seq_k see nothing; row
        # seq_q - 2 is masked out entirely.
        mask = np.zeros((sq, sk), dtype)
        mask[sq - 2] = -np.inf
        k[..., sk - 1, :] = np.nan
        v[..., sk - 1, :] = np.inf
        kw = {"causal": True, "mask": mask}
        empty = np.zeros(sq, bool)
        empty[: sq - sk] = True
        empty[sq - 2] = True
        want = _reference(q, k, v, do, return_dmask=True, **kw)
        for tier in _tiers(backend):
            o, lse, dq, dk, dv_, dmask = _run(
                backend,
                tier,
                _forward_backward,
                q,
                k,
                v,
                do,
                return_dmask=True,
                **kw,
            )
            assert (o[..., empty, :] == 0).all() and (lse[..., empty] == -np.inf).all()
            assert (dq[..., empty, :] == 0).all() and (dmask[empty] == 0).all()
            names = (*NAMES[:5], "dmask")
            for name, g, w in zip(names, (o, lse, dq, dk, dv_, dmask), want, strict=True):
                _assert_like(g, w, dtype, f"{name} ({dtype.__name__}, tier {tier})")


def test_softcap_of_infinite_scores_is_finite(backend):
    """softcap: tanh(+-inf) = +-1, so a key whose q . k is infinite scores
    +-softcap, a finite score like any other."""
    b, hq, hkv, sq, sk, d, dv = SHAPES[backend]
    rng = np.random.default_rng(9)
    for dtype in _dtypes(backend):
        q = rng.uniform(0.25, 1.0, (b, hq, sq, d)).astype(dtype)
        k = rng.uniform(0.25, 1.0, (b, hkv, sk, d)).astype(dtype)
        v = _data(rng, (b, hkv, sk, dv), dtype)
        do = _data(rng, (b, hq, sq, dv), dtype)
        k[..., 3, :] = np.inf
        k[..., 5, :] = -np.inf
        kw = {"softcap": 5.0}
        want = _reference(q, k, v, do, **kw)
        assert np.isfinite(want[0]).all() and np.isfinite(want[1]).all()
        for tier in _tiers(backend):
            got = _run(backend, tier, _forward_backward, q, k, v, do, **kw)
            for name, g, w in zip(NAMES[:2], got[:2], want[:2], strict=True):
                _assert_like(g, w, dtype, f"{name} ({dtype.__name__}, tier {tier})")


def test_packed_sequences_hide_each_others_keys(backend):
    """attention_varlen: a sequence's NaN keys and values never reach the
    other sequences' rows (forward and backward); a sequence with no query
    rows hides its keys from every row."""
    _, hq, hkv, sq, sk, d, dv = SHAPES[backend]
    rng = np.random.default_rng(10)
    cu_q = np.array([0, sq // 2, sq // 2, sq], np.int32)
    cu_k = np.array([0, sk // 3, 2 * sk // 3, sk], np.int32)
    for dtype in _dtypes(backend):
        q = _data(rng, (sq, hq, d), dtype)
        k = _data(rng, (sk, hkv, d), dtype)
        v = _data(rng, (sk, hkv, dv), dtype)
        do = _data(rng, (sq, hq, dv), dtype)
        bad_k, bad_v = k.copy(), v.copy()
        # Sequence 1 has no rows; sequence 0's last key is poisoned too.
        bad_k[cu_k[1] : cu_k[2]] = np.nan
        bad_v[cu_k[1] : cu_k[2]] = np.inf
        bad_v[0, 0, 0] = np.nan
        for tier in _tiers(backend):
            clean = _clean(backend, tier, _varlen, q, k, v, do, cu_q, cu_k)
            got = _run(backend, tier, _varlen, q, bad_k, bad_v, do, cu_q, cu_k)
            want = reference.attention_varlen(
                q, bad_k, bad_v, cu_q, cu_k, causal=True, return_lse=True
            )
            for name, g, w in zip(NAMES[:2], got[:2], want, strict=True):
                _assert_like(g, w, dtype, f"{name} ({dtype.__name__}, tier {tier})")
            # Sequence 2's rows and keys are untouched.
            rows, keys = slice(cu_q[2], cu_q[3]), slice(cu_k[2], cu_k[3])
            places = [rows, (slice(None), rows), rows, keys, keys]
            for name, g, c, at in zip(NAMES, got, clean, places, strict=False):
                np.testing.assert_array_equal(g[at], c[at], err_msg=name)
            # Sequence 0's rows see its first value, NaN: their o is NaN
            # where their head reads key/value head 0.
            assert np.isnan(got[0][: cu_q[1], : hq // hkv]).all()


def test_cache_positions_past_the_length_are_hidden(backend):
    """attention_with_kvcache: NaN and infinities in the cache past each
    sequence's length change nothing; a NaN in a visible value makes the
    rows that see it NaN."""
    rng = np.random.default_rng(11)
    heads_q, heads_kv, seq_q, d, dv, capacity = 4, 2, 3, 16, 8, 40
    lens = np.array([17, 33, 5], np.int32)
    batch = len(lens)
    for dtype in _dtypes(backend):
        q = _data(rng, (batch, heads_q, seq_q, d), dtype)
        k_cache = _data(rng, (batch, heads_kv, capacity, d), dtype)
        v_cache = _data(rng, (batch, heads_kv, capacity, dv), dtype)
        bad_k, bad_v = k_cache.copy(), v_cache.copy()
        for b, n in enumerate(lens):
            bad_k[b, :, n:] = np.nan
            bad_v[b, :, n:] = np.inf
            bad_v[b, :, n + 1 :, 1] = -np.inf
        for tier in _tiers(backend):
            for splits in (1, 3):
                clean = _run(backend, tier, _kvcache, q, k_cache, v_cache, lens, splits)
                got = _run(backend, tier, _kvcache, q, bad_k, bad_v, lens, splits)
                for g, c in zip(got, clean, strict=True):
                    assert np.isfinite(g).all()
                    np.testing.assert_array_equal(g, c)
                # Key 2 of sequence 1 is seen by every row: NaN rows.
                bad_v[1, 0, 2, 3] = np.nan
                o, lse = _run(backend, tier, _kvcache, q, bad_k, bad_v, lens, splits)
                want = reference.attention_with_kvcache(q, bad_k, bad_v, lens, return_lse=True)
                _assert_like(o, want[0], dtype, "o")
                _assert_like(lse, want[1], dtype, "lse")
                assert np.isnan(o[1, :2]).all() and np.isfinite(o[1, 2:]).all()
                bad_v[1, 0, 2, 3] = v_cache[1, 0, 2, 3]


@pytest.mark.parametrize("value", [np.nan, np.inf], ids=["nan", "inf"])
def test_merging_a_nan_or_infinite_lse(backend, value):
    """merge_states follows attention's rule: a part whose lse is NaN makes
    the row's lse NaN, else one of +inf makes it +inf; o is NaN either
    way; an empty part (-inf) is not read."""
    rng = np.random.default_rng(12)
    outs = [_data(rng, (2, 3, 4), np.float32) for _ in range(3)]
    lses = [rng.uniform(-1, 1, (2, 3)).astype(np.float32) for _ in range(3)]
    lses[1][0, 1] = value
    lses[2][1, 2] = -np.inf
    outs[2][1, 2] = np.nan
    out, lse = flashport.merge_states(outs, lses, device=backend)
    assert np.isnan(out[0, 1]).all()
    assert np.isnan(lse[0, 1]) if np.isnan(value) else lse[0, 1] == np.inf
    assert np.isfinite(out[1, 2]).all() and np.isfinite(lse[1, 2])


def test_scores_that_overflow_float32_follow_the_rules(gpu):
    """Finite float32 inputs whose score overflows (q of row 5 and k of key
    60 at 3e19, key 60 hidden from every other row of either head): row 5's lse is +inf,
    its o NaN and its gradients poisoned, as the CPU computes them. The
    screen sends calls with a float32 input of 2^48 or more to the simple
    kernels: the tiled ones read a +inf score as no key."""
    q, k, v, do = _arrays("gpu", np.float32, seed=13)
    q[0, 0, 5] = 3e19
    k[0, 0, 60] = 3e19
    _, hq, _, sq, sk = SHAPES["gpu"][:5]
    mask = np.ones((hq, sq, sk), bool)
    mask[:, :, 60] = False
    mask[0, 5, 60] = True
    want = _forward_backward("cpu", q, k, v, do, mask=mask)
    assert want[1][0, 0, 5] == np.inf and np.isnan(want[0][0, 0, 5]).all()
    for tier in _tiers("gpu"):
        got = _run("gpu", tier, _forward_backward, q, k, v, do, mask=mask)
        for name, g, w in zip(NAMES, got, want, strict=False):
            _assert_like(g, w, np.float32, f"{name} (tier {tier})")


def test_finite_calls_keep_the_fast_kernels(gpu):
    """The screen sends only calls with NaN, infinities or huge values to
    the simple kernels: on finite data the default tier's results are the
    tiled kernels' (on lavapipe), which round differently from the simple
    ones', and a call with a NaN in a hidden key gives the simple kernels'
    bits."""
    q, k, v, do = _arrays("gpu", np.float32, seed=14)
    fast = _forward_backward("gpu", q, k, v, do, causal=True)
    simple = _run("gpu", "simple", _forward_backward, q, k, v, do, causal=True)
    assert any(not np.array_equal(f, s) for f, s in zip(fast, simple, strict=True))
    for f, s in zip(fast, simple, strict=True):
        _assert_like(f, s, np.float32, "fast against simple")
    bad_k = k.copy()
    bad_k[0, 0, -1] = np.nan  # the last key: hidden from every row but the last
    got = _forward_backward("gpu", q, bad_k, v, do, causal=True)
    want = _run("gpu", "simple", _forward_backward, q, bad_k, v, do, causal=True)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


def _passes(f):
    """``f()`` and the names of the GPU passes it ran."""
    _core._gpu_kernel_timing(True)
    try:
        result = f()
        names = [name for name, _ in _core._gpu_kernel_times() if not name.startswith("host:")]
    finally:
        _core._gpu_kernel_timing(False)
    return result, names


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_device_arrays_found_clean_skip_the_screen(gpu, dtype):
    """q, k and v that to_device found finite (and, in float32, below
    2^48) need no screen: the calls on them run the fast kernels alone,
    forward and backward, with the bits of the same calls on NumPy arrays
    (which are screened, their simple passes empty)."""
    q, k, v, do = _arrays("gpu", dtype, seed=16)
    on_device = [flashport.to_device(x) for x in (q, k, v)]
    (o, lse), passes = _passes(
        lambda: flashport.attention(*on_device, causal=True, return_lse=True)
    )
    (o_np, lse_np), numpy_passes = _passes(
        lambda: flashport.attention(q, k, v, causal=True, return_lse=True, device="gpu")
    )
    assert "screen" in numpy_passes and "forward" in numpy_passes, numpy_passes
    assert "screen" not in passes and "forward" not in passes, passes
    assert o.numpy().tobytes() == o_np.tobytes() and lse.numpy().tobytes() == lse_np.tobytes()
    grads, passes = _passes(
        lambda: flashport.attention_backward(
            flashport.to_device(do), *on_device, o, lse, causal=True
        )
    )
    want, numpy_passes = _passes(
        lambda: flashport.attention_backward(do, q, k, v, o_np, lse_np, causal=True, device="gpu")
    )
    assert "screen" in numpy_passes and "screen" not in passes, passes
    for name, g, w in zip(("dq", "dk", "dv"), grads, want, strict=True):
        assert g.numpy().tobytes() == w.tobytes(), name


@pytest.mark.parametrize(
    "dtype, bad", [(np.float32, np.nan), (np.float32, 2.0**48), (np.float16, -np.inf)]
)
def test_device_arrays_holding_what_the_screen_catches_follow_the_rules(gpu, dtype, bad):
    """A device array holding a NaN, an infinity or a float32 of 2^48 (in
    a key hidden from every row but the last) is screened like a NumPy
    array, and so is its copy: the results are the simple kernels'."""
    q, k, v, do = _arrays("gpu", dtype, seed=17)
    k[0, 0, -1, 0] = bad
    want = _run("gpu", "simple", _forward_backward, q, k, v, do, causal=True)
    uploaded = flashport.to_device(k)
    for k_dev in (uploaded, uploaded.copy()):
        args = [flashport.to_device(x) for x in (do, q)] + [k_dev, flashport.to_device(v)]
        (o, lse), passes = _passes(
            lambda args=args: flashport.attention(*args[1:], causal=True, return_lse=True)
        )
        assert "screen" in passes, passes
        grads = flashport.attention_backward(*args, o, lse, causal=True)
        for name, g, w in zip(NAMES[:5], (o, lse, *grads), want, strict=True):
            np.testing.assert_array_equal(g.numpy(), w, err_msg=name)


def test_uploads_over_several_copy_chunks_are_tested_whole(gpu):
    """to_device tests a large upload chunk by chunk (4 MiB each, copied
    by several threads): a NaN in its last chunk is found."""
    rng = np.random.default_rng(18)
    # 4.9 MiB, in heads: lavapipe's loop limit leaves keys past ~15k to the
    # fast kernels alone, unscreened (docs/gpu.md).
    q = _data(rng, (1, 8, 4, 64), np.float32)
    k = _data(rng, (1, 8, 2500, 64), np.float32)
    bad = k.copy()
    bad[0, -1, -1, 63] = np.nan
    for keys, screened in ((k, False), (bad, True)):
        args = [flashport.to_device(x) for x in (q, keys, keys)]
        _, passes = _passes(lambda args=args: flashport.attention(*args))
        assert ("screen" in passes) == screened, passes


def test_kernel_results_are_screened(gpu):
    """An array a kernel returned is not known clean: attention over a
    forward's o runs the screen."""
    q, k, v, _ = _arrays("gpu", np.float32, seed=19)
    o = flashport.attention(*(flashport.to_device(x) for x in (q, k, v)))
    _, passes = _passes(lambda: flashport.attention(o, o, o))
    assert "screen" in passes, passes


def test_heads_split_into_chunks_follow_the_rules(gpu):
    """With the heads split across submissions (a small binding limit: one
    kv head per chunk, each with its own screen), a NaN in a key of the
    second kv head that every one of its rows sees poisons those rows and
    only those, forward and backward, as on the CPU."""
    q, k, v, do = _arrays("gpu", np.float32, seed=15)
    q = np.concatenate([q, -q], axis=1)  # 4 query heads over 2 kv heads
    k = np.concatenate([k, k[:, :, ::-1]], axis=1)
    v = np.concatenate([v, v[:, :, ::-1]], axis=1)
    do = np.concatenate([do, do], axis=1)
    bad_k = k.copy()
    bad_k[0, 1, 0, 2] = np.nan
    want = _forward_backward("cpu", q, bad_k, v, do, causal=True)
    # One kv head (two query heads) per chunk: v of one kv head is 3456
    # bytes, of two 6912.
    with overrides(binding_limit=4096):
        got = _forward_backward("gpu", q, bad_k, v, do, causal=True)
    for name, g, w in zip(NAMES, got, want, strict=False):
        _assert_like(g, w, np.float32, name)
    assert np.isnan(got[0][0, 2:]).all() and np.isfinite(got[0][0, :2]).all()
