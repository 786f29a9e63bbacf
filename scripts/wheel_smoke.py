"""Smoke test of the release wheel as a user gets it (`make test-wheel`):
run by the Python of a fresh virtual environment that holds only the wheel
and its declared dependencies, from outside the source tree.

Checks that it imports on its own, lists its devices, computes a forward
and a backward on the CPU and on the GPU (the Vulkan adapter present:
lavapipe in CI) that agree with the float64 reference, and that it carries
none of the development build's test hooks. Where devices() lists no GPU
adapter (no Vulkan loader or driver, as in `make test-old-glibc`'s root), it
checks the CPU-only behaviour instead: the default device computes on the
CPU, and device="gpu" raises BackendUnavailableError saying why.

The environment chooses what the GPU must do:
  FLASHPORT_REQUIRE_GPU=1   a GPU adapter must be listed and compute (make test-wheel);
  WHEEL_SMOKE_SKIP_GPU=1    the adapters listed are shown but not computed on: hosted CI
                            runners list virtual ones (a paravirtual Metal device, Windows'
                            WARP) that say nothing of a user's GPU (release workflow);
  neither                   each adapter listed must compute, and none listed is fine.
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
    require_gpu = os.environ.get("FLASHPORT_REQUIRE_GPU") == "1"
    skip_gpu = os.environ.get("WHEEL_SMOKE_SKIP_GPU") == "1"
    check(not (require_gpu and skip_gpu), "FLASHPORT_REQUIRE_GPU=1 and WHEEL_SMOKE_SKIP_GPU=1")
    if require_gpu:
        check(bool(gpus), "FLASHPORT_REQUIRE_GPU=1 but devices() lists no GPU adapter")
    gpu_names = ", ".join(f"{d['name']} ({d['backend']}, {d['type']})" for d in gpus)
    if gpus and not skip_gpu:
        errors["gpu float32"] = forward_and_backward(np.float32, "gpu", 1e-4)
    elif gpus:
        gpu_names += ": not computed on (WHEEL_SMOKE_SKIP_GPU=1)"
    else:
        gpu_names = f"no GPU adapter, CPU only: device='gpu' raises {no_gpu_error()}"
    summary = ", ".join(f"{name} {error:.1e}" for name, error in errors.items())
    print(f"wheel smoke test passed: flashport {flashport.__version__} ({gpu_names}): {summary}")


def no_gpu_error() -> str:
    """Without an adapter the default device is the CPU, and asking for the GPU
    fails with BackendUnavailableError, whose message says what is missing."""
    q = np.ones((1, 8, 16), np.float32)
    default = flashport.attention(q, q, q)
    check(np.array_equal(default, flashport.attention(q, q, q, device="cpu")), "default ≠ cpu")
    try:
        flashport.attention(q, q, q, device="gpu")
    except flashport.BackendUnavailableError as error:
        check("driver" in str(error), f"BackendUnavailableError without a reason: {error}")
        return f"{type(error).__name__}({str(error)!r})"
    check(False, "device='gpu' computed although devices() lists no GPU adapter")
    return ""


if __name__ == "__main__":
    main()
