"""What every ``python -m flashport bench`` section shares: timing
(interleaved medians) and PyTorch as the competitor on the CPU. The bottom
of the bench modules: it imports none of them."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import numpy as np

import flashport

# OpenBLAS (NumPy) and OpenMP (PyTorch) worker threads keep spinning for a
# while after a call; pausing before each timed call keeps one competitor's
# idle threads from stealing cores from the next.
SETTLE_SECONDS = 0.3


def median_seconds(fn: Callable[[], object], repeat: int) -> float:
    return interleaved_medians({"fn": fn}, repeat)["fn"]


def interleaved_medians(
    cases: dict[str, Callable[[], object]],
    repeat: int,
    settle: float = SETTLE_SECONDS,
    warm: float = 0.0,
) -> dict[str, float]:
    """Median seconds of each callable over ``repeat`` rounds, after one
    warm-up call each (thread pools, page faults, first-call setup) and, with
    ``warm``, that many seconds of back-to-back calls each. Every round runs
    each callable once, in turn, ``settle`` seconds after the last: the
    developer machines are shared VMs, and a disturbance then slows every
    competitor of a row instead of whichever happened to be measured at that
    moment.

    On a GPU pass ``settle=0`` and a ``warm`` of some tenths of a second: the
    H100 runs slower for a while after it idled (on 2026-11-24 one float16
    decode call took 2.2 ms in its first tens of calls and 0.67 ms after a
    few hundred more), and a serving loop keeps it busy."""
    for fn in cases.values():
        time.sleep(settle)
        fn()
        until = time.perf_counter() + warm
        while time.perf_counter() < until:
            fn()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeat):
        for name, fn in cases.items():
            time.sleep(settle)
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def torch_or_none():
    """PyTorch on as many threads as flashport's CPU calls use, or None
    where it is not installed."""
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(flashport.devices()[0]["threads"])
    return torch


def torch_sdpa_cases(torch, arrays, torch_kwargs) -> dict[str, Callable[[], object]]:
    """PyTorch SDPA forward, and forward+backward, on the same arrays."""
    import torch.nn.functional as F

    tq, tk, tv, tdo = (torch.from_numpy(x) for x in arrays)
    tqg, tkg, tvg = (x.clone().requires_grad_() for x in (tq, tk, tv))
    targs = {
        key: torch.from_numpy(val) if isinstance(val, np.ndarray) else val
        for key, val in torch_kwargs.items()
    }

    def torch_forward():
        with torch.no_grad():
            return F.scaled_dot_product_attention(tq, tk, tv, **targs)

    def torch_fwd_bwd():
        for x in (tqg, tkg, tvg):
            x.grad = None
        F.scaled_dot_product_attention(tqg, tkg, tvg, **targs).backward(tdo)

    return {"torch_forward": torch_forward, "torch_fwd_bwd": torch_fwd_bwd}
