"""Tensors to NumPy arrays and back, without copies: CPU tensors share their
memory with NumPy (``Tensor.numpy`` and ``torch.from_numpy``), whatever
their strides. bfloat16, which NumPy lacks, goes through ml_dtypes'
``bfloat16`` by reinterpreting the bits as int16 on both sides."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .._errors import DTypeError, InvalidArgumentError

_BF16: Any = None


def _bfloat16() -> Any:
    """ml_dtypes' bfloat16 dtype, imported on first use: only bfloat16
    tensors need it."""
    global _BF16
    if _BF16 is None:
        try:
            import ml_dtypes
        except ImportError as error:
            raise ImportError(
                "bfloat16 tensors need ml_dtypes (NumPy has no bfloat16); install it with: "
                "pip install 'flashport[torch]'"
            ) from error
        _BF16 = np.dtype(ml_dtypes.bfloat16)
    return _BF16


def check_cpu(name: str, t: torch.Tensor) -> None:
    """flashport reads tensors through NumPy, which reaches CPU memory only."""
    if t.device.type != "cpu":
        raise InvalidArgumentError(
            f"{name} is on device {str(t.device)!r}: flashport.torch computes on CPU tensors "
            f"(flashport's own GPU backend takes CPU tensors too, with "
            f"flashport.torch.attention(..., device='gpu')). Move the tensors with .cpu(), or "
            f"keep {t.device.type} tensors on torch.nn.functional.scaled_dot_product_attention"
        )


def check_tensor(name: str, t: Any) -> None:
    if not isinstance(t, torch.Tensor):
        raise InvalidArgumentError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    check_cpu(name, t)
    if t.is_sparse or t.layout != torch.strided:
        raise InvalidArgumentError(f"{name} must be a dense (strided) tensor, got {t.layout}")


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A NumPy view of a CPU tensor (no copy; autograd is detached, as
    flashport only reads it)."""
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(_bfloat16())
    if t.is_complex():
        raise DTypeError(f"complex tensors are not supported, got {t.dtype}")
    # resolve_neg/resolve_conj are no-ops (no copy) on ordinary tensors.
    return t.resolve_neg().numpy()


def from_numpy(a: np.ndarray) -> torch.Tensor:
    """A tensor sharing the memory of a NumPy array flashport returned."""
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)
