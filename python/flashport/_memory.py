"""Peak memory of one call, for the demo and the benchmark."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def peak_extra_bytes(fn: Callable[[], T]) -> tuple[T, int | None]:
    """Runs ``fn`` and returns its result and how far the process's resident
    memory peaked above its level before the call (outputs included), in bytes.

    Linux only (it resets the kernel's high-water mark through
    ``/proc/self/clear_refs``); elsewhere the second value is ``None``. Memory
    allocated by Rust threads is counted, which tracemalloc would miss."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _status_kib("VmRSS")
    except (OSError, KeyError):
        return fn(), None
    result = fn()
    peak = _status_kib("VmHWM")
    return result, max(0, peak - before) * 1024
