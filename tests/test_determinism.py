"""Results are bitwise identical across runs and thread counts."""

from __future__ import annotations

import flashport
import numpy as np
import pytest


def _run(backend, causal):
    rng = np.random.default_rng(21)
    q = rng.standard_normal((2, 4, 97, 40)).astype(np.float32)
    k = rng.standard_normal((2, 2, 131, 40)).astype(np.float32)
    v = rng.standard_normal((2, 2, 131, 24)).astype(np.float32)
    do = rng.standard_normal((2, 4, 97, 24)).astype(np.float32)
    out, lse = flashport.attention(q, k, v, causal=causal, return_lse=True, device=backend)
    grads = flashport.attention_backward(do, q, k, v, out, lse, causal=causal, device=backend)
    return [out, lse, *grads]


@pytest.mark.parametrize("causal", [False, True])
def test_two_runs_are_bitwise_equal(backend, causal):
    first, second = _run(backend, causal), _run(backend, causal)
    for a, b in zip(first, second, strict=True):
        assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("causal", [False, True])
def test_thread_count_does_not_change_bits(monkeypatch, causal):
    results = []
    for threads in ("1", "2", "3", "8"):
        monkeypatch.setenv("FLASHPORT_NUM_THREADS", threads)
        assert flashport.devices()[0]["threads"] == int(threads)
        results.append(_run("cpu", causal))
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            assert a.tobytes() == b.tobytes()
