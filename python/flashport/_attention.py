"""The public attention functions: argument conversion and contracts. The
computation and all validation happen in the Rust core (``flashport._core``)."""

from __future__ import annotations

from typing import Any, Literal, overload

import numpy as np
import numpy.typing as npt

from . import _core

__all__ = ["attention", "attention_backward", "devices"]

Device = Literal["cpu", "gpu", "auto"]


def _as_native_array(x: Any) -> np.ndarray:
    """An ndarray view of ``x``; a copy only if its byte order is not the
    machine's (the core reads native-order elements)."""
    array = np.asarray(x)
    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    return array


def _scale_arg(scale: float | None) -> float | None:
    return None if scale is None else float(scale)


@overload
def attention(
    q: npt.ArrayLike,
    k: npt.ArrayLike,
    v: npt.ArrayLike,
    *,
    causal: bool = ...,
    scale: float | None = ...,
    return_lse: Literal[False] = ...,
    device: Device | None = ...,
) -> np.ndarray: ...
@overload
def attention(
    q: npt.ArrayLike,
    k: npt.ArrayLike,
    v: npt.ArrayLike,
    *,
    causal: bool = ...,
    scale: float | None = ...,
    return_lse: Literal[True],
    device: Device | None = ...,
) -> tuple[np.ndarray, np.ndarray]: ...
def attention(
    q: npt.ArrayLike,
    k: npt.ArrayLike,
    v: npt.ArrayLike,
    *,
    causal: bool = False,
    scale: float | None = None,
    return_lse: bool = False,
    device: Device | None = None,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Exact scaled dot-product attention, ``softmax(scale · q kᵀ) v``, computed
    with FlashAttention-2's tiled online softmax: memory grows linearly with the
    sequence lengths, never as ``seq_q × seq_k``.

    Arguments
    ---------
    q : array ``(batch, heads_q, seq_q, d)``
    k : array ``(batch, heads_kv, seq_k, d)``
    v : array ``(batch, heads_kv, seq_k, d_v)``
        The layout of PyTorch's ``scaled_dot_product_attention``. Unbatched
        ``(heads, seq, dim)`` and ``(seq, dim)`` are accepted too (all three
        arrays with the same number of dimensions). ``seq_q`` may differ from
        ``seq_k`` and ``d_v`` from ``d``. Grouped-query / multi-query attention:
        ``heads_q`` must be a multiple of ``heads_kv``; query head ``h`` reads
        key/value head ``h // (heads_q // heads_kv)``.
        Any strides, byte order or writeability; inputs are never modified.
    causal : bool
        Bottom-right aligned causal mask (the FlashAttention-2 convention):
        query ``i`` sees keys ``j <= i + seq_k - seq_q``::

            seq_q=3, seq_k=5         seq_q=5, seq_k=2
                  keys 0 1 2 3 4           keys 0 1
            query 0    x x x . .     query 0    . .   <- sees no key:
            query 1    x x x x .     query 1    . .      output 0,
            query 2    x x x x x     query 2    . .      lse = -inf
                                     query 3    x .
                                     query 4    x x

    scale : float, optional
        Multiplier of ``q kᵀ``; defaults to ``1 / sqrt(d)``. Must be finite.
    return_lse : bool
        Also return the log-sum-exp, which ``attention_backward`` needs.
    device : "cpu", "gpu" or "auto", optional
        Where to compute. ``None`` means ``$FLASHPORT_DEVICE`` if set, else
        ``"auto"``: a hardware GPU when one exists and the problem is large
        enough to gain from it, otherwise the CPU (never a software adapter).
        The CPU uses ``$FLASHPORT_NUM_THREADS`` threads (default: all cores).

    Returns
    -------
    o : array ``(batch, heads_q, seq_q, d_v)``
        In the inputs' dtype. float32 and float64 are computed natively;
        float16 is accumulated in float32 and rounded once.
    lse : array ``(batch, heads_q, seq_q)``, only with ``return_lse=True``
        ``lse[i] = log(sum_j exp(scale · q_i · k_j))`` over the keys row ``i``
        sees (natural log): float32, or float64 for float64 inputs.
        ``-inf`` for a row that sees no key.

    Results are deterministic: bitwise identical across runs and thread counts.

    Raises
    ------
    ShapeError (a ValueError)
        Wrong number of dimensions or sizes that disagree; the message names
        the argument and the shapes.
    DTypeError (a TypeError)
        A dtype other than float16/32/64, or arrays of different dtypes.
    InvalidArgumentError (a ValueError)
        A non-finite ``scale`` or an unknown ``device``.
    BackendUnavailableError, GpuError (RuntimeErrors)
        ``device="gpu"`` without a usable adapter, or a GPU failure.
    """
    out, lse = _core.attention(
        _as_native_array(q),
        _as_native_array(k),
        _as_native_array(v),
        bool(causal),
        _scale_arg(scale),
        device,
    )
    return (out, lse) if return_lse else out


def attention_backward(
    do: npt.ArrayLike,
    q: npt.ArrayLike,
    k: npt.ArrayLike,
    v: npt.ArrayLike,
    o: npt.ArrayLike,
    lse: npt.ArrayLike,
    *,
    causal: bool = False,
    scale: float | None = None,
    device: Device | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gradients of :func:`attention` with respect to ``q``, ``k`` and ``v``.

    FlashAttention-2's backward: the attention probabilities are recomputed
    tile by tile from ``lse`` instead of being stored, so memory stays linear.

    Arguments
    ---------
    do : array shaped like ``o``
        Gradient of the loss with respect to the attention output.
    q, k, v, causal, scale, device
        Exactly as passed to :func:`attention`.
    o, lse
        The output and log-sum-exp :func:`attention` returned for them
        (``return_lse=True``). ``lse`` may be float32 or float64.

    Returns
    -------
    dq : array shaped like ``q``
    dk : array shaped like ``k`` (``heads_kv`` heads: the gradients of the
        query heads that share a key/value head are summed)
    dv : array shaped like ``v``
        In the inputs' dtype. Deterministic: computed without atomics, in an
        order that depends neither on scheduling nor on the thread count.

    Raises
    ------
    The same errors as :func:`attention`; ``do``/``o`` must have the output's
    shape and dtype and ``lse`` the shape ``q.shape[:-1]``.
    """
    return _core.attention_backward(
        _as_native_array(do),
        _as_native_array(q),
        _as_native_array(k),
        _as_native_array(v),
        _as_native_array(o),
        _as_native_array(lse),
        bool(causal),
        _scale_arg(scale),
        device,
    )


def devices() -> list[dict[str, Any]]:
    """What flashport can compute on: the CPU (thread count, per-core cache)
    and each GPU adapter (backend API, name, type — ``"discrete"``,
    ``"integrated"``, ``"virtual"`` or ``"software"`` —, driver, and the
    limits and features flashport uses)."""
    return _core.devices()
