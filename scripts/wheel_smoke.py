"""Smoke test of the release wheel as a user gets it (`make test-wheel`):
run by the Python of a fresh virtual environment that holds only the wheel
and its declared dependencies, from outside the source tree.

Checks that it imports on its own, lists its devices, computes a forward
and a backward on the CPU and on the GPU (the Vulkan adapter present:
lavapipe in CI) that agree with the float64 reference, and that it carries
none of the development build's test hooks.
"""

from __future__ import annotations

import os
import sys
from importlib import metadata
from pathlib import Path

import flashport
import numpy as np
from flashport import _core, reference

SOURCE = Path(__file__).resolve().parent.parent / "python"


def check(condition: bool, message: str) -> None:
    if not condition:
        sys.exit(f"wheel smoke test FAILED: {message}")


def max_error(got, want) -> float:
    pairs = zip(got, want, strict=True)
    return max(float(np.abs(np.asarray(g, np.float64) - w).max()) for g, w in pairs)


def forward_and_backward(dtype, device: str, tolerance: float) -> float:
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 4, 100, 32)).astype(dtype)
    k, v = (rng.standard_normal((2, 2, 120, 32)).astype(dtype) for _ in range(2))
    do = rng.standard_normal((2, 4, 100, 32)).astype(dtype)
    o, lse = flashport.attention(q, k, v, causal=True, return_lse=True, device=device)
    grads = flashport.attention_backward(do, q, k, v, o, lse, causal=True, device=device)
    ref_o = reference.attention(q, k, v, causal=True)
    ref_grads = reference.attention_backward(do, q, k, v, causal=True)
    error = max_error((o, *grads), (ref_o, *ref_grads))
    check(error < tolerance, f"{device} {np.dtype(dtype).name}: error {error:.3g}")
    return error


def main() -> None:
    installed = Path(flashport.__file__).resolve()
    check(SOURCE not in installed.parents, f"imported from the source tree: {installed}")
    check(flashport.__version__ == metadata.version("flashport"), "version mismatch")
    others = sorted(
        d.metadata["Name"]
        for d in metadata.distributions()
        if d.metadata["Name"].lower() not in {"flashport", "numpy", "pip", "setuptools"}
    )
    check(not others, f"the environment holds more than the wheel's dependencies: {others}")

    hooks = [name for name in dir(_core) if name.startswith("_testing")]
    check(not hooks, f"the release wheel exports test hooks: {hooks}")

    devices = flashport.devices()
    check(devices[0]["device"] == "cpu", f"devices() starts with {devices[0]}")
    gpus = [d for d in devices if d["device"].startswith("gpu")]
    errors = {
        "cpu float64": forward_and_backward(np.float64, "cpu", 1e-10),
        "cpu float32": forward_and_backward(np.float32, "cpu", 1e-4),
    }
    if gpus or os.environ.get("FLASHPORT_REQUIRE_GPU") == "1":
        check(bool(gpus), "FLASHPORT_REQUIRE_GPU=1 but devices() lists no GPU adapter")
        errors["gpu float32"] = forward_and_backward(np.float32, "gpu", 1e-4)
    summary = ", ".join(f"{name} {error:.1e}" for name, error in errors.items())
    gpu_names = ", ".join(d["name"] for d in gpus) or "no GPU"
    print(f"wheel smoke test passed: flashport {flashport.__version__} ({gpu_names}): {summary}")


if __name__ == "__main__":
    main()
