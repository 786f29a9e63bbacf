"""bfloat16 (ml_dtypes' NumPy dtype) through every public function on every
backend, against the float64 oracle with the suite's rule: at most twice
the error of a naive bfloat16 implementation (the reference computed in
bfloat16: inputs, products and intermediates rounded to bfloat16, products
accumulated in float32), plus the floor of a few bfloat16 ulps. Outputs are
bfloat16, lse float32; inputs are never modified. Skipped without
ml_dtypes, which NumPy needs to hold bfloat16 at all."""

from __future__ import annotations

import copy
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
from flashport import DTypeError, InvalidArgumentError, ShapeError
from hypothesis import given
from hypothesis import strategies as st
from test_kvcache import KvCase, kv_cases, kv_variants
from test_kvcache import _check as check_kvcache
from test_varlen import check_varlen, packed, varlen_variants

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = ml_dtypes.bfloat16

# The naive bfloat16 baseline runs in ml_dtypes' scalar loops: smaller
# problems than the float32 suites'.
MAX_WORK = {"cpu": 1e7, "gpu": 2e6}


@given(data=st.data())
def test_attention_forward_and_backward(backend, data):
    case = data.draw(cases(backend, max_work=MAX_WORK[backend]), label="case")
    check_against_oracle(case, {}, BF16, backend)


@given(data=st.data())
def test_variants(backend, data):
    """Masks (float ones in bfloat16), ALiBi slopes and sinks in bfloat16,
    softcap, windows, dropout, with their gradients."""
    case = data.draw(cases(backend, max_work=MAX_WORK[backend]), label="case")
    var = data.draw(variants(case), label="variants")
    check_against_oracle(case, var.kwargs(case, BF16), BF16, backend)


# Shapes off every tile: seq_q != seq_k, GQA, d != d_v, causal rows that
# see no key (seq_q > seq_k), 2- and 3-d inputs.
EDGES = [
    Case(2, 2, 3, 37, 29, 40, 24, True, None, 4, 1),
    Case(1, 1, 4, 70, 65, 72, 8, False, 0.3, 4, 2),
    Case(1, 3, 1, 33, 5, 16, 17, True, None, 3, 3),
    Case(1, 1, 1, 9, 1, 3, 5, True, 1.7, 2, 4),
]


@pytest.mark.parametrize("case", EDGES, ids=lambda c: f"{c.seq_q}x{c.seq_k}d{c.d}v{c.dv}")
def test_edge_shapes(backend, case):
    check_against_oracle(case, {}, BF16, backend)


def test_rows_that_see_no_key_are_zero_and_minus_infinity(backend):
    case = Case(1, 1, 2, 12, 4, 8, 8, True, None, 4, 5)
    q, k, v, _ = case.arrays(BF16)
    out, lse = flashport.attention(q, k, v, causal=True, return_lse=True, device=backend)
    hidden = slice(0, case.seq_q - case.seq_k)
    assert out.dtype == BF16 and lse.dtype == np.float32
    assert (out[..., hidden, :].astype(np.float32) == 0).all()
    assert (lse[..., hidden] == -np.inf).all()


def test_the_result_is_the_float32_one_rounded(backend):
    """float32 accumulation: a bfloat16 call gives, bit for bit, what the
    same call in float32 on the widened inputs gives, rounded once to
    bfloat16 (both backends compute bfloat16 as float32)."""
    case = Case(2, 2, 2, 23, 31, 24, 12, True, None, 4, 6)
    q, k, v, do = case.arrays(BF16)
    wide = [x.astype(np.float32) for x in (q, k, v, do)]
    out, lse = flashport.attention(q, k, v, causal=True, return_lse=True, device=backend)
    out32, lse32 = flashport.attention(*wide[:3], causal=True, return_lse=True, device=backend)
    grads = flashport.attention_backward(do, q, k, v, out, lse, causal=True, device=backend)
    grads32 = flashport.attention_backward(
        wide[3], *wide[:3], out.astype(np.float32), lse, causal=True, device=backend
    )
    assert lse.tobytes() == lse32.tobytes()
    for got, want in zip((out, *grads), (out32, *grads32), strict=True):
        assert got.dtype == BF16
        assert got.tobytes() == want.astype(BF16).tobytes()


@given(data=st.data())
def test_varlen_forward_and_backward(backend, data):
    case = data.draw(packed(backend), label="case")
    kw = data.draw(varlen_variants(case, BF16), label="variants")
    check_varlen(case, kw, BF16, backend)


@given(data=st.data())
def test_kvcache_contiguous_and_paged(backend, data):
    """The contiguous cache against the oracle, the paged one bit for bit
    equal to it."""
    case = data.draw(kv_cases(backend), label="case")
    kw = data.draw(kv_variants(case), label="variants")
    num_splits = data.draw(st.sampled_from([None, 1, 3]), label="num_splits")
    check_kvcache(case, backend, BF16, kw, num_splits)


@given(data=st.data())
def test_merge_states_of_key_blocks(backend, data):
    """Attention over key blocks merged gives the whole attention (in the
    test_merge way), each block's output in bfloat16."""
    case = data.draw(cases(backend, max_work=MAX_WORK[backend] / 4), label="case")
    blocks = data.draw(splits(case.seq_k), label="blocks")
    q, k, v, do = case.arrays(BF16)
    common = {"causal": case.causal, "scale": case.scale, "device": backend}
    q_offset = case.seq_k - case.seq_q
    outs, lses, naive_outs, naive_lses = [], [], [], []
    for start, end in blocks:
        position = {"q_offset": q_offset, "k_offset": start}
        kb, vb = k[..., start:end, :], v[..., start:end, :]
        o, lse = flashport.attention(q, kb, vb, return_lse=True, **position, **common)
        outs.append(o)
        lses.append(lse)
        no, nl = naive(dataclasses.replace(case, seq_k=end - start), q, kb, vb, BF16, **position)
        naive_outs.append(no)
        naive_lses.append(nl)
    stacked = data.draw(st.booleans(), label="stacked")
    args = (np.stack(outs), np.stack(lses)) if stacked else (outs, lses)
    before = copy.deepcopy(args)
    out, lse = flashport.merge_states(*args, device=backend)
    for b, a in zip(before, args, strict=True):
        assert all(x.tobytes() == y.tobytes() for x, y in zip(b, a, strict=True)), "modified"
    assert out.dtype == BF16 and lse.dtype == np.float32
    want_out, want_lse = oracle(case, q, k, v, BF16)
    base_out, base_lse = naive_merge(naive_outs, naive_lses, BF16)
    scores = score_magnitude(case, q, k)
    terms = term_magnitudes(case, do, q, k, v)
    assert_close("o", out, want_out, base_out, BF16, scores, terms["o"])
    assert_close("lse", lse, want_lse, base_lse, BF16, scores, terms["lse"])


def test_kvcache_object_holds_bfloat16():
    """flashport.KVCache(dtype=bfloat16): appended keys and values are kept
    bit for bit, and its attention is attention_with_kvcache's on the same
    keys, bit for bit."""
    rng = np.random.default_rng(7)
    cache = flashport.KVCache(9, 5, 2, 12, head_dim_v=7, dtype=BF16, device="cpu")
    assert cache.dtype == BF16
    lens = (13, 4)
    ks = [rng.standard_normal((2, n, 12)).astype(BF16) for n in lens]
    vs = [rng.standard_normal((2, n, 7)).astype(BF16) for n in lens]
    sids = [cache.new_sequence() for _ in lens]
    for sid, kk, vv in zip(sids, ks, vs, strict=True):
        cache.append(sid, kk[:, :3], vv[:, :3])
        cache.append(sid, kk[:, 3:], vv[:, 3:])
    q = rng.standard_normal((2, 4, 3, 12)).astype(BF16)
    out, lse = cache.attention(q, sids, return_lse=True)
    assert out.dtype == BF16 and lse.dtype == np.float32
    k_cache = np.zeros((2, 2, max(lens), 12), BF16)
    v_cache = np.zeros((2, 2, max(lens), 7), BF16)
    for b, n in enumerate(lens):
        k_cache[b, :, :n], v_cache[b, :, :n] = ks[b], vs[b]
    want, want_lse = flashport.attention_with_kvcache(
        q, k_cache, v_cache, np.array(lens), return_lse=True, device="cpu"
    )
    assert out.tobytes() == want.tobytes() and lse.tobytes() == want_lse.tobytes()
    with pytest.raises(DTypeError, match="bfloat16"):
        cache.append(sids[0], ks[0].astype(np.float16), vs[0].astype(np.float16))


def test_gpu_kvcache_refuses_bfloat16_by_name(gpu):
    # WGSL has no bfloat16, and a pool kept on the device cannot be widened
    # on the host per call as the other bfloat16 calls are.
    with pytest.raises(DTypeError, match=r"dtype.*float16.*device=\"cpu\""):
        flashport.KVCache(4, 4, 1, 8, dtype=BF16, device="gpu")


def test_kvcache_case_runs_in_bfloat16_on_every_backend(backend):
    """A fixed decode case: GQA, d != d_v, lengths off the block grid, a
    shared block, the variants."""
    case = KvCase(2, 4, 3, 24, 10, 5, (17, 9, 0), 1, True, None, 11)
    check_kvcache(case, backend, BF16, {"softcap": 30.0, "window": (6, None)}, None)


def test_dask_passes_bfloat16_through():
    """flashport.dask over query and key chunks: bfloat16 blocks merged and
    gradients summed in float32, within the rule of one call."""
    da = pytest.importorskip("dask.array")
    fpd = pytest.importorskip("flashport.dask")
    case = Case(1, 1, 2, 40, 33, 16, 8, True, None, 4, 10)
    q, k, v, do = case.arrays(BF16)
    dq_, dk_, dv_, ddo = (
        da.from_array(q, chunks=(1, 2, 16, 16)),
        da.from_array(k, chunks=(1, 1, 11, 16)),
        da.from_array(v, chunks=(1, 1, 11, 8)),
        da.from_array(do, chunks=(1, 2, 16, 8)),
    )
    out, lse = fpd.attention(dq_, dk_, dv_, causal=True, return_lse=True, device="cpu")
    out, lse = out.compute(scheduler="sync"), lse.compute(scheduler="sync")
    assert out.dtype == BF16 and lse.dtype == np.float32
    scores = score_magnitude(case, q, k)
    terms = term_magnitudes(case, do, q, k, v)
    want_out, want_lse = oracle(case, q, k, v, BF16)
    base_out, base_lse = naive(case, q, k, v, BF16)
    assert_close("o", out, want_out, base_out, BF16, scores, terms["o"])
    assert_close("lse", lse, want_lse, base_lse, BF16, scores, terms["lse"])
    grads = fpd.attention_backward(
        ddo,
        dq_,
        dk_,
        dv_,
        da.from_array(out, chunks=(1, 2, 16, 8)),
        da.from_array(lse, chunks=(1, 2, 16)),
        causal=True,
        device="cpu",
    )
    want = oracle_backward(case, do, q, k, v, BF16)
    base = naive_backward(case, do, q, k, v, BF16)
    for name, g, w, b, x in zip(("dq", "dk", "dv"), grads, want, base, (q, k, v), strict=True):
        g = g.compute(scheduler="sync")
        assert g.dtype == BF16 and g.shape == x.shape
        assert_close(name, g, w, b, BF16, scores, terms[name])


def test_mixed_dtypes_and_bad_lse_are_refused(backend):
    q, k, v, do = Case(1, 1, 1, 5, 6, 8, 4, False, None, 4, 8).arrays(BF16)
    with pytest.raises(DTypeError, match="float16"):
        flashport.attention(q, k.astype(np.float16), v, device=backend)
    out, lse = flashport.attention(q, k, v, return_lse=True, device=backend)
    with pytest.raises(DTypeError, match="lse"):
        flashport.attention_backward(do, q, k, v, out, lse.astype(BF16), device=backend)
    with pytest.raises(DTypeError, match="bfloat16"):
        flashport.attention(q.astype(np.int8), k, v, device=backend)


def test_integer_dtype_error_lists_bfloat16():
    q = np.ones((2, 4), np.int32)
    with pytest.raises(DTypeError, match="bfloat16"):
        flashport.attention(q, q, q, device="cpu")


def test_to_device_refuses_bfloat16_and_says_what_to_do(gpu):
    x = np.ones((3, 4), BF16)
    with pytest.raises(DTypeError, match=r"array.*bfloat16.*astype\(numpy.float32\)"):
        flashport.to_device(x)


def test_device_lse_with_bfloat16_inputs_is_refused(gpu):
    """A bfloat16 call's results are NumPy arrays; a device lse would ask
    for them to stay on the GPU."""
    q, k, v, do = Case(1, 1, 1, 5, 6, 8, 4, False, None, 4, 9).arrays(BF16)
    out, lse = flashport.attention(q, k, v, return_lse=True, device="gpu")
    with pytest.raises(InvalidArgumentError, match=r"lse.*bfloat16"):
        flashport.attention_backward(do, q, k, v, out, flashport.to_device(lse), device="gpu")


def test_shapes_are_still_checked():
    q = np.ones((2, 3, 4), BF16)
    with pytest.raises(ShapeError):
        flashport.attention(q, q[:, :, :3], q, device="cpu")
