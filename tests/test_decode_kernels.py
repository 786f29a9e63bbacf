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

import numpy as np
import pytest
from conftest import overrides
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
