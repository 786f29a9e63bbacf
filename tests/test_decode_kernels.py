"""Decoding's two GPU kernels each against the oracle: the subgroup kernel
(which the GPU runs where its subgroups have one known size, lavapipe's and
NVIDIA's among them) in its layouts (the default; 8 keys per pass in a
workgroup of 32 invocations; walkers of at most 4 and 16 lanes, where the
subgroup is wider; with naga's index clamps, which a release build drops),
and the workgroup kernel (which runs elsewhere), each
forced by the test overrides on the cases and variants of test_kvcache's
property test, with head dimensions up to 128 as well."""

from __future__ import annotations

import dataclasses

import flashport
import numpy as np
import pytest
from conftest import overrides
from flashport import reference
from hypothesis import given
from hypothesis import strategies as st
from test_kvcache import DTYPES, _check, _decode_case, kv_cases, kv_variants

KERNELS = {
    "subgroup": {},
    "subgroup-8-keys-32-invocations": {"decode_keys": 8, "decode_workgroup": 32},
    "subgroup-4-lanes": {"decode_lanes": 4},
    "subgroup-16-lanes": {"decode_lanes": 16},
    "subgroup-checked": {"decode_checked": True},
    "workgroup": {"no_subgroups": True},
}


@pytest.mark.parametrize("kernel", KERNELS)
@given(data=st.data())
def test_each_kernel_against_the_oracle(gpu, kernel, data):
    case = data.draw(kv_cases(gpu), label="case")
    wide = data.draw(st.sampled_from([None, None, 64, 100, 128]), label="wide d")
    if wide is not None:
        case = dataclasses.replace(case, d=wide, dv=data.draw(st.sampled_from([wide, 40])))
    dtype = data.draw(st.sampled_from(DTYPES[gpu]), label="dtype")
    kw = data.draw(kv_variants(case), label="variants")
    splits = data.draw(st.sampled_from([None, 1, 3, 40]), label="num_splits")
    with overrides(**KERNELS[kernel]):
        _check(case, gpu, dtype, kw, splits)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("splits", [None, 1, 4])
def test_each_kernel_is_bitwise_reproducible(gpu, kernel, splits):
    case = _decode_case(seq_q=3, d=128, dv=128, lens=(300, 0, 129))
    with overrides(**KERNELS[kernel]):
        first = _check(case, gpu, np.float16, {"softcap": 30.0}, splits)
        second = _check(case, gpu, np.float16, {"softcap": 30.0}, splits)
    for a, b in zip(first, second, strict=True):
        assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_each_kernel_hides_non_finite_cache_positions(gpu, kernel, dtype):
    """NaN and infinities in the cache past each sequence's length change
    nothing, with causal rows of two positions and GQA; a NaN in a visible value makes
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

    with overrides(**KERNELS[kernel]):
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
