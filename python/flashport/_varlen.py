"""Attention over a packed batch of variable-length sequences, flash-attn's
varlen layout. The computation and all validation happen in the Rust core
(``flashport._core``)."""

from __future__ import annotations

from typing import Literal, overload

import numpy as np
import numpy.typing as npt

from . import _core
from ._attention import Device, Tensor, Window, _main_array, _result, _variants
from ._device import DeviceArray, as_native_array
from ._errors import InvalidArgumentError

__all__ = ["attention_varlen", "attention_varlen_backward"]


def _seqlens(name: str, x: npt.ArrayLike) -> np.ndarray:
    """A ``cu_seqlens_*`` argument as the core takes it (which checks its
    dtype, shape and entries): NumPy only, since the host reads it."""
    if isinstance(x, DeviceArray):
        raise InvalidArgumentError(
            f"{name} is a flashport.DeviceArray: the prefix sums are read on the host and "
            f"must be a NumPy array or a sequence of ints"
        )
    return as_native_array(x)


# Static types follow q, as for flashport.attention.
@overload
def attention_varlen(
    q: DeviceArray,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: npt.ArrayLike,
    cu_seqlens_k: npt.ArrayLike,
    *,
    causal: bool = ...,
    scale: float | None = ...,
    window: Window | None = ...,
    alibi_slopes: npt.ArrayLike | None = ...,
    softcap: float | None = ...,
    sinks: npt.ArrayLike | None = ...,
    dropout_p: float = ...,
    seed: int | None = ...,
    return_lse: Literal[False] = ...,
    device: Device | None = ...,
) -> DeviceArray: ...
@overload
def attention_varlen(
    q: DeviceArray,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: npt.ArrayLike,
    cu_seqlens_k: npt.ArrayLike,
    *,
    causal: bool = ...,
    scale: float | None = ...,
    window: Window | None = ...,
    alibi_slopes: npt.ArrayLike | None = ...,
    softcap: float | None = ...,
    sinks: npt.ArrayLike | None = ...,
    dropout_p: float = ...,
    seed: int | None = ...,
    return_lse: Literal[True],
    device: Device | None = ...,
) -> tuple[DeviceArray, DeviceArray]: ...
@overload
def attention_varlen(
    q: npt.ArrayLike,
    k: npt.ArrayLike,
    v: npt.ArrayLike,
    cu_seqlens_q: npt.ArrayLike,
    cu_seqlens_k: npt.ArrayLike,
    *,
    causal: bool = ...,
    scale: float | None = ...,
    window: Window | None = ...,
    alibi_slopes: npt.ArrayLike | None = ...,
    softcap: float | None = ...,
    sinks: npt.ArrayLike | None = ...,
    dropout_p: float = ...,
    seed: int | None = ...,
    return_lse: Literal[False] = ...,
    device: Device | None = ...,
) -> np.ndarray: ...
@overload
def attention_varlen(
    q: npt.ArrayLike,
    k: npt.ArrayLike,
    v: npt.ArrayLike,
    cu_seqlens_q: npt.ArrayLike,
    cu_seqlens_k: npt.ArrayLike,
    *,
    causal: bool = ...,
    scale: float | None = ...,
    window: Window | None = ...,
    alibi_slopes: npt.ArrayLike | None = ...,
    softcap: float | None = ...,
    sinks: npt.ArrayLike | None = ...,
    dropout_p: float = ...,
    seed: int | None = ...,
    return_lse: Literal[True],
    device: Device | None = ...,
) -> tuple[np.ndarray, np.ndarray]: ...
def attention_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: npt.ArrayLike,
    cu_seqlens_k: npt.ArrayLike,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: Window | None = None,
    alibi_slopes: npt.ArrayLike | None = None,
    softcap: float | None = None,
    sinks: npt.ArrayLike | None = None,
    dropout_p: float = 0.0,
    seed: int | None = None,
    return_lse: bool = False,
    device: Device | None = None,
) -> np.ndarray | DeviceArray | tuple[np.ndarray | DeviceArray, np.ndarray | DeviceArray]:
    """:func:`attention` of each sequence of a packed batch of
    variable-length sequences, in one call and without padding: the work
    follows the sequences' real lengths. The layout of flash-attn's
    ``flash_attn_varlen_func``.

    Arguments
    ---------
    q : array or DeviceArray ``(total_q, heads_q, d)``
    k : array or DeviceArray ``(total_k, heads_kv, d)``
    v : array or DeviceArray ``(total_k, heads_kv, d_v)``
        The sequences' rows one after the other: sequence ``b`` is rows
        ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` of ``q`` and keys
        ``cu_seqlens_k[b]:cu_seqlens_k[b+1]`` of ``k`` and ``v``. GQA as in
        :func:`attention`.
    cu_seqlens_q, cu_seqlens_k : integer array ``(batch + 1,)``
        Prefix sums of the sequence lengths: from 0, never decreasing, the
        last entry ``total_q`` (``total_k``). Any integer dtype (flash-attn
        uses int32), or a sequence of ints; NumPy only. A sequence may be
        empty, and its query and key lengths may differ.
    causal, scale, window, softcap, sinks
        As in :func:`attention`, each sequence on its own: ``causal`` and
        ``window`` are aligned bottom-right within the sequence (query ``i``
        of a sequence with ``seq_q`` rows and ``seq_k`` keys sees its keys
        ``j <= i + seq_k - seq_q``). A row that sees no key (an empty key
        sequence, or causal with ``seq_q > seq_k``) gets ``o = 0`` and
        ``lse = -inf``.
    alibi_slopes : array ``(heads_q,)`` or ``(batch, heads_q)``, optional
        ALiBi with the distance measured within the sequence; per-sequence
        slopes as flash-attn takes them.
    dropout_p, seed
        As in :func:`attention`; the Philox counter uses the **packed** row
        and key indices (row ``cu_seqlens_q[b] + i``, key
        ``cu_seqlens_k[b] + j``, flat head ``h``), so the mask is
        ``reference.dropout_keep(seed, p, (1, heads_q, total_q, total_k))``
        restricted to each sequence's block, not that of the sequence
        computed alone.
    return_lse, device
        As in :func:`attention`. A DeviceArray input keeps the call and its
        results on the GPU (moved between the packed layout and the kernels'
        head-major one by transpose passes on the GPU).

    Returns
    -------
    o : array ``(total_q, heads_q, d_v)``
        In the inputs' dtype.
    lse : array ``(heads_q, total_q)``, only with ``return_lse=True``
        flash-attn's varlen layout; natural log, float32 (float64 for
        float64 inputs), ``-inf`` for a row that sees no key.

    Raises
    ------
    The errors of :func:`attention`; a ``ShapeError`` or ``InvalidArgumentError``
    naming the ``cu_seqlens`` argument and its bad entry (a first entry other
    than 0, an entry smaller than the one before, a last entry other than the
    total, batches of different sizes), and ``DTypeError`` for prefix sums that
    are not integers.
    """
    out, lse = _core.attention_varlen(
        _main_array(q),
        _main_array(k),
        _main_array(v),
        _seqlens("cu_seqlens_q", cu_seqlens_q),
        _seqlens("cu_seqlens_k", cu_seqlens_k),
        device,
        _variants(
            causal=causal,
            scale=scale,
            window=window,
            alibi_slopes=alibi_slopes,
            softcap=softcap,
            sinks=sinks,
            dropout_p=dropout_p,
            seed=seed,
        ),
        return_lse,
    )
    return (_result(out), _result(lse)) if return_lse else _result(out)


@overload
def attention_varlen_backward(
    do: Tensor,
    q: DeviceArray,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    lse: Tensor,
    cu_seqlens_q: npt.ArrayLike,
    cu_seqlens_k: npt.ArrayLike,
    *,
    causal: bool = ...,
    scale: float | None = ...,
    window: Window | None = ...,
    alibi_slopes: npt.ArrayLike | None = ...,
    softcap: float | None = ...,
    sinks: npt.ArrayLike | None = ...,
    dropout_p: float = ...,
    seed: int | None = ...,
    device: Device | None = ...,
) -> tuple[DeviceArray | np.ndarray, ...]: ...
@overload
def attention_varlen_backward(
    do: npt.ArrayLike,
    q: npt.ArrayLike,
    k: npt.ArrayLike,
    v: npt.ArrayLike,
    o: npt.ArrayLike,
    lse: npt.ArrayLike,
    cu_seqlens_q: npt.ArrayLike,
    cu_seqlens_k: npt.ArrayLike,
    *,
    causal: bool = ...,
    scale: float | None = ...,
    window: Window | None = ...,
    alibi_slopes: npt.ArrayLike | None = ...,
    softcap: float | None = ...,
    sinks: npt.ArrayLike | None = ...,
    dropout_p: float = ...,
    seed: int | None = ...,
    device: Device | None = ...,
) -> tuple[np.ndarray, ...]: ...
def attention_varlen_backward(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    lse: Tensor,
    cu_seqlens_q: npt.ArrayLike,
    cu_seqlens_k: npt.ArrayLike,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: Window | None = None,
    alibi_slopes: npt.ArrayLike | None = None,
    softcap: float | None = None,
    sinks: npt.ArrayLike | None = None,
    dropout_p: float = 0.0,
    seed: int | None = None,
    device: Device | None = None,
) -> tuple[np.ndarray | DeviceArray, ...]:
    """Gradients of :func:`attention_varlen` with respect to ``q``, ``k``
    and ``v``, in their packed layouts (FlashAttention-2's backward, per
    sequence, in one call).

    Arguments
    ---------
    do : array or DeviceArray ``(total_q, heads_q, d_v)``, shaped like ``o``
    q, k, v, cu_seqlens_q, cu_seqlens_k, and the keywords
        Exactly as passed to :func:`attention_varlen`.
    o, lse
        What :func:`attention_varlen` returned (``return_lse=True``): ``o``
        ``(total_q, heads_q, d_v)``, ``lse`` ``(heads_q, total_q)``, float32
        or float64.

    Returns
    -------
    ``(dq, dk, dv)`` shaped like ``q``, ``k``, ``v`` (``dk``, ``dv`` with
    ``heads_kv`` heads), in the inputs' dtype, where the inputs live (as for
    :func:`attention_backward`); then ``dsinks`` (NumPy, in the dtype of
    ``sinks``) when ``sinks`` is given. Deterministic.
    """
    dq, dk, dv, dsinks = _core.attention_varlen_backward(
        _main_array(do),
        _main_array(q),
        _main_array(k),
        _main_array(v),
        _main_array(o),
        _main_array(lse),
        _seqlens("cu_seqlens_q", cu_seqlens_q),
        _seqlens("cu_seqlens_k", cu_seqlens_k),
        device,
        _variants(
            causal=causal,
            scale=scale,
            window=window,
            alibi_slopes=alibi_slopes,
            softcap=softcap,
            sinks=sinks,
            dropout_p=dropout_p,
            seed=seed,
        ),
    )
    grads = [_result(dq), _result(dk), _result(dv)]
    if sinks is not None:
        grads.append(dsinks)
    return tuple(grads)
