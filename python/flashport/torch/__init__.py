"""flashport.torch: flashport for PyTorch CPU tensors, differentiable.

>>> import torch, flashport.torch as fpt
>>> q, k, v = (torch.randn(2, 8, 128, 64, requires_grad=True) for _ in range(3))
>>> o = fpt.scaled_dot_product_attention(q, k, v, is_causal=True)  # torch's semantics
>>> o.sum().backward()

- :func:`scaled_dot_product_attention`: a drop-in for
  ``torch.nn.functional.scaled_dot_product_attention`` (same signature and
  semantics: top-left causal, bool masks ``True`` = attend, float masks
  added, ``enable_gqa``).
- :func:`attention`: flashport's own keywords (window, ALiBi, softcap,
  sinks, positions, ``device="gpu"``).
- :func:`register_transformers`: flashport as a transformers attention
  implementation; returns the name to pass as ``attn_implementation``.

CPU tensors are shared with NumPy without copies; float64, float32, float16
and bfloat16 (through ml_dtypes). Needs PyTorch: ``pip install
'flashport[torch]'`` (plain flashport does not import it); the transformers
backend also ``pip install 'flashport[transformers]'``. docs/torch.md says
what differs from PyTorch.
"""

from __future__ import annotations

try:
    import torch  # noqa: F401
except ImportError as error:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        "flashport.torch needs PyTorch; install it with: pip install 'flashport[torch]'"
    ) from error

from ._sdpa import attention, scaled_dot_product_attention
from ._transformers import register_transformers, transformers_attention

__all__ = [
    "attention",
    "register_transformers",
    "scaled_dot_product_attention",
    "transformers_attention",
]
