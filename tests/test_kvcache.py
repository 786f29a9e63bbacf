"""attention_with_kvcache on every backend: contiguous caches against the
float64 oracle (whole attention over each sequence's gathered keys), paged
caches bit for bit equal to the contiguous cache they hold (any block
size, permuted tables, blocks shared between sequences, NaN wherever
nothing may be read); seq_q 1 and more, GQA, d != d_v, empty sequences,
lengths off the block grid, the variants; explicit key splits from 1 to
more than the blocks; bitwise reproducibility across runs and CPU thread
counts; inputs never modified; DeviceArrays and dispatches cut to small
bindings on the GPU; every error naming its argument and entry."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import flashport
import numpy as np
import pytest
from cases import assert_close
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

MAX_LEN = {"cpu": 200, "gpu": 48}
DIMS = {
    "cpu": st.one_of(st.sampled_from([16, 64, 128]), st.integers(1, 80)),
    "gpu": st.one_of(st.sampled_from([8, 16, 32]), st.integers(1, 20)),
}
DTYPES = {"cpu": [np.float32, np.float64, np.float16], "gpu": [np.float32, np.float16]}


@dataclass(frozen=True)
class KvCase:
    """A batch of cached sequences, its queries and how they are stored."""

    heads_kv: int
    group: int
    seq_q: int
    d: int
    dv: int
    block_size: int
    lens: tuple[int, ...]
    # Sequence b > 0 starts with this many of sequence 0's blocks.
    shared: int
    causal: bool
    scale: float | None
    seed: int

    @property
    def batch(self) -> int:
        return len(self.lens)

    @property
    def heads_q(self) -> int:
        return self.heads_kv * self.group

    def blocks_per_seq(self) -> int:
        return max(1, max(-(-n // self.block_size) for n in self.lens))

    def arrays(self, dtype):
        """q, the paged cache (pool, table) and the contiguous cache holding
        the same sequences. Everything no call may read is NaN (unused
        blocks, cache rows past each length), and table entries past a
        length are -1 or out of range."""
        rng = np.random.default_rng(self.seed)
        bs, per_seq, batch = self.block_size, self.blocks_per_seq(), self.batch
        q = rng.standard_normal((batch, self.heads_q, self.seq_q, self.d)).astype(dtype)
        # Blocks in a random order; a few spare ones are never used.
        order = rng.permutation(batch * per_seq + 3)
        table = order[: batch * per_seq].reshape(batch, per_seq).copy()
        table[1:, : self.shared] = table[0, : self.shared]
        num_blocks = len(order)
        pool_k = np.full((num_blocks, self.heads_kv, bs, self.d), np.nan, dtype)
        pool_v = np.full((num_blocks, self.heads_kv, bs, self.dv), np.nan, dtype)
        for b, n in enumerate(self.lens):
            for i in range(-(-n // bs)):
                x = table[b, i]
                rows = min(bs, n - i * bs)
                if np.isnan(pool_k[x, :, :rows]).any():
                    pool_k[x, :, :rows] = rng.standard_normal((self.heads_kv, rows, self.d))
                    pool_v[x, :, :rows] = rng.standard_normal((self.heads_kv, rows, self.dv))
            for i in range(-(-n // bs), per_seq):
                table[b, i] = rng.choice([-1, num_blocks, 10**9])
        capacity = per_seq * bs
        k = np.full((batch, self.heads_kv, capacity, self.d), np.nan, dtype)
        v = np.full((batch, self.heads_kv, capacity, self.dv), np.nan, dtype)
        for b, n in enumerate(self.lens):
            kb, vb = reference.cached_sequence(pool_k, pool_v, self.lens, b, table)
            k[b, :, :n], v[b, :, :n] = kb, vb
        lens = np.array(self.lens, dtype=rng.choice([np.int32, np.int64]))
        return q, (pool_k, pool_v, table.astype(np.int32)), (k, v), lens


@st.composite
def kv_cases(draw, backend: str) -> KvCase:
    batch = draw(st.integers(1, 3))
    block_size = draw(st.sampled_from([1, 2, 3, 5, 16, 32]))
    length = st.one_of(st.just(0), st.integers(1, MAX_LEN[backend]))
    lens = tuple(draw(length) for _ in range(batch))
    d = draw(DIMS[backend])
    dv = draw(st.one_of(st.just(d), DIMS[backend]))
    first_blocks = -(-lens[0] // block_size)
    shared = draw(st.integers(0, first_blocks)) if batch > 1 else 0
    # A sequence that shares blocks holds at least their keys.
    lens = (lens[0], *(max(n, min(shared * block_size, lens[0])) for n in lens[1:]))
    return KvCase(
        heads_kv=draw(st.integers(1, 2)),
        group=draw(st.sampled_from([1, 2, 4])),
        seq_q=draw(st.sampled_from([1, 1, 2, 3, 5])),
        d=d,
        dv=dv,
        block_size=block_size,
        lens=lens,
        shared=shared,
        causal=draw(st.booleans()),
        scale=draw(st.one_of(st.none(), st.floats(0.05, 2.0))),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


@st.composite
def kv_variants(draw, case: KvCase) -> dict:
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    kw: dict = {}
    if draw(st.booleans()):
        side = st.one_of(st.none(), st.just(-1), st.integers(0, 8), st.integers(0, 60))
        kw["window"] = (draw(side), draw(side))
    if draw(st.booleans()):
        shape = draw(st.sampled_from([(case.heads_q,), (case.batch, case.heads_q)]))
        kw["alibi_slopes"] = rng.uniform(0.0, 1.0, shape)
    if draw(st.booleans()):
        kw["softcap"] = draw(st.sampled_from([1.0, 30.0]))
    if draw(st.booleans()):
        kw["sinks"] = rng.standard_normal(case.heads_q) * 2.0
    return kw


def oracle_dtype(dtype):
    return np.longdouble if dtype == np.float64 else np.float64


def _magnitudes(case: KvCase, q, contiguous, lens, kw) -> tuple[float, float, float]:
    """The largest |score| a row sees, the largest Σ_j P_ij |v_j| and the
    largest scale · Σ_i |q_i k_i| of a score a row sees (what assert_close
    scales its floor with: the terms summed into o, and into each score,
    which the lse inherits; a score of small size summed from large terms
    is rounded relative to the terms), over every sequence. With softcap
    the cap counts as a score: t = cap · tanh(u / cap) is rounded relative
    to the cap (a GPU's tanh through exp is off by an ulp of 1, times the
    cap), however small u is."""
    k, v = contiguous
    scores, terms, score_terms = 0.0, 0.0, 0.0
    scale = case.scale if case.scale is not None else 1.0 / np.sqrt(q.shape[-1])
    for b, n in enumerate(lens):
        q4 = np.asarray(q[b : b + 1], np.float64)
        k4 = np.asarray(k[b : b + 1, :, :n], np.float64)
        v4 = np.asarray(v[b : b + 1, :, :n], np.float64)
        slopes = kw.get("alibi_slopes")
        if slopes is not None and np.ndim(slopes) == 2:
            slopes = slopes[b]
        s, visible, group, _, (u, _) = reference._scores(
            q4,
            k4,
            case.causal,
            case.scale,
            window=kw.get("window"),
            alibi_slopes=slopes,
            softcap=kw.get("softcap"),
            q_offset=int(n) - case.seq_q,
            k_offset=0,
        )
        if visible.any():
            scores = max(scores, float(np.abs(s[visible]).max()), float(np.abs(u[visible]).max()))
            k_abs = np.abs(np.repeat(k4, group, axis=1)).swapaxes(-1, -2)
            summed = abs(scale) * (np.abs(q4) @ k_abs)
            score_terms = max(score_terms, float(summed[visible].max()))
        p, _ = reference._probabilities(s, visible, kw.get("sinks"))
        if p.size:
            terms = max(terms, float((p @ np.abs(np.repeat(v4, group, axis=1))).max()))
    return max(scores, kw.get("softcap") or 0.0), terms, score_terms


def _check(case: KvCase, backend, dtype, kw, num_splits=None):
    """The contiguous cache against the oracle, the paged one bit for bit
    against the contiguous one; inputs unmodified."""
    q, (pool_k, pool_v, table), (k, v), lens = case.arrays(dtype)
    before = copy.deepcopy([q, pool_k, pool_v, table, k, v, lens, kw])
    common = {"causal": case.causal, "scale": case.scale, "device": backend, **kw}
    out, lse = flashport.attention_with_kvcache(
        q, k, v, lens, num_splits=num_splits, return_lse=True, **common
    )
    assert out.dtype == dtype and out.shape == (case.batch, case.heads_q, case.seq_q, case.dv)
    assert lse.dtype == (np.float64 if dtype == np.float64 else np.float32)
    assert lse.shape == (case.batch, case.heads_q, case.seq_q)
    args = (q, k, v, lens, None, case.causal, case.scale, True)
    want_out, want_lse = reference._attention_with_kvcache(*args, oracle_dtype(dtype), **kw)
    base_out, base_lse = reference._attention_with_kvcache(*args, dtype, **kw)
    scores, terms, score_terms = _magnitudes(case, q, (k, v), lens, kw)
    assert_close("o", out, want_out, base_out, dtype, scores, terms)
    assert_close("lse", lse, want_lse, base_lse, dtype, scores, max(scores, score_terms))
    paged_out, paged_lse = flashport.attention_with_kvcache(
        q, pool_k, pool_v, lens, block_table=table, num_splits=num_splits, return_lse=True, **common
    )
    assert paged_out.tobytes() == out.tobytes(), "paged and contiguous outputs differ"
    assert paged_lse.tobytes() == lse.tobytes(), "paged and contiguous lse differ"
    after = [q, pool_k, pool_v, table, k, v, lens, kw]
    for b, a in zip(before, after, strict=True):
        if isinstance(b, dict):
            assert all(np.array_equal(b[n], a[n]) for n in b), "variant modified"
        else:
            assert a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True), "input modified"
    return out, lse


@given(data=st.data())
def test_paged_and_contiguous_caches_against_the_oracle(backend, data):
    case = data.draw(kv_cases(backend), label="case")
    dtype = data.draw(st.sampled_from(DTYPES[backend]), label="dtype")
    kw = data.draw(kv_variants(case), label="variants")
    splits = data.draw(st.sampled_from([None, None, 1, 2, 3, 40]), label="num_splits")
    _check(case, backend, dtype, kw, splits)


def _decode_case(**changes) -> KvCase:
    base = {
        "heads_kv": 2,
        "group": 4,
        "seq_q": 1,
        "d": 32,
        "dv": 24,
        "block_size": 5,
        "lens": (37, 0, 48),
        "shared": 2,
        "causal": True,
        "scale": None,
        "seed": 7,
    }
    return KvCase(**{**base, **changes})


@pytest.mark.parametrize("splits", [1, 2, 3, 7, 10, 64])
def test_every_split_count_gives_the_attention(backend, splits):
    """From one split to more than the blocks (empty splits)."""
    _check(_decode_case(seq_q=3), backend, np.float32, {"sinks": np.arange(8.0) - 4}, splits)


def test_empty_sequences_give_zero_and_minus_infinity(backend):
    case = _decode_case(lens=(0, 0), seq_q=2)
    q, (pool_k, pool_v, table), _, lens = case.arrays(np.float32)
    out, lse = flashport.attention_with_kvcache(
        q, pool_k, pool_v, lens, block_table=table, return_lse=True, device=backend
    )
    assert np.array_equal(out, np.zeros_like(out)) and not np.signbit(out).any()
    assert np.all(lse == -np.inf)
    sinks = np.linspace(-1.0, 1.0, case.heads_q)
    out, lse = flashport.attention_with_kvcache(
        q, pool_k, pool_v, lens, block_table=table, sinks=sinks, return_lse=True, device=backend
    )
    assert np.array_equal(out, np.zeros_like(out))
    np.testing.assert_allclose(lse, np.broadcast_to(sinks[None, :, None], lse.shape), rtol=1e-6)


def test_queries_before_the_first_key_see_nothing(backend):
    """seq_q > length with causal: the first rows sit before key 0."""
    case = _decode_case(seq_q=5, lens=(2, 3, 48))
    out, lse = _check(case, backend, np.float32, {})
    assert np.all(lse[0, :, :3] == -np.inf) and np.all(out[0, :, :3] == 0)
    assert np.isfinite(lse[0, :, 3:]).all()


def _run(backend, splits, dtype=np.float32):
    case = _decode_case(seq_q=2, lens=(40, 13, 29), d=40, dv=16)
    q, (pool_k, pool_v, table), _, lens = case.arrays(dtype)
    kw = {"window": (20, None), "softcap": 30.0, "alibi_slopes": np.linspace(0.1, 1.0, 8)}
    return flashport.attention_with_kvcache(
        q,
        pool_k,
        pool_v,
        lens,
        block_table=table,
        num_splits=splits,
        return_lse=True,
        device=backend,
        **kw,
    )


INT_DTYPES = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", ">i4"]


@pytest.mark.parametrize("layout", ["C", "F", "strided"])
@pytest.mark.parametrize("int_dtype", INT_DTYPES)
def test_lengths_and_tables_of_any_integer_dtype_and_layout(backend, int_dtype, layout):
    """The host reads the entries of every integer dtype (big-endian too)
    and of Fortran-ordered and strided arrays as the same numbers."""
    case = _decode_case(lens=(37, 0, 48), block_size=5)
    q, (pool_k, pool_v, table), _, lens = case.arrays(np.float32)
    expected = flashport.attention_with_kvcache(
        q, pool_k, pool_v, lens.astype(np.int32), block_table=table.astype(np.int32), device=backend
    )
    table, lens = table.astype(int_dtype), lens.astype(int_dtype)
    if layout == "F":
        table = np.asfortranarray(table)
    elif layout == "strided":
        wide = np.zeros((table.shape[0], 2 * table.shape[1]), table.dtype)
        wide[:, ::2] = table
        table = wide[:, ::2]
        lens = np.repeat(lens, 2)[::2]
    assert (layout == "C") == table.flags.c_contiguous
    out = flashport.attention_with_kvcache(
        q, pool_k, pool_v, lens, block_table=table, device=backend
    )
    assert out.tobytes() == expected.tobytes()


@pytest.mark.parametrize("splits", [None, 1, 4])
def test_two_runs_are_bitwise_equal(backend, splits):
    first, second = _run(backend, splits), _run(backend, splits)
    for a, b in zip(first, second, strict=True):
        assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_thread_count_does_not_change_bits(monkeypatch, splits, dtype):
    results = []
    for threads in ("1", "2", "3", "8"):
        monkeypatch.setenv("FLASHPORT_NUM_THREADS", threads)
        results.append(_run("cpu", splits, dtype))
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("dv", [24, 7])
def test_device_arrays_stay_on_the_gpu_with_the_same_bits(gpu, paged, dtype, dv):
    """Float16 outputs kept on the device are rounded by the combine pass
    where d_v is even, by a pass after it where it is odd: the bits of the
    NumPy path (rounded on the host) either way."""
    case = _decode_case(seq_q=2, dv=dv)
    q, (pool_k, pool_v, table), (k, v), lens = case.arrays(dtype)
    caches, kw = ((pool_k, pool_v), {"block_table": table}) if paged else ((k, v), {})
    want = flashport.attention_with_kvcache(q, *caches, lens, return_lse=True, device=gpu, **kw)
    arrays = [flashport.to_device(x) for x in (q, *caches)]
    _core._gpu_kernel_timing(True)
    try:
        got = flashport.attention_with_kvcache(*arrays, lens, return_lse=True, **kw)
        passes = [name for name, _ in _core._gpu_kernel_times() if not name.startswith("host:")]
    finally:
        _core._gpu_kernel_timing(False)
    rounded_apart = dtype == np.float16 and dv % 2 == 1
    assert ("to_f16" in passes) == rounded_apart, passes
    assert all(isinstance(x, flashport.DeviceArray) for x in got)
    for g, w in zip(got, want, strict=True):
        assert g.numpy().tobytes() == w.tobytes()
    # Host queries with device caches decode on the GPU too.
    mixed = flashport.attention_with_kvcache(q, *arrays[1:], lens, return_lse=True, **kw)
    for g, w in zip(mixed, want, strict=True):
        assert np.asarray(g).tobytes() == w.tobytes()
    for a, b in zip(arrays, (q, *caches), strict=True):
        assert np.array_equal(a.numpy(), b, equal_nan=True), "input modified"
    with pytest.raises(InvalidArgumentError, match="k_cache is a device array"):
        flashport.attention_with_kvcache(q, arrays[1], caches[1], lens, device="cpu", **kw)


def test_long_sequences_stay_within_the_drivers_loop_limit(gpu):
    """Mesa's lavapipe before 25.0 (CI's driver) silently ends a shader's
    loops after 65535 passes (src/gpu/tiles/loops.rs): by default the keys
    are split so that no workgroup walks more, and an explicit split count
    that would is refused, never computed wrong. Elsewhere both are right."""
    case = _decode_case(heads_kv=8, group=1, d=16, dv=16, block_size=512, lens=(40000,), shared=0)
    _check(case, gpu, np.float32, {})
    try:
        _check(case, gpu, np.float32, {}, num_splits=1)
    except ProblemTooLargeError as e:
        assert "llvmpipe" in str(e) and "num_splits=2 or more" in str(e), str(e)


@pytest.mark.parametrize("paged", [False, True])
def test_caches_larger_than_a_binding_are_decoded_in_windows(gpu, paged):
    """With bindings capped below two sequences' blocks, each dispatch
    binds the blocks of one sequence; the bits are those of one dispatch."""
    case = _decode_case(lens=(37, 20, 48, 9), shared=0, d=16, dv=16, block_size=4)
    q, _, (k, v), lens = case.arrays(np.float32)
    batch, heads_kv, capacity, _ = k.shape
    blocks = capacity // case.block_size
    # Each sequence's blocks in a row of the pool: a sequence's window is
    # its own 6 KiB.
    pool_k, pool_v = (
        x.reshape(batch, heads_kv, blocks, case.block_size, -1)
        .transpose(0, 2, 1, 3, 4)
        .reshape(batch * blocks, heads_kv, case.block_size, -1)
        for x in (k, v)
    )
    table = np.arange(batch * blocks).reshape(batch, blocks)
    args = (q, pool_k, pool_v) if paged else (q, k, v)
    kw = {"block_table": table if paged else None, "num_splits": 2, "return_lse": True}
    for device_arrays in [False, True]:
        inputs = [flashport.to_device(x) for x in args] if device_arrays else list(args)
        whole = flashport.attention_with_kvcache(*inputs, lens, device=gpu, **kw)
        with overrides(binding_limit=8192):
            cut = flashport.attention_with_kvcache(*inputs, lens, device=gpu, **kw)
        for a, b in zip(whole, cut, strict=True):
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    with overrides(binding_limit=1024), pytest.raises(ProblemTooLargeError, match="sequence 0"):
        flashport.attention_with_kvcache(*args, lens, device=gpu, **kw)


def test_paged_blocks_spread_past_a_binding_are_decoded_as_windows(gpu):
    """A permuted block table spreads each sequence's blocks over the whole
    pool; with bindings capped at three blocks the pool is bound as windows
    of whole blocks, one run each, merged by lse (it was refused)."""
    rng = np.random.default_rng(20)
    batch, heads_kv, heads_q, block, blocks, d, dv = 2, 2, 2, 4, 12, 32, 8
    pool_k = rng.standard_normal((batch * blocks, heads_kv, block, d)).astype(np.float32)
    pool_v = rng.standard_normal((batch * blocks, heads_kv, block, dv)).astype(np.float32)
    table = rng.permutation(batch * blocks).reshape(batch, blocks).astype(np.int32)
    q = rng.standard_normal((batch, heads_q, 1, d)).astype(np.float32)
    lens = np.array([45, 31], np.int32)
    kw = {"block_table": table, "num_splits": 1, "return_lse": True, "device": gpu}
    want_out, want_lse = flashport.reference.attention_with_kvcache(
        *(x.astype(np.float64) for x in (q, pool_k, pool_v)),
        lens,
        block_table=table,
        return_lse=True,
    )
    whole = flashport.attention_with_kvcache(q, pool_k, pool_v, lens, **kw)
    for device_arrays in [False, True]:
        args = [q, pool_k, pool_v]
        if device_arrays:
            args = [flashport.to_device(x) for x in args]
        with overrides(binding_limit=4096):
            out, lse = flashport.attention_with_kvcache(*args, lens, **kw)
        out, lse = np.asarray(out), np.asarray(lse)
        np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(out, whole[0], rtol=1e-6, atol=1e-6)


# Each sequence's blocks span several bindings: a block of the float32
# case is 2 heads x 16 keys x 32 x 4 bytes = 4 KiB, a binding two of them
# (less the window's alignment slack), a contiguous sequence's rows 52 KiB.
PAST_A_BINDING = _decode_case(
    heads_kv=2, group=3, seq_q=2, d=32, dv=8, block_size=16, lens=(45, 0, 31, 200), shared=0
)
PAST_A_BINDING_LIMIT = 2 * 4096 + 64


def _past_a_binding_variants(name: str) -> dict:
    case, rng = PAST_A_BINDING, np.random.default_rng(11)
    return {
        "none": {},
        # Shared slopes: each key/value head's dispatch takes its group's.
        "window_alibi_sinks": {
            "window": (70, 1),
            "alibi_slopes": rng.uniform(0.0, 1.0, case.heads_q),
            "sinks": rng.standard_normal(case.heads_q) * 2.0,
        },
        "softcap_alibi_per_sequence_sinks": {
            "softcap": 30.0,
            "alibi_slopes": rng.uniform(0.0, 1.0, (case.batch, case.heads_q)),
            "sinks": rng.standard_normal(case.heads_q) * 2.0,
        },
    }[name]


@pytest.mark.parametrize(
    "variants", ["none", "window_alibi_sinks", "softcap_alibi_per_sequence_sinks"]
)
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_caches_past_a_binding_match_the_reference(gpu, dtype, paged, variants):
    """Paged pools and contiguous caches each of whose sequences spans
    several (lowered) bindings: the pool bound as windows of whole blocks,
    the contiguous cache per key/value head as windows of rows, each
    window one run of the kernel, merged by lse. GQA, seq_q 2, lengths
    0 to 200, NaN wherever nothing may be read; host and device caches
    give the same bits and match the oracle (with the tolerances of
    _check); a contiguous sequence's rows were refused before."""
    case, kw = PAST_A_BINDING, _past_a_binding_variants(variants)
    q, (pool_k, pool_v, table), (k, v), lens = case.arrays(dtype)
    eb = np.dtype(dtype).itemsize
    per_sequence = (k[0].nbytes, pool_k[0].nbytes * -(-max(case.lens) // case.block_size))
    assert min(per_sequence) > 2 * PAST_A_BINDING_LIMIT, "the case must span bindings"
    assert pool_k[0].nbytes * 4 // eb < PAST_A_BINDING_LIMIT, "a float32 block fits one"
    args = (q, pool_k, pool_v) if paged else (q, k, v)
    common = {
        "block_table": table if paged else None,
        "causal": case.causal,
        "scale": case.scale,
        "num_splits": 1,
        "return_lse": True,
        "device": gpu,
        **kw,
    }
    results = []
    for device_arrays in [False, True]:
        inputs = [flashport.to_device(x) for x in args] if device_arrays else list(args)
        with overrides(binding_limit=PAST_A_BINDING_LIMIT):
            out, lse = flashport.attention_with_kvcache(*inputs, lens, **common)
        results.append((np.asarray(out), np.asarray(lse)))
    (out, lse), (dev_out, dev_lse) = results
    assert out.tobytes() == dev_out.tobytes() and lse.tobytes() == dev_lse.tobytes()
    oracle = (q, k, v, lens, None, case.causal, case.scale, True)
    want_out, want_lse = reference._attention_with_kvcache(*oracle, oracle_dtype(dtype), **kw)
    base_out, base_lse = reference._attention_with_kvcache(*oracle, dtype, **kw)
    scores, terms, score_terms = _magnitudes(case, q, (k, v), lens, kw)
    assert_close("o", out, want_out, base_out, dtype, scores, terms)
    assert_close("lse", lse, want_lse, base_lse, dtype, scores, max(scores, score_terms))
    if "sinks" not in kw:
        assert np.all(lse[1] == -np.inf) and np.all(out[1] == 0), "the empty sequence"


@pytest.mark.parametrize("splits", [2, 3])
def test_split_states_of_every_window_are_merged(gpu, splits):
    """Several splits in each window's run of a contiguous cache cut per
    key/value head: every run's splits reach the combine pass."""
    case = _decode_case(heads_kv=2, group=2, d=32, dv=8, block_size=16, lens=(200, 77), shared=0)
    q, _, (k, v), lens = case.arrays(np.float32)
    # Windows of 31 rows of 128 bytes: seven runs for the 200 keys.
    with overrides(binding_limit=4096):
        out, lse = flashport.attention_with_kvcache(
            q, k, v, lens, num_splits=splits, return_lse=True, device=gpu
        )
    want_out, want_lse = reference.attention_with_kvcache(
        *(x.astype(np.float64) for x in (q, k, v)), lens, return_lse=True
    )
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)


def test_caches_no_window_holds_are_refused_by_name(gpu):
    """What windows do not mend is refused, naming the sizes and the limit:
    a paged block larger than a binding, and split states of every window
    a sequence reads that do not fit one."""
    case = _decode_case(heads_kv=2, group=3, d=32, dv=8, block_size=16, lens=(200,), shared=0)
    q, (pool_k, pool_v, table), (k, v), lens = case.arrays(np.float32)
    with overrides(binding_limit=4096), pytest.raises(ProblemTooLargeError) as e:
        flashport.attention_with_kvcache(q, pool_k, pool_v, lens, block_table=table, device=gpu)
    for fragment in ["one block of k_cache / v_cache", "= 4096 bytes", "(4096 bytes, less"]:
        assert fragment in str(e.value)
    with overrides(binding_limit=1024), pytest.raises(ProblemTooLargeError) as e:
        flashport.attention_with_kvcache(q, k, v, lens, num_splits=8, device=gpu)
    message = str(e.value)
    assert "sequence 0 (key/value head 0)" in message and "(1024 bytes)" in message, message
    assert "8 split state(s) for each of the" in message, message


def test_float64_is_refused_on_the_gpu(gpu):
    case = _decode_case()
    q, _, (k, v), lens = case.arrays(np.float64)
    with pytest.raises(DTypeError, match="q has dtype float64"):
        flashport.attention_with_kvcache(q, k, v, lens, device=gpu)


Q = np.zeros((2, 4, 1, 8), np.float32)
CACHE = np.zeros((2, 2, 6, 8), np.float32)
POOL = np.zeros((10, 2, 3, 8), np.float32)
LENS = np.array([3, 6])
TABLE = np.array([[4, 9, -1], [0, 1, 7]], np.int32)


ERRORS = [
    # (args, keywords, exception, fragments)
    (
        (Q, POOL, POOL, LENS),
        {"block_table": np.array([[4, 9, -1], [0, 13, 7]])},
        InvalidArgumentError,
        ["block_table[1, 1]=13", "num_blocks = 10"],
    ),
    (
        (Q, POOL, POOL, LENS),
        {"block_table": np.array([[-2, 9, -1], [0, 1, 7]])},
        InvalidArgumentError,
        ["block_table[0, 0]=-2"],
    ),
    (
        (Q, POOL, POOL, np.array([3, 10])),
        {"block_table": TABLE},
        ShapeError,
        ["block_table has shape (2, 3)", "cache_seqlens[1] = 10"],
    ),
    (
        (Q, POOL, POOL, LENS),
        {"block_table": TABLE.astype(np.float32)},
        DTypeError,
        ["block_table has dtype float32"],
    ),
    (
        (Q, POOL, POOL, LENS),
        {"block_table": TABLE[:1]},
        ShapeError,
        ["block_table has shape (1, 3)"],
    ),
    (
        (Q, CACHE, CACHE, np.array([3, 7])),
        {},
        InvalidArgumentError,
        ["cache_seqlens[1]=7", "capacity"],
    ),
    ((Q, CACHE, CACHE, np.array([-1, 2])), {}, InvalidArgumentError, ["cache_seqlens[0]=-1"]),
    ((Q, CACHE, CACHE, np.array([1.0, 2.0])), {}, DTypeError, ["cache_seqlens has dtype float64"]),
    ((Q, CACHE, CACHE, np.array([1, 2, 3])), {}, ShapeError, ["cache_seqlens has shape (3,)"]),
    (
        (Q, POOL, POOL, LENS),
        {},
        ShapeError,
        ["k_cache has 10 sequences but q has 2", "block_table"],
    ),
    ((Q, CACHE, CACHE[:, :, :5], LENS), {}, ShapeError, ["k_cache and v_cache"]),
    ((Q, CACHE[:, :, :, :4], CACHE[:, :, :, :4], LENS), {}, ShapeError, ["k_cache: 4"]),
    ((Q[0], CACHE, CACHE, LENS), {}, ShapeError, ["q has shape (4, 1, 8)"]),
    (
        (Q, CACHE.astype(np.float16), CACHE.astype(np.float16), LENS),
        {},
        DTypeError,
        ["k_cache has dtype float16"],
    ),
    ((Q, CACHE, CACHE, LENS), {"num_splits": 0}, InvalidArgumentError, ["num_splits=0"]),
    ((Q, CACHE, CACHE, LENS), {"num_splits": 5000}, InvalidArgumentError, ["num_splits=5000"]),
    ((Q, CACHE, CACHE, LENS), {"num_splits": 2.0}, InvalidArgumentError, ["num_splits=2.0"]),
    ((Q, CACHE, CACHE, LENS), {"window": (-3, 0)}, InvalidArgumentError, ["window"]),
    ((Q, CACHE, CACHE, LENS), {"sinks": np.zeros(3)}, ShapeError, ["sinks has shape (3,)"]),
    ((Q, CACHE, CACHE, LENS), {"scale": float("nan")}, InvalidArgumentError, ["scale"]),
]


@pytest.mark.parametrize("args,kw,error,fragments", ERRORS)
def test_errors_name_the_argument_and_the_entry(backend, args, kw, error, fragments):
    before = copy.deepcopy(args)
    with pytest.raises(error) as info:
        flashport.attention_with_kvcache(*args, device=backend, **kw)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))
    assert all(np.array_equal(a, b) for a, b in zip(args, before, strict=True))


def test_a_cache_too_large_to_copy_is_named_as_passed():
    """A broadcast cache whose contiguous copy cannot exist is refused by
    the name the caller gave it (the message said k)."""
    q = np.ones((1, 1, 1, 64), np.float32)
    huge = np.broadcast_to(np.float32(1), (1, 1, 2**40, 64))
    lens = np.array([5], np.int32)
    with pytest.raises(ProblemTooLargeError, match=r"^k_cache is not contiguous"):
        flashport.attention_with_kvcache(q, huge, huge, lens, device="cpu")


def test_integer_arrays_of_the_wrong_shape_are_not_read():
    """cache_seqlens and block_table of a shape validation refuses are
    refused without reading their entries: stride-0 views of 2^36 entries
    (512 GiB once widened) would abort or exhaust the process if read (a
    view of 2^27 took seconds and a GiB before the ShapeError)."""
    q = np.zeros((1, 1, 1, 8), np.float32)
    k = np.zeros((1, 1, 4, 8), np.float32)
    lens = np.broadcast_to(np.int8(0), (2**36,))
    table = np.broadcast_to(np.int8(0), (2, 2**35))
    with pytest.raises(ShapeError, match=r"cache_seqlens has shape \(68719476736,\)"):
        flashport.attention_with_kvcache(q, k, k, lens, device="cpu")
    with pytest.raises(ShapeError, match=r"block_table has shape \(2, 34359738368\)"):
        flashport.attention_with_kvcache(q, k, k, np.array([4]), block_table=table, device="cpu")


def test_unsigned_lengths_beyond_int64_are_named_as_passed():
    """uint64 lengths above 2^63 are refused by index and value (they
    saturated, and the message quoted 9223372036854775807). A block table's
    entries saturate still (those past a length may be anything, and
    test_lengths_and_tables_of_any_integer_dtype_and_layout passes -1 cast
    to uint64 there); a used one is named "2^63 or more"."""
    q = np.zeros((1, 1, 1, 8), np.float32)
    k = np.zeros((1, 1, 4, 8), np.float32)
    huge = np.array([2**64 - 1], np.uint64)
    with pytest.raises(InvalidArgumentError, match=r"^cache_seqlens\[0\]=18446744073709551615: "):
        flashport.attention_with_kvcache(q, k, k, huge, device="cpu")
    # A used entry of the table beyond int64: not quoted as int64's largest.
    table = np.array([[0, 2**63 + 5]], np.uint64)
    with pytest.raises(InvalidArgumentError, match=r"^block_table\[0, 1\]=2\^63 or more: "):
        flashport.attention_with_kvcache(q, k, k, np.array([5]), block_table=table, device="cpu")
