"""Attention against a cache of keys and values (decoding), contiguous or
paged. The computation and all validation happen in the Rust core
(``flashport._core``)."""

from __future__ import annotations

from typing import Literal, overload

import numpy as np
import numpy.typing as npt

from . import _core
from ._attention import Device, Tensor, Window, _main_array, _result, _variants
from ._device import DeviceArray, as_native_array
from ._errors import InvalidArgumentError

__all__ = ["attention_with_kvcache"]


def _int_array(name: str, x: npt.ArrayLike) -> np.ndarray:
    """An integer argument as the core takes it (which checks its dtype and
    entries): NumPy only, since the host reads every entry it uses."""
    if isinstance(x, DeviceArray):
        raise InvalidArgumentError(
            f"{name} is a flashport.DeviceArray: cache_seqlens and block_table are read on "
            f"the host and must be NumPy integer arrays"
        )
    return as_native_array(x)


@overload
def attention_with_kvcache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    cache_seqlens: npt.ArrayLike,
    *,
    block_table: npt.ArrayLike | None = ...,
    causal: bool = ...,
    scale: float | None = ...,
    window: Window | None = ...,
    alibi_slopes: npt.ArrayLike | None = ...,
    softcap: float | None = ...,
    sinks: npt.ArrayLike | None = ...,
    num_splits: int | None = ...,
    return_lse: Literal[False] = ...,
    device: Device | None = ...,
) -> np.ndarray | DeviceArray: ...
@overload
def attention_with_kvcache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    cache_seqlens: npt.ArrayLike,
    *,
    block_table: npt.ArrayLike | None = ...,
    causal: bool = ...,
    scale: float | None = ...,
    window: Window | None = ...,
    alibi_slopes: npt.ArrayLike | None = ...,
    softcap: float | None = ...,
    sinks: npt.ArrayLike | None = ...,
    num_splits: int | None = ...,
    return_lse: Literal[True],
    device: Device | None = ...,
) -> tuple[np.ndarray | DeviceArray, np.ndarray | DeviceArray]: ...
def attention_with_kvcache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    cache_seqlens: npt.ArrayLike,
    *,
    block_table: npt.ArrayLike | None = None,
    causal: bool = True,
    scale: float | None = None,
    window: Window | None = None,
    alibi_slopes: npt.ArrayLike | None = None,
    softcap: float | None = None,
    sinks: npt.ArrayLike | None = None,
    num_splits: int | None = None,
    return_lse: bool = False,
    device: Device | None = None,
) -> np.ndarray | DeviceArray | tuple[np.ndarray | DeviceArray, np.ndarray | DeviceArray]:
    """Attention of new query tokens against a cache of keys and values:
    decoding (``seq_q = 1``), chunked prefill and speculative verification
    (``seq_q > 1``), over a contiguous or a paged cache. Exact, like
    :func:`attention`; forward only. The caches are read, never written.

    Arguments
    ---------
    q : array or DeviceArray ``(batch, heads_q, seq_q, d)``
        The queries of the last ``seq_q`` tokens of each sequence: query row
        ``i`` of sequence ``b`` is at position ``cache_seqlens[b] - seq_q + i``
        (its own key and value are expected in the cache already).
    k_cache : array or DeviceArray
    v_cache : array or DeviceArray
        Contiguous (``block_table=None``): ``(batch, heads_kv, capacity, d)``
        and ``(batch, heads_kv, capacity, d_v)``, sequence ``b`` in
        ``k_cache[b]``. Paged: ``(num_blocks, heads_kv, block_size, d)`` and
        ``(num_blocks, heads_kv, block_size, d_v)``, key ``j`` of sequence
        ``b`` at ``k_cache[block_table[b, j // block_size], :,
        j % block_size]``. Any ``block_size >= 1``. GQA as in
        :func:`attention`: ``heads_q % heads_kv == 0``.
    cache_seqlens : integer array ``(batch,)``
        The number of valid keys of each sequence; keys at or past it are
        never read (the rest of the cache may hold anything). 0 is an empty
        sequence: its rows get output 0 and ``lse = -inf``.
    block_table : integer array ``(batch, max_blocks_per_seq)``, optional
        The blocks of each sequence, in order. Blocks may be shared between
        sequences (a common prefix, beams). Only the entries a sequence's
        length reaches (``ceil(cache_seqlens[b] / block_size)``) are read and
        checked; the others may be anything (``-1`` padding, say).
    causal : bool
        ``True`` by default: each query row sees the keys up to its own
        position, i.e. bottom-right aligned against each sequence's cached
        length (what decoding, chunked prefill and speculative verification
        need). With ``seq_q = 1`` it changes nothing. ``False`` lets every
        row see all ``cache_seqlens[b]`` keys. (flash-attn's
        ``flash_attn_with_kvcache`` defaults to ``causal=False``.)
    scale, window, alibi_slopes, softcap, sinks
        As for :func:`attention`, at the positions above: ``window=(left,
        right)`` keeps keys ``pos - left <= j <= pos + right`` of a row at
        position ``pos``; ALiBi adds ``-slope · |pos - j|``; sinks join each
        row's denominator once. There is no ``mask``, dropout or positions
        keyword: the lengths are the mask, and this is inference only.
    num_splits : int, optional
        Split each sequence's keys into this many chunks computed in
        parallel (CPU threads, GPU workgroups) and merged by their
        log-sum-exps (Flash-Decoding). ``None`` chooses from the shape (and
        on the GPU from the adapter's kind and its driver's limits), never
        from timing or the thread count; ``1`` does not split. At most 1024; chunks past the
        keys are empty. The count changes the rounding, not the result.
    return_lse : bool
        Also return the log-sum-exp of each row.
    device : "cpu", "gpu", "gpu:N" or "auto", optional
        As for :func:`attention`, except that ``"auto"`` computes NumPy
        arrays on the CPU (decoding reads each cached value once: copying a
        cache to a GPU costs more than reading it). With a DeviceArray ``q``,
        ``k_cache`` or ``v_cache`` the call runs on the GPU and the results
        stay there. ``cache_seqlens``, ``block_table``, ``alibi_slopes`` and
        ``sinks`` are NumPy arrays (read on the host).

    Returns
    -------
    o : array ``(batch, heads_q, seq_q, d_v)``
        In the inputs' dtype (float16 and bfloat16 are accumulated in float32
        and rounded once; float64 on the CPU only).
    lse : array ``(batch, heads_q, seq_q)``, only with ``return_lse=True``
        Natural-log log-sum-exp of each row's scores (with the sink), float32
        (float64 for float64 inputs); ``-inf`` for a row that sees no key.

    Deterministic: bitwise identical from run to run and across CPU thread
    counts for the same arguments (``num_splits`` included). Inputs are
    never modified.

    Raises
    ------
    ShapeError (a ValueError)
        Arrays of the wrong rank or sizes that disagree; a ``block_table``
        too short for a length (``block_table has shape (2, 4): 4 blocks of
        16 keys = 64 keys per sequence, but cache_seqlens[1] = 70``).
    DTypeError (a TypeError)
        ``q`` and the caches not one float dtype, float64 on the GPU, or a
        ``cache_seqlens``/``block_table`` that is not an integer array.
    InvalidArgumentError (a ValueError)
        A negative length or one past a contiguous cache's capacity
        (``cache_seqlens[1]=70: ...``), a block-table entry a length reaches
        that is not a block (``block_table[2, 5]=913: not a block of the
        cache (num_blocks = 64) ...``), a bad ``num_splits``, ``scale`` or
        variant keyword. Nothing is read before all of these are checked.
    BackendUnavailableError, ProblemTooLargeError, GpuError
        As for :func:`attention`. On the GPU, caches of any size are read
        window by window (a window of whole blocks, or of a contiguous
        sequence's rows of one key/value head, per storage binding of the
        adapter); ProblemTooLargeError when one paged block does not fit a
        binding, when the split states of every window one sequence reads
        do not fit one, or (on Mesa's llvmpipe before 25.0, whose loops end
        silently after 65535 passes) a ``num_splits`` that leaves a chunk
        too long for it.
    """
    out, lse = _core.attention_with_kvcache(
        _main_array(q),
        _main_array(k_cache),
        _main_array(v_cache),
        _int_array("cache_seqlens", cache_seqlens),
        None if block_table is None else _int_array("block_table", block_table),
        device,
        _variants(
            causal=causal,
            scale=scale,
            window=window,
            alibi_slopes=alibi_slopes,
            softcap=softcap,
            sinks=sinks,
        ),
        num_splits,
        return_lse,
    )
    return (_result(out), _result(lse)) if return_lse else _result(out)
