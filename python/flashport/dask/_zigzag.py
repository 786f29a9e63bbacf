"""The zig-zag order of a sequence, for causal attention: chunk ``r`` of ``W``
holds pieces ``r`` and ``2W − 1 − r`` of ``2W`` (Megatron-LM's context
parallelism, torch's head-tail load balancer). Each chunk then holds an
early piece, which sees few keys, and a late one, which sees many: every
chunk of queries has the same causal work, and every (query chunk, key
chunk) block half a full block's."""

from __future__ import annotations

import operator
from typing import Any

import dask.array as da
import numpy as np

from flashport import InvalidArgumentError, ShapeError

from ._layout import zigzag_index, zigzag_layout, zigzag_piece_sizes

__all__ = ["unzigzag", "zigzag"]


def _workers(workers: Any) -> int:
    try:
        w = operator.index(workers)
    except TypeError:
        raise InvalidArgumentError(
            f"workers={workers!r}: expected a positive integer (the number of chunks)"
        ) from None
    if w < 1:
        raise InvalidArgumentError(f"workers={w}: expected a positive integer (chunks)")
    return w


def _axis(axis: int, ndim: int) -> int:
    if not -ndim <= axis < ndim:
        raise InvalidArgumentError(f"axis={axis}: out of range for an array of {ndim} dimensions")
    return axis % ndim


def _chunk_sizes(n: int, workers: int) -> tuple[int, ...]:
    return tuple(sum(p.length for p in chunk) for chunk in zigzag_layout(n, workers))


def zigzag(x: Any, workers: int, *, axis: int = -2) -> da.Array:
    """``x`` with its sequence axis in zig-zag order, as a dask array in
    ``workers`` chunks along it (one chunk along every other axis): chunk
    ``r`` is piece ``r`` then piece ``2·workers − 1 − r`` of the sequence cut
    into ``2·workers`` pieces as equal as can be.

    Pass zig-zagged ``q``, ``k``, ``v`` (and ``do``, ``o``, ``lse``) to
    :func:`attention` and :func:`attention_backward` with ``zigzag=True``:
    they compute at every row's true position, so the results are exact, and
    come back in the same order (:func:`unzigzag` restores it). ``axis`` is
    the sequence axis: -2 for ``q``, ``k``, ``v``, ``do``, ``o``; -1 for
    ``lse``. ``x`` may be a NumPy array or a dask array."""
    w = _workers(workers)
    if not isinstance(x, da.Array):
        x = np.asarray(x)
        ax = _axis(axis, x.ndim)
        n = x.shape[ax]
        permuted = np.take(x, np.asarray(zigzag_index(n, w), dtype=np.intp), axis=ax)
        chunks = tuple(_chunk_sizes(n, w) if i == ax else -1 for i in range(x.ndim))
        return da.from_array(permuted, chunks=chunks)
    ax = _axis(axis, x.ndim)
    n = x.shape[ax]
    if np.isnan(n):
        raise ShapeError("x has an unknown length along its sequence axis")
    sizes = zigzag_piece_sizes(n, w)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    order = [p for r in range(w) for p in (r, 2 * w - 1 - r)]
    pieces = []
    for p in order:
        index = [slice(None)] * x.ndim
        index[ax] = slice(int(starts[p]), int(starts[p + 1]))
        pieces.append(x[tuple(index)])
    y = da.concatenate(pieces, axis=ax)
    return y.rechunk({i: _chunk_sizes(n, w) if i == ax else -1 for i in range(x.ndim)})


def unzigzag(x: Any, workers: int | None = None, *, axis: int = -2) -> Any:
    """Restores the sequence order of an array in zig-zag order (what
    :func:`zigzag` made, or a result computed from such arrays). A dask
    array keeps its chunks as pieces (``2·workers`` chunks along ``axis``;
    rechunk as needed) and ``workers`` defaults to its number of chunks,
    which must then be a zig-zag layout; a NumPy array needs ``workers``."""
    if not isinstance(x, da.Array):
        if workers is None:
            raise InvalidArgumentError(
                "unzigzag of a NumPy array needs workers= (the number of zig-zag chunks)"
            )
        x = np.asarray(x)
        ax = _axis(axis, x.ndim)
        restore = np.argsort(np.asarray(zigzag_index(x.shape[ax], _workers(workers))))
        return np.take(x, restore, axis=ax)
    ax = _axis(axis, x.ndim)
    n = x.shape[ax]
    w = x.numblocks[ax] if workers is None else _workers(workers)
    want = _chunk_sizes(n, w)
    if workers is None and tuple(x.chunks[ax]) != want:
        raise ShapeError(
            f"x's chunks along axis {axis}, {x.chunks[ax]}, are not a zig-zag layout of {n} "
            f"rows in {w} chunks, {want}: pass workers= to say how many there were"
        )
    # Where each piece of the sequence sits in the zig-zag order.
    at = {}
    offset = 0
    sizes = zigzag_piece_sizes(n, w)
    for r in range(w):
        for p in (r, 2 * w - 1 - r):
            at[p] = offset
            offset += sizes[p]
    pieces = []
    for p in range(2 * w):
        index = [slice(None)] * x.ndim
        index[ax] = slice(at[p], at[p] + sizes[p])
        pieces.append(x[tuple(index)])
    return da.concatenate(pieces, axis=ax)
