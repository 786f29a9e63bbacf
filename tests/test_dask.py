"""flashport.dask on the CPU: forward and backward over random chunkings
equal flashport's (against the oracle with the suite's tolerance rule, and
against flashport itself) for GQA, causal, windows, ALiBi, softcap and
sinks, in sequence and in zig-zag order; bitwise identical across runs and
schedulers (threads, synchronous, a LocalCluster of 2 worker processes);
hidden blocks produce no task; errors by name at graph-build time; inputs
never modified; plain flashport never imports dask."""

from __future__ import annotations

import itertools
import subprocess
import sys

import numpy as np
import pytest

da = pytest.importorskip("dask.array")

import dask  # noqa: E402
import flashport  # noqa: E402
import flashport.dask as fpd  # noqa: E402
from cases import (  # noqa: E402
    assert_close,
    cases,
    naive,
    naive_backward,
    oracle,
    oracle_backward,
    score_magnitude,
    splits,
    term_magnitudes,
    variants,
)
from flashport import DTypeError, InvalidArgumentError, ShapeError  # noqa: E402
from flashport.dask._layout import (  # noqa: E402
    block_pairs,
    contiguous_layout,
    pieces_see,
    ring_orders,
    zigzag_index,
    zigzag_layout,
    zigzag_piece_sizes,
)
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

DTYPES = [np.float32, np.float64, np.float16]
SCHEDULES = st.tuples(st.sampled_from(["tree", "ring"]), st.sampled_from(["tree", "ring"]))
BLOCK = "flashport-attention-block-"
BACKWARD_BLOCK = "flashport-attention-backward-block-"


@pytest.fixture(scope="module")
def client():
    """A LocalCluster of two single-threaded worker processes on the
    loopback interface, for this module only. Only its tests need
    `distributed`; the threaded ones run with dask alone."""
    distributed = pytest.importorskip("distributed")
    cluster = distributed.LocalCluster(
        n_workers=2,
        processes=True,
        threads_per_worker=1,
        host="127.0.0.1",
        dashboard_address=None,
    )
    with distributed.Client(cluster, set_as_default=False) as c:
        yield c
    cluster.close()


def _chunked(x: np.ndarray, seq_chunks, axis: int = -2):
    axis %= x.ndim
    chunks = tuple(tuple(seq_chunks) if i == axis else -1 for i in range(x.ndim))
    return da.from_array(x, chunks=chunks)


def _sizes(blocks) -> tuple[int, ...]:
    return tuple(end - start for start, end in blocks)


def _tasks(x, prefix: str) -> int:
    return sum(1 for key in dict(x.__dask_graph__()) if str(key[0]).startswith(prefix))


def _positions_mask(seq_q, seq_k, causal, window, q_order=None, k_order=None) -> np.ndarray:
    """Brute force: which (query row, key row) pairs see each other, rows in
    the given orders (positions bottom-right aligned)."""
    q_pos = (seq_k - seq_q) + np.arange(seq_q)
    k_pos = np.arange(seq_k)
    if q_order is not None:
        q_pos = q_pos[q_order]
    if k_order is not None:
        k_pos = k_pos[k_order]
    diff = k_pos[None, :] - q_pos[:, None]
    seen = np.ones(diff.shape, bool)
    if causal:
        seen &= diff <= 0
    if window is not None:
        left, right = window
        if left is not None:
            seen &= diff >= -left
        if right is not None:
            seen &= diff <= right
    return seen


def _check(name, got, fp, want, base, dtype, scores, terms):
    """The suite's rule against the oracle (assert_close), and against
    flashport's own result: at most what the two may each differ from the
    oracle, added up."""
    assert got.dtype == fp.dtype and got.shape == fp.shape, (name, got.dtype, got.shape)
    assert_close(name, got, want, base, dtype, scores, terms)
    got64, fp64 = np.asarray(got, np.float64), np.asarray(fp, np.float64)
    assert np.array_equal(np.isinf(got64), np.isinf(fp64)), f"{name}: -inf pattern differs"
    finite = np.isfinite(fp64)
    if not finite.any():
        return
    want64, base64 = np.asarray(want, np.float64)[finite], np.asarray(base, np.float64)[finite]
    naive_err = np.abs(base64 - want64).max()
    floor = 8 * np.finfo(dtype).eps * max(np.abs(want64).max(), terms) * max(1.0, scores)
    gap = np.abs(got64[finite] - fp64[finite]).max()
    assert gap <= 2 * (2 * naive_err + floor), f"{name}: flashport.dask and flashport differ {gap}"


# ---------------------------------------------------------------- layouts


WINDOWS = [None, (None, None), (0, 0), (2, None), (None, 1), (1, 3), (0, None), (None, 0)]


@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_pieces_see_matches_brute_force(causal, window):
    """Every small pair of position ranges, against the rule pair by pair."""
    left, right = window if window is not None else (None, None)

    def sees(p, t):
        return (
            (not causal or t <= p)
            and (left is None or t >= p - left)
            and (right is None or t <= p + right)
        )

    for q_first, q_length, k_first, k_length in itertools.product(
        range(-6, 7), range(5), range(-6, 7), range(5)
    ):
        want = any(
            sees(p, t)
            for p in range(q_first, q_first + q_length)
            for t in range(k_first, k_first + k_length)
        )
        got = pieces_see(q_first, q_length, k_first, k_length, causal, window)
        assert got == want, (q_first, q_length, k_first, k_length)


@given(n=st.integers(0, 100), workers=st.integers(1, 9))
def test_zigzag_layout_is_a_permutation_pairing_r_with_its_mirror(n, workers):
    index = zigzag_index(n, workers)
    assert sorted(index) == list(range(n))
    layout = zigzag_layout(n, workers)
    assert len(layout) == workers
    sizes = zigzag_piece_sizes(n, workers)
    assert sum(sizes) == n and max(sizes) - min(sizes) <= 1
    starts = np.cumsum([0, *sizes])
    for r, (head, tail) in enumerate(layout):
        mirror = 2 * workers - 1 - r
        assert (head.position, head.length) == (starts[r], sizes[r])
        assert (tail.position, tail.length) == (starts[mirror], sizes[mirror])
        assert head.start == 0 and tail.start == head.length


@pytest.mark.parametrize("workers", [1, 2, 3, 4, 8])
def test_zigzag_balances_causal_work(workers):
    """Causal, seq divisible by 2W: every query chunk sees the same number
    of (query, key) pairs in zig-zag order, unlike contiguous chunks."""
    n = 2 * workers * 8
    order = np.asarray(zigzag_index(n, workers))
    seen = _positions_mask(n, n, True, None, order, order)
    per_chunk = seen.reshape(workers, n // workers, n).sum(axis=(1, 2))
    assert len(set(per_chunk.tolist())) == 1
    contiguous = _positions_mask(n, n, True, None).reshape(workers, -1, n).sum(axis=(1, 2))
    assert workers == 1 or len(set(contiguous.tolist())) == workers


@given(
    wq=st.integers(1, 9),
    wk=st.integers(1, 9),
    density=st.sampled_from([0.3, 0.7, 1.0]),
    seed=st.integers(0, 2**16),
)
def test_ring_orders_chain_every_block_once_without_cycles(wq, wk, density, seed):
    """Rows and columns each list their visible blocks once; following the
    chains never goes back in (step, query chunk), so the graph is acyclic;
    with equal counts and every block visible, step s is one block per row
    and per column (the ring's lock-step)."""
    rng = np.random.default_rng(seed)
    visible = {(i, j) for i in range(wq) for j in range(wk) if rng.random() < density}
    rows, cols = ring_orders(visible, wq, wk)
    assert sorted((i, j) for i, js in rows.items() for j in js) == sorted(visible)
    assert sorted((i, j) for j, is_ in cols.items() for i in is_) == sorted(visible)

    def rank(i, j):
        return ((j - (i * wk) // wq) % wk, i)

    for i, js in rows.items():
        assert all(rank(i, a) < rank(i, b) for a, b in itertools.pairwise(js))
    for j, is_ in cols.items():
        assert all(rank(a, j) < rank(b, j) for a, b in itertools.pairwise(is_))
    if wq == wk and density == 1.0:
        for i in range(wq):
            assert rows[i] == [(i + s) % wk for s in range(wk)]


@given(
    seq_q=st.integers(1, 60),
    seq_k=st.one_of(st.integers(1, 60), st.just(40)),
    data=st.data(),
    causal=st.booleans(),
    window=st.one_of(
        st.none(),
        st.tuples(
            st.one_of(st.none(), st.integers(0, 20)), st.one_of(st.none(), st.integers(0, 20))
        ),
    ),
    zigzag=st.booleans(),
)
def test_hidden_blocks_create_no_task(seq_q, seq_k, data, causal, window, zigzag):
    """The graph has one block task per (query chunk, key chunk) where some
    query sees some key (brute force over the positions), no other, in the
    forward and in the backward."""
    if zigzag:
        wq, wk = data.draw(st.integers(1, 5), "wq"), data.draw(st.integers(1, 5), "wk")
        q_order, k_order = zigzag_index(seq_q, wq), zigzag_index(seq_k, wk)
        q_sizes = [sum(p.length for p in c) for c in zigzag_layout(seq_q, wq)]
        k_sizes = [sum(p.length for p in c) for c in zigzag_layout(seq_k, wk)]
    else:
        q_order = k_order = None
        q_sizes = _sizes(data.draw(splits(seq_q), "q chunks"))
        k_sizes = _sizes(data.draw(splits(seq_k), "k chunks"))
        if seq_q == seq_k and data.draw(st.booleans(), "same chunks"):
            k_sizes = q_sizes
    seen = _positions_mask(seq_q, seq_k, causal, window, q_order, k_order)
    q_cuts = np.cumsum([0, *q_sizes])
    k_cuts = np.cumsum([0, *k_sizes])
    want = sum(
        bool(seen[q_cuts[i] : q_cuts[i + 1], k_cuts[j] : k_cuts[j + 1]].any())
        for i in range(len(q_sizes))
        for j in range(len(k_sizes))
    )
    q = _chunked(np.ones((1, seq_q, 4), np.float32), q_sizes)
    k = _chunked(np.ones((1, seq_k, 4), np.float32), k_sizes)
    kw = {"causal": causal, "window": window, "zigzag": zigzag}
    kw["schedule"] = data.draw(st.sampled_from(["tree", "ring"]), "schedule")
    o, lse = fpd.attention(q, k, k, return_lse=True, **kw)
    assert _tasks(o, BLOCK) == want
    grads = fpd.attention_backward(o, q, k, k, o, lse, **kw)
    assert _tasks(grads[0], BACKWARD_BLOCK) == want
    assert o.chunks == q.chunks and lse.chunks == q.chunks[:-1]
    assert grads[0].chunks == q.chunks and grads[1].chunks == grads[2].chunks == k.chunks


def test_task_counts_of_the_benchmark_layout():
    """4 × 4 chunks: 16 blocks, 10 under causal; zig-zag: all 16, each half
    a block's work."""
    q = _chunked(np.ones((1, 64, 4), np.float32), [16] * 4)
    assert _tasks(fpd.attention(q, q, q), BLOCK) == 16
    assert _tasks(fpd.attention(q, q, q, causal=True), BLOCK) == 10
    z = fpd.zigzag(np.ones((1, 64, 4), np.float32), 4)
    assert _tasks(fpd.attention(z, z, z, causal=True, zigzag=True), BLOCK) == 16
    pairs = [
        block_pairs(qc, kc, 0, True, None)
        for qc in zigzag_layout(64, 4)
        for kc in zigzag_layout(64, 4)
    ]
    assert all(len(p) in (2, 3) for p in pairs)
    assert block_pairs(contiguous_layout([16])[0], contiguous_layout([16])[0], 0, True, None) == (
        (0, 0),
    )


# ---------------------------------------------------------------- results


def _variant_kwargs(data, case, dtype):
    var = data.draw(variants(case, ("window", "alibi", "softcap", "sinks")), label="variants")
    return var.kwargs(case, dtype)


def _run_and_check(case, kw, dtype, q_chunks, k_chunks, zigzag=None, schedules=("tree", "tree")):
    """fpd forward and backward over the chunkings against the oracle and
    flashport; ``zigzag=(wq, wk)`` permutes q, k, v, do first; the forward
    and the backward run with ``schedules``."""
    q, k, v, do = case.arrays(dtype)
    sources = [x.copy() for x in (q, k, v, do)]
    fp_out, fp_lse = flashport.attention(
        q, k, v, causal=case.causal, scale=case.scale, return_lse=True, **kw
    )
    fp_grads = flashport.attention_backward(
        do, q, k, v, fp_out, fp_lse, causal=case.causal, scale=case.scale, **kw
    )
    if zigzag:
        wq, wk = zigzag
        dq_, dk_, dv_, ddo = (
            fpd.zigzag(q, wq),
            fpd.zigzag(k, wk),
            fpd.zigzag(v, wk),
            fpd.zigzag(do, wq),
        )
    else:
        dq_, dk_, dv_, ddo = (
            _chunked(q, q_chunks),
            _chunked(k, k_chunks),
            _chunked(v, k_chunks),
            _chunked(do, q_chunks),
        )
    common = {"causal": case.causal, "scale": case.scale, "zigzag": bool(zigzag), **kw}
    o, lse = fpd.attention(dq_, dk_, dv_, return_lse=True, schedule=schedules[0], **common)
    grads = fpd.attention_backward(ddo, dq_, dk_, dv_, o, lse, schedule=schedules[1], **common)
    results = list(dask.compute(o, lse, *grads, scheduler="threads"))
    if zigzag:
        axes = [-2, -1, -2, -2, -2]
        results[:5] = [
            fpd.unzigzag(r, wq if i in (0, 1, 2) else wk, axis=ax)
            for i, (r, ax) in enumerate(zip(results[:5], axes, strict=True))
        ]
    for before, after in zip(sources, (q, k, v, do), strict=True):
        assert np.array_equal(before, after), "input modified"

    scores = score_magnitude(case, q, k, **kw)
    terms = term_magnitudes(case, do, q, k, v, **kw)
    want_out, want_lse = oracle(case, q, k, v, dtype, **kw)
    base_out, base_lse = naive(case, q, k, v, dtype, **kw)
    _check("o", results[0], fp_out, want_out, base_out, dtype, scores, terms["o"])
    _check("lse", results[1], fp_lse, want_lse, base_lse, dtype, scores, terms["lse"])
    want = oracle_backward(case, do, q, k, v, dtype, **kw)
    base = naive_backward(case, do, q, k, v, dtype, **kw)
    names = ["dq", "dk", "dv"] + (["dsinks"] if "sinks" in kw else [])
    assert len(results) - 2 == len(names) == len(fp_grads)
    for name, got, fp, w, b in zip(names, results[2:], fp_grads, want, base, strict=True):
        _check(name, got, fp, w, b, dtype, scores, terms[name])


@given(data=st.data(), dtype=st.sampled_from(DTYPES))
def test_matches_flashport_for_random_chunkings(data, dtype):
    case = data.draw(cases("cpu", max_seq=80, max_work=3e6), label="case")
    kw = _variant_kwargs(data, case, dtype)
    q_chunks = _sizes(data.draw(splits(case.seq_q), label="q chunks"))
    k_chunks = _sizes(data.draw(splits(case.seq_k), label="k chunks"))
    _run_and_check(case, kw, dtype, q_chunks, k_chunks, schedules=data.draw(SCHEDULES, "schedules"))


@given(data=st.data(), dtype=st.sampled_from(DTYPES))
def test_matches_flashport_in_zigzag_order(data, dtype):
    case = data.draw(cases("cpu", max_seq=80, max_work=3e6), label="case")
    kw = _variant_kwargs(data, case, dtype)
    workers = (data.draw(st.integers(1, 4), label="wq"), data.draw(st.integers(1, 4), label="wk"))
    schedules = data.draw(SCHEDULES, "schedules")
    _run_and_check(case, kw, dtype, None, None, zigzag=workers, schedules=schedules)


# ---------------------------------------------------------------- determinism


def _problem(seed=3):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, 4, 203, 32)).astype(np.float32)
    k = rng.standard_normal((2, 2, 177, 32)).astype(np.float32)
    v = rng.standard_normal((2, 2, 177, 24)).astype(np.float32)
    do = rng.standard_normal((2, 4, 203, 24)).astype(np.float32)
    kw = {
        "causal": True,
        "window": (90, None),
        "alibi_slopes": np.array([0.05, 0.1, 0.02, 0.3], np.float32),
        "softcap": 8.0,
        "sinks": np.array([0.5, -1.0, 2.0, 0.0], np.float32),
    }
    return (q, k, v, do), kw


def _graphs(zigzag: bool, schedule: str):
    (q, k, v, do), kw = _problem()
    if zigzag:
        q_, k_, v_, do_ = fpd.zigzag(q, 3), fpd.zigzag(k, 4), fpd.zigzag(v, 4), fpd.zigzag(do, 3)
    else:
        q_, do_ = _chunked(q, (50, 3, 90, 60)), _chunked(do, (50, 3, 90, 60))
        k_, v_ = _chunked(k, (40, 40, 97)), _chunked(v, (40, 40, 97))
    kw.update(zigzag=zigzag, schedule=schedule)
    o, lse = fpd.attention(q_, k_, v_, return_lse=True, **kw)
    grads = fpd.attention_backward(do_, q_, k_, v_, o, lse, **kw)
    return [o, lse, *grads]


@pytest.mark.parametrize("schedule", ["tree", "ring"])
@pytest.mark.parametrize("zigzag", [False, True], ids=["sequence", "zigzag"])
def test_bitwise_identical_across_runs_and_schedulers(client, zigzag, schedule):
    arrays = _graphs(zigzag, schedule)
    first = dask.compute(*arrays, scheduler="threads")
    again = dask.compute(*_graphs(zigzag, schedule), scheduler="threads")
    synchronous = dask.compute(*arrays, scheduler="synchronous")
    on_cluster = client.compute(arrays, sync=True)
    for name, a, b, c, d in zip(
        ["o", "lse", "dq", "dk", "dv", "dsinks"], first, again, synchronous, on_cluster, strict=True
    ):
        assert a.tobytes() == b.tobytes() == c.tobytes() == d.tobytes(), name
        assert np.isfinite(a).all() and np.abs(a).max() > 0, name


@pytest.mark.parametrize("schedule", ["tree", "ring"])
def test_float16_gradients_are_float32_sums_of_the_block_shares_rounded_once(schedule):
    """Each gradient chunk is the sum of the blocks' float16 shares (as
    flashport returns them) taken in float32 in the graph's order (index
    order for "tree", ring order for "ring") and rounded to float16 once:
    bit for bit, whichever task widens them. The same sums in float16 differ,
    so the check tells the two apart."""
    rng = np.random.default_rng(7)
    seq, chunk = 96, 32
    q, k, v, do = (rng.standard_normal((1, 2, seq, 16)).astype(np.float16) for _ in range(4))
    q_, k_, v_, do_ = (_chunked(x, (chunk,) * 3) for x in (q, k, v, do))
    o_, lse_ = fpd.attention(q_, k_, v_, return_lse=True, schedule=schedule)
    grads = fpd.attention_backward(do_, q_, k_, v_, o_, lse_, schedule=schedule)
    o, lse, dq, dk, dv = dask.compute(o_, lse_, *grads, scheduler="threads")

    def rows(x, i, axis=-2):
        return np.take(x, range(i * chunk, (i + 1) * chunk), axis=axis)

    shares = {
        (i, j): flashport.attention_backward(
            rows(do, i),
            rows(q, i),
            rows(k, j),
            rows(v, j),
            rows(o, i),
            rows(lse, i, -1),
            q_offset=i * chunk,
            k_offset=j * chunk,
        )
        for i in range(3)
        for j in range(3)
    }
    assert all(g.dtype == np.float16 for share in shares.values() for g in share)
    if schedule == "ring":
        by_row, by_col = ring_orders(set(shares), 3, 3)
    else:
        by_row = by_col = {n: [0, 1, 2] for n in range(3)}

    def total(parts, acc):
        out = parts[0].astype(acc)
        for p in parts[1:]:
            out += p
        return out.astype(np.float16)

    for n in range(3):
        for got, parts in (
            (rows(dq, n), [shares[n, j][0] for j in by_row[n]]),
            (rows(dk, n), [shares[i, n][1] for i in by_col[n]]),
            (rows(dv, n), [shares[i, n][2] for i in by_col[n]]),
        ):
            assert got.tobytes() == total(parts, np.float32).tobytes()
    assert (
        dk.tobytes()
        != np.concatenate(
            [total([shares[i, n][1] for i in by_col[n]], np.float16) for n in range(3)], axis=-2
        ).tobytes()
    )


def test_results_on_the_cluster_match_flashport(client):
    """The processes compute what flashport computes (the sources are sent
    to the workers, results come back)."""
    (q, k, v, do), kw = _problem(seed=4)
    q_, k_, v_, do_ = (_chunked(x, (64,) * 3 + (x.shape[-2] - 192,)) for x in (q, k, v, do))
    kw.pop("sinks")
    kw["causal"] = False
    k_, v_ = _chunked(k, (100, 77)), _chunked(v, (100, 77))
    o, lse = fpd.attention(q_, k_, v_, return_lse=True, **kw)
    grads = fpd.attention_backward(do_, q_, k_, v_, o, lse, **kw)
    got = client.compute([o, lse, *grads], sync=True)
    want_o, want_lse = flashport.attention(q, k, v, return_lse=True, **kw)
    want = [want_o, want_lse, *flashport.attention_backward(do, q, k, v, want_o, want_lse, **kw)]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-6)


# ---------------------------------------------------------------- errors


def _arrays(seq_q=24, seq_k=24):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 4, seq_q, 8)).astype(np.float32)
    k = rng.standard_normal((2, 2, seq_k, 8)).astype(np.float32)
    v = rng.standard_normal((2, 2, seq_k, 8)).astype(np.float32)
    return q, k, v


def test_non_dask_inputs_say_how_to_wrap_them():
    q, k, v = _arrays()
    dq = _chunked(q, (12, 12))
    with pytest.raises(InvalidArgumentError, match=r"k is a numpy\.ndarray.*from_array\(k"):
        fpd.attention(dq, k, _chunked(v, (24,)))
    o, lse = fpd.attention(dq, _chunked(k, (24,)), _chunked(v, (24,)), return_lse=True)
    with pytest.raises(InvalidArgumentError, match=r"lse is a numpy\.ndarray"):
        fpd.attention_backward(o, dq, _chunked(k, (24,)), _chunked(v, (24,)), o, lse.compute())


@pytest.mark.parametrize(
    "axis,what", [(0, "batch"), (1, "heads"), (3, "dim")], ids=["batch", "heads", "dim"]
)
def test_chunks_off_the_sequence_axis_are_refused(axis, what):
    q, k, v = _arrays()
    chunks = {0: 1, 1: 2, 3: 4}
    bad = da.from_array(q, chunks=tuple(chunks[axis] if i == axis else -1 for i in range(4)))
    dk, dv = _chunked(k, (24,)), _chunked(v, (24,))
    with pytest.raises(ShapeError, match=rf"q is chunked along axis {axis} \({what}\)"):
        fpd.attention(bad, dk, dv)


def test_mismatched_chunks_are_refused_by_name():
    q, k, v = _arrays()
    dq, dk = _chunked(q, (12, 12)), _chunked(k, (8, 16))
    with pytest.raises(ShapeError, match=r"v is chunked along the sequence as \(24,\) but k"):
        fpd.attention(dq, dk, _chunked(v, (24,)))
    dv = _chunked(v, (8, 16))
    o, lse = fpd.attention(dq, dk, dv, return_lse=True)
    for name, args in {
        "do": (o.rechunk({2: (6, 18)}), dq, dk, dv, o, lse),
        "o": (o, dq, dk, dv, o.rechunk({2: (24,)}), lse),
        "lse": (o, dq, dk, dv, o, lse.rechunk({2: (20, 4)})),
    }.items():
        with pytest.raises(ShapeError, match=rf"{name} is chunked along the sequence .* but q"):
            fpd.attention_backward(*args)
    with pytest.raises(ShapeError, match=r"zigzag=True but k's sequence chunks \(8, 16\)"):
        fpd.attention(dq, dk, dv, zigzag=True)


def test_core_errors_come_at_graph_build_time_with_the_real_shapes():
    q, k, v = _arrays()
    dq, dk, dv = _chunked(q, (12, 12)), _chunked(k, (24,)), _chunked(v, (24,))
    bad_heads = _chunked(np.ones((2, 3, 24, 8), np.float32), (24,))
    with pytest.raises(ShapeError, match=r"must divide .* the arrays: q \(2, 4, 24, 8\)"):
        fpd.attention(dq, bad_heads, bad_heads)
    with pytest.raises(DTypeError, match="k"):
        fpd.attention(dq, dk.astype(np.float64), dv)
    with pytest.raises(InvalidArgumentError, match="window"):
        fpd.attention(dq, dk, dv, window=(-3, 2))
    with pytest.raises(InvalidArgumentError, match="scale"):
        fpd.attention(dq, dk, dv, scale=float("nan"))
    with pytest.raises(ShapeError, match="alibi_slopes"):
        fpd.attention(dq, dk, dv, alibi_slopes=np.ones(3, np.float32))
    with pytest.raises(ShapeError, match="k and v must have the same sequence length"):
        fpd.attention(dq, dk, _chunked(np.ones((2, 2, 20, 8), np.float32), (20,)))
    with pytest.raises(InvalidArgumentError, match="device"):
        fpd.attention(dq, dk, dv, device="tpu")
    with pytest.raises(InvalidArgumentError, match="schedule"):
        fpd.attention(dq, dk, dv, schedule="star")
    o, lse = fpd.attention(dq, dk, dv, return_lse=True)
    with pytest.raises(ShapeError, match="lse has shape"):
        fpd.attention_backward(o, dq, dk, dv, o, lse[:, :, :20])
    with pytest.raises(DTypeError, match="lse"):
        fpd.attention_backward(o, dq, dk, dv, o, lse.astype(np.float16))


def test_building_the_graph_computes_nothing():
    def boom():
        raise RuntimeError("an input was computed")

    shape = (1, 2, 40, 8)
    lazy = da.from_delayed(dask.delayed(boom)(), shape, dtype=np.float32).rechunk({2: 10})
    o, lse = fpd.attention(lazy, lazy, lazy, causal=True, return_lse=True)
    grads = fpd.attention_backward(o, lazy, lazy, lazy, o, lse, causal=True)
    with pytest.raises(RuntimeError, match="computed"):
        grads[0].compute(scheduler="synchronous")


# ---------------------------------------------------------------- helpers, packaging


@pytest.mark.parametrize("n,workers", [(64, 4), (101, 3), (5, 4), (0, 2), (1, 1)])
def test_zigzag_round_trips(n, workers):
    x = np.arange(2 * n * 3, dtype=np.float32).reshape(2, n, 3)
    z = fpd.zigzag(x, workers)
    assert z.chunks[1] == tuple(sum(p.length for p in c) for c in zigzag_layout(n, workers))
    np.testing.assert_array_equal(z.compute(), x[:, zigzag_index(n, workers), :])
    np.testing.assert_array_equal(fpd.unzigzag(z).compute(), x)
    np.testing.assert_array_equal(fpd.unzigzag(z.compute(), workers), x)
    lazy = fpd.zigzag(da.from_array(x, chunks=(1, 7, 2)), workers)
    assert lazy.chunks == z.chunks
    np.testing.assert_array_equal(lazy.compute(), z.compute())
    lse = np.arange(2 * n, dtype=np.float32).reshape(2, n)
    np.testing.assert_array_equal(fpd.unzigzag(fpd.zigzag(lse, workers, axis=-1), axis=-1), lse)


def test_unzigzag_refuses_chunks_it_cannot_read():
    x = _chunked(np.zeros((1, 64, 4), np.float32), (16,) * 4)
    with pytest.raises(ShapeError, match="not a zig-zag layout"):
        fpd.unzigzag(fpd.zigzag(x, 4).rechunk({1: (10, 22, 16, 16)}))
    with pytest.raises(InvalidArgumentError, match="workers"):
        fpd.unzigzag(np.zeros((4, 2)))
    with pytest.raises(InvalidArgumentError, match="workers"):
        fpd.zigzag(x, 0)


def test_plain_flashport_does_not_import_dask():
    code = (
        "import sys, numpy as np, flashport\n"
        "x = np.ones((1, 4, 8), np.float32)\n"
        "flashport.attention(x, x, x, device='cpu')\n"
        "assert 'dask' not in sys.modules, 'flashport imported dask'\n"
        "sys.modules['dask'] = None\n"
        "try:\n"
        "    import flashport.dask\n"
        "except ImportError as e:\n"
        "    assert \"pip install 'flashport[dask]'\" in str(e), e\n"
        "else:\n"
        "    raise SystemExit('imported without dask')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
