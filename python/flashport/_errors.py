"""Exceptions raised by flashport.

Each error of the Rust core maps to one class here, and each class also
derives from the built-in exception a NumPy user would expect, so
``except ValueError`` keeps working.
"""

from __future__ import annotations

__all__ = [
    "BackendUnavailableError",
    "CacheFullError",
    "DTypeError",
    "FlashportError",
    "GpuError",
    "InternalError",
    "InvalidArgumentError",
    "ProblemTooLargeError",
    "ShapeError",
    "UnknownSequenceError",
]


class FlashportError(Exception):
    """Base class of every error flashport raises."""


class ShapeError(FlashportError, ValueError):
    """An array has the wrong number of dimensions, or sizes that disagree
    with the other arguments. The message names the argument and the shapes."""


class DTypeError(FlashportError, TypeError):
    """An array has a dtype flashport cannot compute in, the arrays' dtypes
    differ, or the device cannot compute in that dtype."""


class InvalidArgumentError(FlashportError, ValueError):
    """A scalar or string argument (``scale``, ``device``, an environment
    variable) has an invalid value."""


class BackendUnavailableError(FlashportError, RuntimeError):
    """The requested device cannot be used on this machine; the message says why."""


class ProblemTooLargeError(FlashportError, ValueError):
    """The problem exceeds what the device can address, even when split."""


class GpuError(FlashportError, RuntimeError):
    """The GPU failed while running (lost device, failed submission). The CPU
    path keeps working, and a later GPU call starts afresh."""


class CacheFullError(FlashportError, MemoryError):
    """A :class:`flashport.KVCache` has too few free blocks for an append. It
    is raised before anything changes: the cache, its reference counts and
    every sequence are exactly as before the call, so the caller can free
    sequences (preempt) and retry."""


class UnknownSequenceError(FlashportError, KeyError):
    """A :class:`flashport.KVCache` sequence id that was never made or has
    been freed (ids are never reused). The message names the argument."""

    def __str__(self) -> str:
        # KeyError quotes its argument; this one is a sentence.
        return str(self.args[0]) if self.args else ""


class InternalError(FlashportError, RuntimeError):
    """A bug in flashport. Please report it with the message."""
