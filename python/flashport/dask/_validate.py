"""Argument checks made when the graph is built, so that a mistake is an
exception at the call, not a failed task minutes later on a worker.

Shapes, dtypes and the variant keywords are checked by flashport's own
validation (one place, the Rust core, with its messages): one call of
``flashport.attention`` (or ``attention_backward``) on the arguments with
the sequence axis emptied. It computes nothing, allocates nothing of size,
and yields the result dtypes. What that call cannot see, the sequence
lengths and the chunking, is checked here.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import dask.array as da
import numpy as np

import flashport
from flashport import FlashportError, InvalidArgumentError, ShapeError

from ._layout import zigzag_piece_sizes

__all__ = [
    "check_device",
    "dask_arrays",
    "seq_chunks",
    "validated_backward",
    "validated_forward",
]

AXIS_NAMES = {4: ("batch", "heads", "seq", "dim"), 3: ("heads", "seq", "dim"), 2: ("seq", "dim")}


def dask_arrays(function: str, **arrays: Any) -> None:
    """Each argument must be a dask array; the message says how to make one."""
    for name, x in arrays.items():
        if not isinstance(x, da.Array):
            kind = f"{type(x).__module__}.{type(x).__qualname__}"
            raise InvalidArgumentError(
                f"{name} is a {kind}, not a dask array: flashport.dask.{function} takes dask "
                f"arrays chunked along the sequence axis; wrap it with "
                f"dask.array.from_array({name}, chunks=...) (or call flashport.{function} "
                f"for arrays in memory)"
            )


def check_device(device: Any) -> None:
    """The device string each task passes on. Its form is checked here
    rather than by a call, which would list the GPUs of the machine that
    builds the graph: the workers' devices are theirs (a ``"gpu:N"`` that a
    worker does not have fails there, with the core's message)."""
    if device is None or device in ("cpu", "gpu", "auto"):
        return
    if not (isinstance(device, str) and re.fullmatch(r"gpu:[0-9]+", device)):
        raise InvalidArgumentError(
            f'device={device!r}: expected "cpu", "gpu", "gpu:N", "auto" or None'
        )


def _known(name: str, x: da.Array) -> None:
    if any(np.isnan(c) for axis in x.chunks for c in axis):
        raise ShapeError(
            f"{name} has unknown chunk sizes {x.chunks}: call {name}.compute_chunk_sizes() "
            "(or give the sizes) first"
        )


def _emptied(x: da.Array, axis: int) -> np.ndarray:
    """A zero-size array with ``x``'s dtype and its shape but 0 along the
    sequence axis (or ``x``'s shape when it has too few or too many
    dimensions, for the core to refuse by name)."""
    shape = list(x.shape)
    if 0 <= axis < len(shape):
        shape[axis] = 0
    return np.empty(tuple(shape), dtype=x.dtype)


def _core_checked(call, shapes: dict[str, tuple[int, ...]]):
    """Runs the validating call; a flashport error comes back as the same
    class, its message followed by the real shapes (the call's own shapes
    have 0 in the sequence axis)."""
    try:
        return call()
    except FlashportError as error:
        real = ", ".join(f"{name} {shape}" for name, shape in shapes.items())
        raise type(error)(
            f"{error} [flashport.dask checks the arguments with the sequence axis emptied; "
            f"the arrays: {real}]"
        ) from None


def seq_chunks(name: str, x: da.Array, axis: int) -> tuple[int, ...]:
    """The chunk sizes of ``x`` along its sequence axis ``axis``; every other
    axis must be one chunk."""
    _known(name, x)
    names = AXIS_NAMES.get(x.ndim + (1 if name == "lse" else 0), ())
    for i, sizes in enumerate(x.chunks):
        if i != axis and len(sizes) > 1:
            what = names[i] if i < len(names) else f"axis {i}"
            raise ShapeError(
                f"{name} is chunked along axis {i} ({what}) as {sizes}: flashport.dask splits "
                f"the sequence axis (axis {axis}) only; rechunk it, e.g. "
                f"{name}.rechunk({{{i}: -1}})"
            )
    return tuple(int(c) for c in x.chunks[axis])


def _same_chunks(name: str, got: Sequence[int], like: str, want: Sequence[int]) -> None:
    if tuple(got) != tuple(want):
        raise ShapeError(
            f"{name} is chunked along the sequence as {tuple(got)} but {like} as {tuple(want)}: "
            f"they must match (rechunk {name} like {like}, e.g. "
            f"{name}.rechunk({like}.chunks))"
        )


def _zigzag_chunks(name: str, chunks: Sequence[int]) -> None:
    n, workers = sum(chunks), len(chunks)
    sizes = zigzag_piece_sizes(n, workers)
    want = tuple(sizes[r] + sizes[2 * workers - 1 - r] for r in range(workers))
    if tuple(chunks) != want:
        raise ShapeError(
            f"zigzag=True but {name}'s sequence chunks {tuple(chunks)} are not the zig-zag "
            f"layout of {n} rows in {workers} chunks, {want}: make it with "
            f"flashport.dask.zigzag({name}, {workers})"
        )


def _lengths(q: da.Array, k: da.Array, v: da.Array, seq: int) -> None:
    if k.ndim == v.ndim == q.ndim and 2 <= q.ndim <= 4 and k.shape[seq] != v.shape[seq]:
        raise ShapeError(
            f"k and v must have the same sequence length (k: {k.shape[seq]}, "
            f"v: {v.shape[seq]}); got q {q.shape}, k {k.shape}, v {v.shape}"
        )


def validated_forward(
    q: da.Array, k: da.Array, v: da.Array, kwargs: dict[str, Any], zigzag: bool
) -> tuple[np.dtype, np.dtype, tuple[int, ...], tuple[int, ...]]:
    """Checks the forward's arguments; returns the dtypes of ``o`` and
    ``lse`` and the sequence chunks of q and of k (= v)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _known(name, x)
    seq = q.ndim - 2
    shapes = {"q": q.shape, "k": k.shape, "v": v.shape}
    o, lse = _core_checked(
        lambda: flashport.attention(
            _emptied(q, seq),
            _emptied(k, seq),
            _emptied(v, seq),
            return_lse=True,
            device="cpu",
            **kwargs,
        ),
        shapes,
    )
    _lengths(q, k, v, seq)
    q_chunks = seq_chunks("q", q, seq)
    k_chunks = seq_chunks("k", k, seq)
    _same_chunks("v", seq_chunks("v", v, seq), "k", k_chunks)
    if zigzag:
        _zigzag_chunks("q", q_chunks)
        _zigzag_chunks("k", k_chunks)
    return o.dtype, lse.dtype, q_chunks, k_chunks


def validated_backward(
    do: da.Array,
    q: da.Array,
    k: da.Array,
    v: da.Array,
    o: da.Array,
    lse: da.Array,
    kwargs: dict[str, Any],
    zigzag: bool,
) -> tuple[tuple[np.dtype, ...], tuple[int, ...], tuple[int, ...]]:
    """Checks the backward's arguments; returns the dtypes of the gradients
    and the sequence chunks of q (= do, o, lse) and of k (= v)."""
    arrays = {"do": do, "q": q, "k": k, "v": v, "o": o, "lse": lse}
    for name, x in arrays.items():
        _known(name, x)
    seq = q.ndim - 2
    shapes = {name: x.shape for name, x in arrays.items()}
    grads = _core_checked(
        lambda: flashport.attention_backward(
            *(_emptied(x, seq) for x in arrays.values()), device="cpu", **kwargs
        ),
        shapes,
    )
    _lengths(q, k, v, seq)
    for name in ("do", "o"):
        x = arrays[name]
        if x.ndim == q.ndim and x.shape[seq] != q.shape[seq]:
            raise ShapeError(
                f"{name} has shape {x.shape} but the attention output for q {q.shape} and "
                f"v {v.shape} has {q.shape[seq]} rows"
            )
    if lse.ndim == q.ndim - 1 and lse.shape[seq] != q.shape[seq]:
        raise ShapeError(
            f"lse has shape {lse.shape} but for q {q.shape} it must have {q.shape[seq]} rows"
        )
    q_chunks = seq_chunks("q", q, seq)
    k_chunks = seq_chunks("k", k, seq)
    _same_chunks("v", seq_chunks("v", v, seq), "k", k_chunks)
    for name in ("do", "o", "lse"):
        _same_chunks(name, seq_chunks(name, arrays[name], seq), "q", q_chunks)
    if zigzag:
        _zigzag_chunks("q", q_chunks)
        _zigzag_chunks("k", k_chunks)
    return tuple(g.dtype for g in grads), q_chunks, k_chunks
