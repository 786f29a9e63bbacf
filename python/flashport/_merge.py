"""Merging attention states: the attention over a union of key sets from
each set's output and log-sum-exp. The computation and all validation
happen in the Rust core (``flashport._core``)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from . import _core
from ._attention import Device, Tensor, _main_array, _result
from ._device import DeviceArray

__all__ = ["merge_states"]

# One argument: a sequence of parts, or one array with a leading parts axis.
States = Sequence[Tensor] | Tensor


def _parts(x: States) -> list[np.ndarray | _core.DeviceArray] | np.ndarray | _core.DeviceArray:
    """A list for the sequence form (each part converted on its own), one
    array for the stacked form."""
    if isinstance(x, list | tuple):
        return [_main_array(part) for part in x]
    return _main_array(x)


def merge_states(
    outs: States,
    lses: States,
    *,
    device: Device | None = None,
) -> tuple[np.ndarray | DeviceArray, np.ndarray | DeviceArray]:
    """Merges attention states: from the output and log-sum-exp of attention
    over each of several disjoint sets of keys (the parts), the output and
    log-sum-exp of attention over their union.

    For each row, with parts ``i`` in order::

        lse = log Σ_i exp(lse_i)
        out = Σ_i exp(lse_i − lse) · out_i

    computed relative to the largest ``lse_i`` so that nothing overflows.
    Splitting the keys of :func:`attention` into blocks (each with its
    ``k_offset``, so that ``causal``, ``window`` and ALiBi see the right
    positions), computing ``(o_b, lse_b)`` per block and merging them gives
    the attention over all keys, to rounding: split-KV decoding, ring and
    context-parallel attention. :func:`attention_backward` then takes the
    merged ``out`` and ``lse`` per block.

    Arguments
    ---------
    outs : sequence of arrays, or one array with a leading parts axis
        Each part ``(..., seq_q, d_v)`` (any leading dimensions, the same for
        every part), float16, bfloat16, float32 or float64, one dtype for all. In the
        stacked form, ``outs[i]`` is part ``i``.
    lses : sequence of arrays, or one array with a leading parts axis
        Each part ``(..., seq_q)``: the natural-log log-sum-exp of each row
        of the matching part, as :func:`attention` returns it
        (``return_lse=True``): float32, or float64 for float64 ``outs``.
        A row of a part that saw no key has ``lse = -inf``; that part
        contributes nothing to the row and its ``out`` is not read.
    device : "cpu", "gpu", "gpu:N" or "auto", optional
        As for :func:`attention`, except that ``"auto"`` computes NumPy
        arrays on the CPU (merging reads each value once: a trip to a GPU
        and back costs more than the merge). DeviceArray arguments (any
        part of either form) run on the GPU, and results then stay there.

    Returns
    -------
    out : array ``(..., seq_q, d_v)``
        In the dtype of ``outs`` (float16 and bfloat16 are merged in float32
        and rounded once).
    lse : array ``(..., seq_q)``
        float32, or float64 for float64 ``outs``. A row whose every part is
        empty gets ``out = 0`` and ``lse = -inf``, never NaN. A NaN
        ``lse_i`` gives the row ``lse = NaN``, else a ``+inf`` one
        ``lse = +inf`` (as :func:`attention` over a NaN or ``+inf`` score);
        ``out`` is NaN either way. A part whose ``lse_i`` is finite is
        read even where its weight underflows to 0, so a NaN in its
        ``out_i`` reaches the row's ``out``.

    Deterministic: the parts are summed in order, from zero, so results are
    bitwise identical from run to run (and on the CPU across thread
    counts). Inputs are never modified.

    Other libraries' conventions (convert before merging)
    ------------------------------------------------------
    - FlashInfer returns base-2 log-sum-exps: multiply them by ``ln 2``
      (``lse * np.log(2)``).
    - FlashAttention-2 (``flash_attn``) gives ``+inf`` for a row that sees no
      key (FlashAttention-3 ``-inf``): map it to ``-inf``
      (``np.where(lse == np.inf, -np.inf, lse)``); a ``+inf`` left in gives
      the row ``lse = +inf`` and ``out = NaN`` here.
    - vLLM's ``merge_attn_states`` takes lse ``(heads, tokens)``: transpose
      it to the outputs' ``(..., tokens)`` order.

    Raises
    ------
    ShapeError (a ValueError)
        No parts (an empty sequence, or a stacked array with 0 along its
        first axis), different numbers of parts in ``outs`` and ``lses``,
        parts of different shapes, an ``lse`` whose shape is not its part's
        without ``d_v``; the message names the argument (``outs[2]``).
    DTypeError (a TypeError)
        A dtype other than float16/32/64 or bfloat16 (also for something
        that is not an array, e.g. a string), parts of different dtypes, an
        ``lse`` of another dtype than float32 (float64 for float64 outs), or
        float64 on the GPU.
    InvalidArgumentError, BackendUnavailableError, GpuError
        As for :func:`attention`.
    """
    out, lse = _core.merge_states(_parts(outs), _parts(lses), device)
    return _result(out), _result(lse)
