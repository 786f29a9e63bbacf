"""Packed batches of variable-length sequences (``attention_varlen``,
``attention_varlen_backward``) on every backend: against the float64 oracle
built from per-sequence attention, for mixed lengths (0 and 1, off the tile
grids, seq_q != seq_k per sequence, total_q != total_k), GQA, d != d_v,
causal, windows, ALiBi, softcap, sinks and dropout; rows that see no key;
every GPU tier; determinism; DeviceArrays; inputs unmodified; errors by
argument and entry."""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass

import flashport
import numpy as np
import pytest
from cases import assert_close, oracle_dtype, score_magnitude, term_magnitudes
from conftest import overrides
from flashport import (
    DTypeError,
    InvalidArgumentError,
    ProblemTooLargeError,
    ShapeError,
    _core,
    reference,
)
from hypothesis import given
from hypothesis import strategies as st

DTYPES = [np.float32, np.float64, np.float16]
# Software adapters (lavapipe) run a few GFLOP/s: the GPU gets shorter
# sequences and fewer of them.
MAX_LEN = {"cpu": 200, "gpu": 72}
MAX_BATCH = {"cpu": 8, "gpu": 5}


@dataclass(frozen=True)
class Packed:
    lens_q: tuple[int, ...]
    lens_k: tuple[int, ...]
    heads_kv: int
    group: int
    d: int
    dv: int
    causal: bool
    scale: float | None
    seed: int

    @property
    def heads_q(self) -> int:
        return self.heads_kv * self.group

    @property
    def cu_q(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.lens_q, dtype=np.int64)]).astype(np.int32)

    @property
    def cu_k(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.lens_k, dtype=np.int64)])

    def arrays(self, dtype):
        """q, k, v and an output gradient in the packed layout."""
        rng = np.random.default_rng(self.seed)
        tq, tk = sum(self.lens_q), sum(self.lens_k)
        shapes = [
            (tq, self.heads_q, self.d),
            (tk, self.heads_kv, self.d),
            (tk, self.heads_kv, self.dv),
            (tq, self.heads_q, self.dv),
        ]
        return [rng.standard_normal(s).astype(dtype) for s in shapes]


@st.composite
def packed(draw, backend: str = "cpu") -> Packed:
    max_len = MAX_LEN[backend]
    batch = draw(st.integers(0, MAX_BATCH[backend]))
    length = st.one_of(st.just(0), st.just(1), st.integers(0, max_len))
    lens_q = [draw(length) for _ in range(batch)]
    lens_k = [draw(st.one_of(st.just(lq), length)) for lq in lens_q]
    d = draw(st.one_of(st.sampled_from([8, 16, 32, 64]), st.integers(1, 72)))
    dv = draw(st.one_of(st.just(d), st.integers(1, 72)))
    return Packed(
        tuple(lens_q),
        tuple(lens_k),
        draw(st.integers(1, 2)),
        draw(st.sampled_from([1, 1, 2, 3])),
        d,
        dv,
        draw(st.booleans()),
        draw(st.one_of(st.none(), st.floats(0.05, 1.0))),
        draw(st.integers(0, 2**32 - 1)),
    )


@st.composite
def varlen_variants(draw, case: Packed, dtype) -> dict:
    """A random subset of the variant keywords attention_varlen takes."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    kw: dict = {}
    longest = max((*case.lens_q, *case.lens_k, 0)) + 2
    if draw(st.booleans()):
        side = st.one_of(st.none(), st.just(-1), st.integers(0, 6), st.integers(0, longest))
        kw["window"] = (draw(side), draw(side))
    if draw(st.booleans()):
        per_sequence = draw(st.booleans())
        shape = (len(case.lens_q), case.heads_q) if per_sequence else (case.heads_q,)
        kw["alibi_slopes"] = rng.uniform(0.0, 1.0, shape).astype(dtype)
    if draw(st.booleans()):
        kw["softcap"] = draw(st.sampled_from([1.0, 5.0, 30.0]))
    if draw(st.booleans()):
        kw["sinks"] = rng.standard_normal(case.heads_q).astype(dtype)
    if draw(st.integers(0, 3)) == 0:
        kw["dropout_p"] = draw(st.sampled_from([0.1, 0.5]))
        kw["seed"] = draw(st.integers(0, 2**64 - 1))
    return kw


@dataclass(frozen=True)
class _Sequence:
    """What cases.score_magnitude and term_magnitudes read of a case."""

    causal: bool
    scale: float | None


def _magnitudes(case: Packed, arrays, kw) -> tuple[float, dict[str, float]]:
    """The largest score and, per result, the largest sum of term
    magnitudes over the sequences (see cases.term_magnitudes). Dropout is
    left out and its largest factor, 1 / (1 - p), applied to all terms: an
    upper bound, whatever the mask."""
    q, k, v, do = (np.asarray(x, np.float64) for x in arrays)
    plain = {n: kw[n] for n in ("window", "softcap", "sinks") if n in kw}
    seq = _Sequence(case.causal, case.scale)
    scores, terms = 0.0, {}
    cu_q, cu_k = case.cu_q, case.cu_k
    for b in range(len(case.lens_q)):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if rows.start == rows.stop or keys.start == keys.stop:
            continue
        one = dict(plain)
        if "alibi_slopes" in kw:
            slopes = np.asarray(kw["alibi_slopes"])
            one["alibi_slopes"] = slopes[b] if slopes.ndim == 2 else slopes
        qb, kb, vb, dob = (x.transpose(1, 0, 2) for x in (q[rows], k[keys], v[keys], do[rows]))
        scores = max(scores, score_magnitude(seq, qb, kb, **one))
        for name, value in term_magnitudes(seq, dob, qb, kb, vb, **one).items():
            # dsinks sums over every sequence's rows; the others are
            # per-row or per-key results of one sequence.
            before = terms.get(name, 0.0)
            terms[name] = before + value if name == "dsinks" else max(before, value)
    boost = 1.0 / (1.0 - kw.get("dropout_p", 0.0))
    return scores, {name: value * boost for name, value in terms.items()}


def _reference(case: Packed, arrays, dtype, precision, kw):
    q, k, v, do = arrays
    cu = (case.cu_q, case.cu_k)
    out, lse = reference._attention_varlen(q, k, v, *cu, case.causal, case.scale, precision, **kw)
    grads = reference._attention_varlen_backward(
        do, q, k, v, *cu, case.causal, case.scale, precision, **kw
    )
    return out, lse, grads


def check_varlen(case: Packed, kw: dict, dtype, backend: str) -> None:
    """Forward (o, lse) and backward (dq, dk, dv, dsinks) of ``case``
    against the oracle, with cases.assert_close's rule; inputs unmodified."""
    arrays = case.arrays(dtype)
    q, k, v, do = arrays
    before = copy.deepcopy([arrays, kw, case.cu_q, case.cu_k])
    common = {"causal": case.causal, "scale": case.scale, "device": backend, **kw}
    cu = (case.cu_q, case.cu_k)
    out, lse = flashport.attention_varlen(q, k, v, *cu, return_lse=True, **common)
    assert out.dtype == dtype and out.shape == (q.shape[0], case.heads_q, case.dv)
    assert lse.dtype == (np.float64 if dtype == np.float64 else np.float32)
    assert lse.shape == (case.heads_q, q.shape[0])
    grads = flashport.attention_varlen_backward(do, q, k, v, out, lse, *cu, **common)
    want_out, want_lse, want = _reference(case, arrays, dtype, oracle_dtype(dtype), kw)
    base_out, base_lse, base = _reference(case, arrays, dtype, dtype, kw)
    scores, terms = _magnitudes(case, arrays, kw)
    assert_close("o", out, want_out, base_out, dtype, scores, terms.get("o", 0.0))
    assert_close("lse", lse, want_lse, base_lse, dtype, scores, terms.get("lse", 0.0))
    names, like = ["dq", "dk", "dv"], [q, k, v]
    if "sinks" in kw:
        names.append("dsinks")
        like.append(kw["sinks"])
    assert len(grads) == len(names)
    for name, g, w, b, x in zip(names, grads, want, base, like, strict=True):
        assert g.shape == x.shape and g.dtype == x.dtype, (name, g.shape, g.dtype, x.dtype)
        assert_close(name, g, w, b, dtype, scores, terms.get(name, 0.0))
    after = [arrays, kw, case.cu_q, case.cu_k]
    for b, a in zip(_leaves(before), _leaves(after), strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True), "input modified"


def _leaves(x):
    if isinstance(x, np.ndarray):
        return [x]
    if isinstance(x, dict):
        return [leaf for value in x.values() for leaf in _leaves(value)]
    if isinstance(x, list | tuple):
        return [leaf for item in x for leaf in _leaves(item)]
    return []


def _dtype_for(backend, dtype):
    return np.float32 if backend == "gpu" and dtype == np.float64 else dtype


@given(data=st.data(), dtype=st.sampled_from(DTYPES))
def test_varlen_matches_per_sequence_attention(backend, data, dtype):
    dtype = _dtype_for(backend, dtype)
    case = data.draw(packed(backend), label="case")
    kw = data.draw(varlen_variants(case, dtype), label="variants")
    check_varlen(case, kw, dtype, backend)


@pytest.mark.parametrize("tier", ["simple", "tiled"])
@given(data=st.data(), dtype=st.sampled_from([np.float32, np.float16]))
def test_every_gpu_tier(gpu, tier, data, dtype):
    """The register-tiled kernels take d and d_v that are multiples of 4
    (the simple ones everything); the cooperative ones need an adapter with
    cooperative matrices (not lavapipe)."""
    case = data.draw(packed("gpu"), label="case")
    case = Packed(**{**case.__dict__, "d": 4 * (case.d % 16 + 1), "dv": 4 * (case.dv % 16 + 1)})
    kw = data.draw(varlen_variants(case, dtype), label="variants")
    with overrides(max_tier=tier):
        check_varlen(case, kw, dtype, gpu)


def test_rows_that_see_no_key(backend):
    """Empty key sequences, and causal rows of a sequence with more queries
    than keys: o = 0 and lse = -inf (or the sink), dq = 0; empty query
    sequences own no row."""
    case = Packed((3, 0, 4, 2), (0, 5, 2, 3), 1, 2, 16, 8, True, None, 5)
    q, k, v, do = case.arrays(np.float32)
    cu = (case.cu_q, case.cu_k)
    out, lse = flashport.attention_varlen(
        q, k, v, *cu, causal=True, return_lse=True, device=backend
    )
    blind = [0, 1, 2, 3, 4]  # sequence 0 (no keys), rows 0-1 of sequence 2
    assert np.all(out[blind] == 0) and np.all(lse[:, blind] == -np.inf)
    assert np.all(np.isfinite(lse[:, 5:]))
    dq, _, _ = flashport.attention_varlen_backward(
        do, q, k, v, out, lse, *cu, causal=True, device=backend
    )
    assert np.all(dq[blind] == 0)
    sinks = np.array([0.5, -1.0], np.float32)
    out, lse = flashport.attention_varlen(
        q, k, v, *cu, causal=True, sinks=sinks, return_lse=True, device=backend
    )
    assert np.all(out[blind] == 0) and np.array_equal(
        lse[:, blind], np.repeat(sinks[:, None], 5, 1)
    )
    check_varlen(case, {}, np.float32, backend)
    check_varlen(case, {"sinks": sinks, "window": (1, 0)}, np.float32, backend)


def test_lengths_across_tile_boundaries(backend):
    """Many sequences whose boundaries fall inside every kernel's tiles, one
    of them long enough for several tiles, with causal ALiBi per sequence."""
    lens_q = (1, 17, 63, 2, 65, 30) if backend == "gpu" else (1, 17, 63, 2, 130, 200)
    lens_k = (33, 1, 64, 66, 3, 31) if backend == "gpu" else (33, 1, 64, 66, 300, 5)
    case = Packed(lens_q, lens_k, 2, 2, 32, 32, True, None, 9)
    slopes = np.random.default_rng(1).uniform(0, 1, (6, 4)).astype(np.float32)
    check_varlen(case, {"alibi_slopes": slopes}, np.float32, backend)
    check_varlen(case, {"window": (5, 2)}, np.float16, backend)


def _run(case: Packed, backend, **kw):
    q, k, v, do = case.arrays(np.float32)
    cu = (case.cu_q, case.cu_k)
    out, lse = flashport.attention_varlen(
        q, k, v, *cu, causal=case.causal, return_lse=True, device=backend, **kw
    )
    grads = flashport.attention_varlen_backward(
        do, q, k, v, out, lse, *cu, causal=case.causal, device=backend, **kw
    )
    return [out, lse, *grads]


DETERMINISM = Packed((37, 0, 90, 5), (50, 4, 71, 5), 2, 2, 40, 24, True, None, 3)


def test_two_runs_are_bitwise_equal(backend):
    kw = {"dropout_p": 0.2, "seed": 11}
    first, second = _run(DETERMINISM, backend, **kw), _run(DETERMINISM, backend, **kw)
    for a, b in zip(first, second, strict=True):
        assert a.tobytes() == b.tobytes()


def test_thread_count_does_not_change_bits(monkeypatch):
    results = []
    for threads in ("1", "2", "5"):
        monkeypatch.setenv("FLASHPORT_NUM_THREADS", threads)
        results.append(_run(DETERMINISM, "cpu"))
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_device_arrays_stay_on_the_gpu_with_the_same_bits(gpu, dtype):
    """DeviceArrays in give DeviceArrays out, bit for bit the results of
    NumPy inputs (the layout moves run on the GPU; odd sizes put float16
    elements across word boundaries)."""
    case = Packed((5, 0, 9), (7, 3, 11), 1, 3, 7, 5, True, None, 13)
    arrays = case.arrays(dtype)
    q, k, v, do = arrays
    cu = (case.cu_q, case.cu_k)
    out, lse = flashport.attention_varlen(q, k, v, *cu, causal=True, return_lse=True, device=gpu)
    grads = flashport.attention_varlen_backward(do, q, k, v, out, lse, *cu, causal=True, device=gpu)
    dq_, dk_, dv_, do_ = (flashport.to_device(x) for x in (q, k, v, do))
    out_d, lse_d = flashport.attention_varlen(dq_, dk_, dv_, *cu, causal=True, return_lse=True)
    assert isinstance(out_d, flashport.DeviceArray) and isinstance(lse_d, flashport.DeviceArray)
    assert out_d.shape == out.shape and lse_d.shape == lse.shape and out_d.dtype == dtype
    grads_d = flashport.attention_varlen_backward(
        do_, dq_, dk_, dv_, out_d, lse_d, *cu, causal=True
    )
    for host, device in zip([out, lse, *grads], [out_d, lse_d, *grads_d], strict=True):
        assert isinstance(device, flashport.DeviceArray)
        assert device.shape == host.shape
        assert device.numpy().tobytes() == host.tobytes()
    with pytest.raises(InvalidArgumentError, match="q is a device array"):
        flashport.attention_varlen(dq_, dk_, dv_, *cu, device="cpu")


def _submissions() -> int:
    """The submissions the last GPU call waited for: one per chunk of heads."""
    return sum(name == "host:wait" for name, _ in _core._gpu_kernel_times())


CHUNKED = Packed((9, 0, 30, 4), (12, 6, 25, 0), 2, 2, 8, 12, True, None, 23)
# Bindings that hold one key/value head's group (o of 2 query heads: 4128
# bytes) but not all the heads.
CHUNK_LIMIT = 4200


def test_heads_in_chunks_on_the_gpu(gpu):
    """Bindings smaller than the arrays: NumPy inputs run in chunks of heads,
    each chunk with the whole row table, and match the oracle; device arrays,
    which move to the kernels' layout whole, are refused by name."""
    kw = {"sinks": np.array([0.3, -0.2, 1.0, 0.0], np.float32), "window": (6, 0)}
    q, k, v, _ = CHUNKED.arrays(np.float32)
    cu = (CHUNKED.cu_q, CHUNKED.cu_k)
    with overrides(binding_limit=CHUNK_LIMIT):
        flashport.attention_varlen(q, k, v, *cu, causal=True, device=gpu)
        assert _submissions() == 2
        check_varlen(CHUNKED, kw, np.float32, gpu)
        assert _submissions() == 2
        on_device = [flashport.to_device(x) for x in (q, k, v)]
        with pytest.raises(ProblemTooLargeError, match=r"q \(5504 bytes\) is larger than one"):
            flashport.attention_varlen(*on_device, *cu, causal=True)


def test_dropout_draws_at_the_packed_positions(backend):
    """The keep mask of sequence b is the packed one's block (rows
    cu_q[b]:, keys cu_k[b]:), not the sequence's own."""
    case = Packed((6, 9), (11, 4), 1, 2, 16, 16, False, None, 17)
    q, k, v, _ = case.arrays(np.float32)
    cu = (case.cu_q, case.cu_k)
    # A value per key: each output is the kept keys' values, summed.
    v = np.zeros_like(v)
    v[np.arange(v.shape[0]), :, np.arange(v.shape[0]) % v.shape[2]] = 1.0
    kw = {"dropout_p": 0.5, "seed": 99, "scale": 0.0, "device": backend}
    out = flashport.attention_varlen(q, k, v, *cu, **kw)
    keep = reference.dropout_keep(99, 0.5, (1, case.heads_q, 15, 15))[0]
    for b in range(2):
        rows, keys = slice(cu[0][b], cu[0][b + 1]), slice(cu[1][b], cu[1][b + 1])
        n = keys.stop - keys.start
        want = keep[:, rows, keys] * (2.0 / n)  # P = 1/n, Z = 2 where kept
        got = np.stack([out[rows, :, j % v.shape[2]] for j in range(keys.start, keys.stop)], -1)
        np.testing.assert_allclose(got.transpose(1, 0, 2), want, rtol=1e-5, atol=1e-6)


# Errors: each names the argument (and the entry of a prefix sum).

Q = np.zeros((10, 4, 8), np.float32)
KV = np.zeros((12, 2, 8), np.float32)
CU_Q = np.array([0, 4, 10], np.int32)
CU_K = np.array([0, 7, 12], np.int64)


@pytest.mark.parametrize(
    ("cu_q", "cu_k", "error", "message"),
    [
        (
            [0, 12, 10],
            CU_K,
            InvalidArgumentError,
            r"cu_seqlens_q\[2\] = 10 < cu_seqlens_q\[1\] = 12",
        ),
        (
            CU_Q,
            [0, 7, 5, 12],
            InvalidArgumentError,
            r"cu_seqlens_k\[2\] = 5 < cu_seqlens_k\[1\] = 7",
        ),
        ([2, 4, 10], CU_K, InvalidArgumentError, r"cu_seqlens_q\[0\] = 2"),
        (CU_Q, [0, 7, 13], ShapeError, r"cu_seqlens_k\[2\] = 13 but k holds 12 packed rows"),
        ([0, 4, 9], CU_K, ShapeError, r"cu_seqlens_q\[2\] = 9 but q holds 10"),
        (
            [0, 10],
            CU_K,
            ShapeError,
            r"cu_seqlens_q has 2 entries \(batch 1\) but cu_seqlens_k has 3",
        ),
        (np.array([0.0, 4.0, 10.0]), CU_K, DTypeError, "cu_seqlens_q has dtype float64"),
        (CU_Q, np.array([False, True]), DTypeError, "cu_seqlens_k has dtype bool"),
        (CU_Q.reshape(1, 3), CU_K, ShapeError, r"cu_seqlens_q has shape \(1, 3\)"),
        (np.array([], np.int32), CU_K, ShapeError, r"cu_seqlens_q has shape \(0,\)"),
    ],
)
def test_prefix_sums_are_checked_by_entry(backend, cu_q, cu_k, error, message):
    with pytest.raises(error, match=message):
        flashport.attention_varlen(Q, KV, KV, cu_q, cu_k, device=backend)
    out = np.zeros((10, 4, 8), np.float32)
    lse = np.zeros((4, 10), np.float32)
    with pytest.raises(error, match=message):
        flashport.attention_varlen_backward(out, Q, KV, KV, out, lse, cu_q, cu_k, device=backend)


def test_arrays_are_checked_by_name(backend):
    call = flashport.attention_varlen
    with pytest.raises(ShapeError, match=r"q has shape \(1, 10, 4, 8\)"):
        call(Q[None], KV, KV, CU_Q, CU_K, device=backend)
    with pytest.raises(ShapeError, match=r"must divide .* q \(10, 4, 8\), k \(12, 3, 8\)"):
        call(Q, KV[:, :1].repeat(3, 1), KV[:, :1].repeat(3, 1), CU_Q, CU_K, device=backend)
    with pytest.raises(ShapeError, match="k and v must hold the same packed keys"):
        call(Q, KV, KV[:11], CU_Q, CU_K, device=backend)
    with pytest.raises(DTypeError, match="k has dtype float64"):
        call(Q, KV.astype(np.float64), KV, CU_Q, CU_K, device=backend)
    with pytest.raises(ShapeError, match=r"alibi_slopes has shape \(3, 4\).*\(2, 4\)"):
        call(Q, KV, KV, CU_Q, CU_K, alibi_slopes=np.ones((3, 4)), device=backend)
    with pytest.raises(InvalidArgumentError, match="window"):
        call(Q, KV, KV, CU_Q, CU_K, window=(-3, 0), device=backend)
    with pytest.raises(InvalidArgumentError, match=r"cu_seqlens_q is a flashport\.DeviceArray"):
        call(Q, KV, KV, flashport.DeviceArray.__new__(flashport.DeviceArray), CU_K)
    out = np.zeros((10, 4, 8), np.float32)
    back = flashport.attention_varlen_backward
    with pytest.raises(ShapeError, match=r"lse has shape \(10, 4\).*\(4, 10\)"):
        back(out, Q, KV, KV, out, np.zeros((10, 4), np.float32), CU_Q, CU_K, device=backend)
    with pytest.raises(ShapeError, match=r"do has shape \(4, 10, 8\)"):
        back(out.transpose(1, 0, 2), Q, KV, KV, out, np.zeros((4, 10), np.float32), CU_Q, CU_K)
    with pytest.raises(DTypeError, match="lse has dtype float16"):
        back(out, Q, KV, KV, out, np.zeros((4, 10), np.float16), CU_Q, CU_K, device=backend)


def test_float64_is_refused_on_the_gpu(gpu):
    with pytest.raises(DTypeError, match="float64"):
        flashport.attention_varlen(
            Q.astype(np.float64),
            KV.astype(np.float64),
            KV.astype(np.float64),
            CU_Q,
            CU_K,
            device=gpu,
        )


def test_lists_and_any_integer_dtype_are_prefix_sums(backend):
    """Lists, tuples and every integer dtype are read as the same prefix
    sums: the bits of the int32 and int64 arrays (checked against the
    oracle), for sequences that a misread entry would move."""
    case = Packed((4, 0, 6), (7, 3, 2), 2, 2, 8, 8, True, None, 21)
    check_varlen(case, {}, np.float32, backend)
    q, k, v, _ = case.arrays(np.float32)
    want = flashport.attention_varlen(q, k, v, case.cu_q, case.cu_k, causal=True, device=backend)
    for cu_q, cu_k in itertools.product(
        [[int(x) for x in case.cu_q], case.cu_q.astype(np.uint8), case.cu_q.astype(np.int16)],
        [tuple(int(x) for x in case.cu_k), case.cu_k.astype(np.uint64), case.cu_k.astype(np.int8)],
    ):
        got = flashport.attention_varlen(q, k, v, cu_q, cu_k, causal=True, device=backend)
        assert got.tobytes() == want.tobytes(), (cu_q, cu_k)
