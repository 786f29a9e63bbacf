"""Shapes whose GPU kernels loop long in one thread.

Mesa's lavapipe before 25.0 (the CI driver) ends every loop of a shader
invocation once its loops have run 65535 iterations in all, without an error,
and then ends the workgroup when its first subgroup returns: these shapes came
back mostly unwritten there (rust/flashport-core/src/gpu/tiles/loops.rs). Every
output element is compared with the float64 oracle; conftest poisons the
outputs with NaN first, so an unwritten one fails.
"""

from __future__ import annotations

import flashport
import numpy as np
from cases import (
    Case,
    assert_close,
    naive,
    naive_backward,
    oracle,
    oracle_backward,
    score_magnitude,
    term_magnitudes,
)

F32 = np.float32


def test_forward_with_long_dot_products_is_complete(gpu):
    # Self-attention with d = 1024: the simple forward, whose threads each
    # run a 1024-long dot product per key.
    case = Case(1, 1, 1, 64, 64, 1024, 1024, False, None, 4, 0)
    q, _, _, do = case.arrays(F32)
    out, lse = flashport.attention(q, q, q, device=gpu, return_lse=True)
    want, baseline = oracle(case, q, q, q, F32), naive(case, q, q, q, F32)
    scores = score_magnitude(case, q, q)
    terms = term_magnitudes(case, do, q, q, q)
    assert_close("o", out, want[0], baseline[0], F32, scores, terms["o"])
    assert_close("lse", lse, want[1], baseline[1], F32, scores, terms["lse"])


def test_gqa_backward_with_long_group_loops_is_complete(gpu):
    # GQA 4:1 with head dims off the tiled kernels' grid: a dK/dV workgroup
    # walks every query row of four query heads.
    case = Case(1, 1, 4, 221, 244, 46, 122, False, None, 4, 1)
    q, k, v, do = case.arrays(F32)
    out, lse = flashport.attention(q, k, v, device=gpu, return_lse=True)
    dq, dk, dv = flashport.attention_backward(do, q, k, v, out, lse, device=gpu)
    want = (*oracle(case, q, k, v, F32), *oracle_backward(case, do, q, k, v, F32))
    baseline = (*naive(case, q, k, v, F32), *naive_backward(case, do, q, k, v, F32))
    scores = score_magnitude(case, q, k)
    terms = term_magnitudes(case, do, q, k, v)
    names = ("o", "lse", "dq", "dk", "dv")
    for name, got, ref, base in zip(names, (out, lse, dq, dk, dv), want, baseline, strict=True):
        assert_close(name, got, ref, base, F32, scores, terms[name])
