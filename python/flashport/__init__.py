"""flashport: exact FlashAttention-2, forward and backward, for NumPy arrays,
on the CPU (multi-threaded, tiled) and on any GPU that wgpu reaches.

>>> import numpy as np, flashport
>>> rng = np.random.default_rng(0)
>>> q, k, v = (rng.standard_normal((2, 8, 128, 64), dtype=np.float32) for _ in range(3))
>>> o, lse = flashport.attention(q, k, v, causal=True, return_lse=True)
>>> dq, dk, dv = flashport.attention_backward(np.ones_like(o), q, k, v, o, lse, causal=True)

Arrays can stay on the GPU between calls (``flashport.to_device``): results
live where the inputs live, and calls on them return as soon as their work
is queued (``flashport.synchronize`` waits for it). For inference: ``merge_states``,
``attention_with_kvcache`` and ``KVCache``, a paged KV cache with shared,
copy-on-write blocks and prefix reuse.
"""

from __future__ import annotations

from . import reference
from ._attention import attention, attention_backward, devices
from ._cache import KVCache
from ._core import __version__
from ._device import DeviceArray, synchronize, to_device
from ._errors import (
    BackendUnavailableError,
    CacheFullError,
    DTypeError,
    FlashportError,
    GpuError,
    InternalError,
    InvalidArgumentError,
    ProblemTooLargeError,
    ShapeError,
    UnknownSequenceError,
)
from ._kvcache import attention_with_kvcache
from ._merge import merge_states
from ._scheduler import Scheduler
from ._varlen import attention_varlen, attention_varlen_backward

__all__ = [
    "BackendUnavailableError",
    "CacheFullError",
    "DTypeError",
    "DeviceArray",
    "FlashportError",
    "GpuError",
    "InternalError",
    "InvalidArgumentError",
    "KVCache",
    "ProblemTooLargeError",
    "Scheduler",
    "ShapeError",
    "UnknownSequenceError",
    "__version__",
    "attention",
    "attention_backward",
    "attention_varlen",
    "attention_varlen_backward",
    "attention_with_kvcache",
    "devices",
    "merge_states",
    "reference",
    "synchronize",
    "to_device",
]
