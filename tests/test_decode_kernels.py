"""Decoding's three GPU kernels each against the oracle: the cooperative
kernel (float16 with d and d_v multiples of 16 up to 128, where the adapter
has cooperative matrices: NVIDIA's; not lavapipe) with 4 (the default), 2
and 1 walkers and with naga's index clamps; the subgroup kernel (which the
GPU runs where its subgroups have one known size, lavapipe's and NVIDIA's
among them, for everything the cooperative kernel does not take) in its
layouts (the default; 8 keys per pass in a workgroup of 32 invocations;
walkers of at most 4 and 16 lanes, where the subgroup is wider; with naga's
index clamps, which a release build drops); and the workgroup kernel (which
runs elsewhere), each forced by the test overrides on the cases and
variants of test_kvcache's property test, with head dimensions up to 128 as
well."""

from __future__ import annotations

import dataclasses

import flashport
import numpy as np
import pytest
from conftest import overrides
from flashport import _core, reference
from hypothesis import given
from hypothesis import strategies as st
from test_kvcache import DTYPES, _check, _decode_case, kv_cases, kv_variants

# The subgroup and workgroup kernels below tiers the cooperative one: where
# the adapter has cooperative matrices the default decodes float16 on them.
BELOW_COOP = {"max_tier": "tiled"}
KERNELS = {
    "default": {},
    "coop-2-walkers": {"decode_workgroup": 64},
    "coop-1-walker": {"decode_workgroup": 32},
    "coop-checked": {"decode_checked": True},
    "subgroup": BELOW_COOP,
    "subgroup-8-keys-32-invocations": {"decode_keys": 8, "decode_workgroup": 32, **BELOW_COOP},
    "subgroup-4-lanes": {"decode_lanes": 4, **BELOW_COOP},
    "subgroup-16-lanes": {"decode_lanes": 16, **BELOW_COOP},
    "subgroup-checked": {"decode_checked": True, **BELOW_COOP},
    "workgroup": {"no_subgroups": True, **BELOW_COOP},
}


def _has_coop() -> bool:
    return any(
        "cooperative-matrix-f16" in d.get("features", ())
        for d in flashport.devices()
        if d["device"].startswith("gpu")
    )


@pytest.fixture
def kernel_knobs(gpu, kernel):
    """The kernel's overrides; the cooperative layouts only where the
    adapter has cooperative matrices (elsewhere they would run the subgroup
    kernel again)."""
    if kernel.startswith("coop") and not _has_coop():
        pytest.skip("the adapter has no cooperative matrices")
    return KERNELS[kernel]


@pytest.mark.parametrize("kernel", KERNELS)
@given(data=st.data())
def test_each_kernel_against_the_oracle(gpu, kernel, kernel_knobs, data):
    case = data.draw(kv_cases(gpu), label="case")
    wide = data.draw(st.sampled_from([None, None, 64, 100, 128]), label="wide d")
    if wide is not None:
        case = dataclasses.replace(case, d=wide, dv=data.draw(st.sampled_from([wide, 40])))
    dtype = data.draw(st.sampled_from(DTYPES[gpu]), label="dtype")
    kw = data.draw(kv_variants(case), label="variants")
    splits = data.draw(st.sampled_from([None, 1, 3, 40]), label="num_splits")
    with overrides(**kernel_knobs):
        _check(case, gpu, dtype, kw, splits)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("splits", [None, 1, 4])
def test_each_kernel_is_bitwise_reproducible(gpu, kernel, kernel_knobs, splits):
    case = _decode_case(seq_q=3, d=128, dv=128, lens=(300, 0, 129))
    with overrides(**kernel_knobs):
        first = _check(case, gpu, np.float16, {"softcap": 30.0}, splits)
        second = _check(case, gpu, np.float16, {"softcap": 30.0}, splits)
    for a, b in zip(first, second, strict=True):
        assert a.tobytes() == b.tobytes()


def _passes(call):
    """What `call` returns, and the GPU passes it ran."""
    _core._gpu_kernel_timing(True)
    try:
        got = call()
        passes = [name for name, _ in _core._gpu_kernel_times() if not name.startswith("host:")]
    finally:
        _core._gpu_kernel_timing(False)
    return got, passes


COOP_DIMS = st.sampled_from([16, 32, 48, 64, 128])


@given(data=st.data())
def test_the_cooperative_kernel_takes_float16_heads_of_16s(gpu, data):
    """Float16 with d and d_v multiples of 16: the cooperative kernel runs
    (where the adapter has cooperative matrices) and matches the oracle,
    paged (blocks that are not multiples of its 16-key tiles included) and
    contiguous alike, with every variant and split count."""
    if not _has_coop():
        pytest.skip("the adapter has no cooperative matrices")
    case = data.draw(kv_cases(gpu), label="case")
    case = dataclasses.replace(
        case,
        d=data.draw(COOP_DIMS, label="d"),
        dv=data.draw(COOP_DIMS, label="dv"),
        lens=tuple(data.draw(st.sampled_from([n, n + 150])) for n in case.lens),
    )
    kw = data.draw(kv_variants(case), label="variants")
    splits = data.draw(st.sampled_from([None, 1, 3, 40]), label="num_splits")
    _, passes = _passes(lambda: _check(case, gpu, np.float16, kw, splits))
    assert "decode_coop" in passes, passes


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_each_kernel_hides_non_finite_cache_positions(gpu, kernel, kernel_knobs, dtype):
    """NaN and infinities in the cache past each sequence's length (inside
    the last 16-key tile too) change nothing; a NaN in a visible value makes
    the rows that see it NaN, an infinity in a visible key gives the oracle's
    lse; a sequence of no key gives o = 0 and lse = -inf."""
    rng = np.random.default_rng(5)
    heads_q, heads_kv, seq_q, d, dv, capacity = 8, 2, 2, 32, 16, 72
    lens = np.array([17, 40, 0, 5], np.int32)
    q = rng.standard_normal((len(lens), heads_q, seq_q, d)).astype(dtype)
    k_cache = rng.standard_normal((len(lens), heads_kv, capacity, d)).astype(dtype)
    v_cache = rng.standard_normal((len(lens), heads_kv, capacity, dv)).astype(dtype)
    bad_k, bad_v = k_cache.copy(), v_cache.copy()
    for b, n in enumerate(lens):
        bad_k[b, :, n:] = np.nan
        bad_v[b, :, n:] = np.inf
        bad_v[b, :, n + 1 :, 1] = -np.inf

    def run(k, v, splits):
        return flashport.attention_with_kvcache(
            q, k, v, lens, causal=True, num_splits=splits, return_lse=True, device=gpu
        )

    with overrides(**kernel_knobs):
        for splits in (1, 3):
            clean = run(k_cache, v_cache, splits)
            got = run(bad_k, bad_v, splits)
            for g, c in zip(got, clean, strict=True):
                np.testing.assert_array_equal(g, c)
            assert np.isfinite(clean[0]).all()
            assert (clean[0][2] == 0).all() and (clean[1][2] == -np.inf).all()
            # Key 2 of sequence 1 is seen by every row of head 0's group.
            bad_v[1, 0, 2, 3] = np.nan
            o, lse = run(bad_k, bad_v, splits)
            group = heads_q // heads_kv
            assert np.isnan(o[1, :group]).all() and np.isfinite(o[1, group:]).all()
            np.testing.assert_array_equal(lse[1], clean[1][1])
            bad_v[1, 0, 2, 3] = v_cache[1, 0, 2, 3]
            # An infinite visible key: the oracle's lse (+inf or NaN).
            bad_k[0, 1, 3, 0] = np.inf
            o, lse = run(bad_k, bad_v, splits)
            want = reference.attention_with_kvcache(
                q, bad_k, bad_v, lens, causal=True, return_lse=True
            )
            np.testing.assert_array_equal(np.isnan(lse), np.isnan(want[1]))
            np.testing.assert_array_equal(np.isposinf(lse), np.isposinf(want[1]))
            np.testing.assert_array_equal(np.isnan(o), np.isnan(want[0]))
            bad_k[0, 1, 3, 0] = k_cache[0, 1, 3, 0]
