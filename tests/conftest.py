"""Shared test setup: hypothesis profiles and the one backend fixture that
runs every property on every device."""

from __future__ import annotations

import contextlib
import os

import flashport
import numpy as np
import pytest
from flashport import _core
from hypothesis import HealthCheck, settings

# Every GPU output buffer is filled with NaN before the kernels run (read on
# each call), so an element a kernel forgets to write fails the comparison
# with the oracle.
os.environ.setdefault("FLASHPORT_GPU_POISON", "1")

# "ci" keeps the default suite to a few minutes on two cores; "slow" is for
# a long hunt (HYPOTHESIS_PROFILE=slow pytest).
settings.register_profile(
    "ci",
    max_examples=30,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        # The backend fixture is an immutable device name.
        HealthCheck.function_scoped_fixture,
    ],
    derandomize=True,
)
settings.register_profile(
    "slow",
    max_examples=400,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        # The backend fixture is an immutable device name.
        HealthCheck.function_scoped_fixture,
    ],
)
# "fuzz" is the long run of tests/test_fuzz_api.py (opt-in, not derandomized).
settings.register_profile(
    "fuzz",
    max_examples=5000,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def gpu_adapters() -> list[dict]:
    return [d for d in flashport.devices() if d["device"].startswith("gpu")]


def _gpu_param():
    # CI sets FLASHPORT_REQUIRE_GPU=1 and installs lavapipe: there a missing
    # adapter is a failure, never a skip.
    if gpu_adapters() or os.environ.get("FLASHPORT_REQUIRE_GPU") == "1":
        return pytest.param("gpu", id="gpu")
    return pytest.param(
        "gpu", id="gpu", marks=pytest.mark.skip(reason="no GPU adapter (install lavapipe)")
    )


@pytest.fixture(params=["cpu", _gpu_param()])
def backend(request) -> str:
    """The device string every property runs on: "cpu" and "gpu"."""
    if request.param == "gpu" and not gpu_adapters():
        pytest.fail("FLASHPORT_REQUIRE_GPU=1 but flashport.devices() lists no GPU adapter")
    return request.param


@contextlib.contextmanager
def overrides(**knobs):
    """Runs the body with the calling thread's test overrides set (the
    extension's cargo feature `testing`, which the development build has:
    `binding_limit=`, `max_tier=`, `portable_cpu=`, ...), then clears them."""
    _core._testing_set_overrides(**knobs)
    try:
        yield
    finally:
        _core._testing_set_overrides()


@pytest.fixture
def gpu() -> str:
    """For tests that need the GPU itself (CPU-vs-GPU comparisons): fails
    where FLASHPORT_REQUIRE_GPU=1 and no adapter exists, skips elsewhere."""
    if not gpu_adapters():
        if os.environ.get("FLASHPORT_REQUIRE_GPU") == "1":
            pytest.fail("FLASHPORT_REQUIRE_GPU=1 but flashport.devices() lists no GPU adapter")
        pytest.skip("no GPU adapter (install lavapipe)")
    return "gpu"


def cache_state(cache: flashport.KVCache) -> dict:
    """Everything observable about a KV cache, its pools as their bytes (so
    that a pool poisoned with NaN compares by its bits)."""
    swapped = cache.swapped
    ids = [s for s in cache.sequences if s not in swapped]
    return {
        "ids": ids,
        "swapped": swapped,
        "swap": (cache.num_swap_blocks, cache.num_free_swap_blocks),
        "swapped_lengths": [
            [cache.length(s, layer=layer) for layer in range(cache.layers)] for s in swapped
        ],
        "table": cache.block_table(ids).tolist(),
        "counts": cache.ref_counts().tolist(),
        "usage": (cache.num_free_blocks, cache.num_used_blocks, cache.num_cached_blocks),
        "lengths": [[cache.length(s, layer=layer) for layer in range(cache.layers)] for s in ids],
        "pools": [
            [p.view(np.uint8).tobytes() for p in cache.read_layer(layer)]
            for layer in range(cache.layers)
        ],
    }
