"""Where each chunk's rows sit in the sequence, and which (query chunk, key
chunk) blocks causal attention or a sliding window leaves visible: pure
functions of integers, no Dask and no arrays.

A chunk is a tuple of :class:`Piece` s: runs of rows that are contiguous in
the sequence. An ordinary chunking has one piece per chunk; the zig-zag
layout (:func:`zigzag_layout`) has two, piece ``r`` and piece ``2W − 1 − r``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "Piece",
    "block_pairs",
    "contiguous_layout",
    "pieces_see",
    "ring_orders",
    "zigzag_index",
    "zigzag_layout",
    "zigzag_piece_sizes",
]


@dataclass(frozen=True)
class Piece:
    """``length`` rows starting at row ``start`` of their chunk, which are
    rows ``position ..`` of the whole sequence (before any offset)."""

    start: int
    position: int
    length: int


Layout = tuple[tuple[Piece, ...], ...]


def contiguous_layout(chunks: Sequence[int]) -> Layout:
    """One piece per chunk, in sequence order: the layout of any ordinary
    chunking."""
    starts = itertools.accumulate(chunks, initial=0)
    return tuple((Piece(0, start, size),) for start, size in zip(starts, chunks, strict=False))


def zigzag_piece_sizes(n: int, workers: int) -> list[int]:
    """The ``2 · workers`` pieces that cut a sequence of ``n`` rows, as equal
    as can be (the first ``n mod 2W`` get one row more, like
    ``numpy.array_split``)."""
    parts = 2 * workers
    base, extra = divmod(n, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def zigzag_layout(n: int, workers: int) -> Layout:
    """Chunk ``r`` holds piece ``r`` then piece ``2W − 1 − r`` of the
    sequence: the head and tail pairing of Megatron-LM's context parallelism
    and of torch's ``_HeadTailLoadBalancer``."""
    sizes = zigzag_piece_sizes(n, workers)
    starts = list(itertools.accumulate(sizes, initial=0))
    layout = []
    for r in range(workers):
        head, tail = r, 2 * workers - 1 - r
        layout.append(
            (
                Piece(0, starts[head], sizes[head]),
                Piece(sizes[head], starts[tail], sizes[tail]),
            )
        )
    return tuple(layout)


def zigzag_index(n: int, workers: int) -> list[int]:
    """The permutation of the zig-zag order: ``x[..., index, :]`` is ``x``
    in that order, and its inverse (``numpy.argsort(index)``) restores it."""
    index: list[int] = []
    for chunk in zigzag_layout(n, workers):
        for piece in chunk:
            index.extend(range(piece.position, piece.position + piece.length))
    return index


def pieces_see(
    q_first: int,
    q_length: int,
    k_first: int,
    k_length: int,
    causal: bool,
    window: tuple[int | None, int | None] | None,
) -> bool:
    """Whether any query of the rows at positions ``q_first ..
    q_first + q_length − 1`` sees any key at ``k_first .. k_first + k_length − 1``.

    Positions are global (the query offset already added): query at ``p``
    sees key at ``t`` when ``t ≤ p`` (causal) and ``p − left ≤ t ≤ p + right``
    (window; ``None`` is unbounded), flashport's rules for ``q_offset`` and
    ``k_offset``. Over the block, ``t − p`` runs through every integer from
    ``k_first − q_last`` to ``k_last − q_first``; the block is visible when
    that range meets the allowed band ``[−left, right]``."""
    if q_length <= 0 or k_length <= 0:
        return False
    left, right = window if window is not None else (None, None)
    if causal:
        right = 0 if right is None else min(right, 0)
    lowest = k_first - (q_first + q_length - 1)  # min of t − p
    highest = (k_first + k_length - 1) - q_first  # max of t − p
    if right is not None and lowest > right:
        return False
    return not (left is not None and highest < -left)


def block_pairs(
    q_chunk: tuple[Piece, ...],
    k_chunk: tuple[Piece, ...],
    q_offset: int,
    causal: bool,
    window: tuple[int | None, int | None] | None,
) -> tuple[tuple[int, int], ...]:
    """The (query piece, key piece) pairs of one block that see each other,
    in order; empty when causal or the window hide the whole block (which
    then gets no task). ``q_offset`` is the position of query row 0 (keys
    start at 0): flashport's default, ``seq_k − seq_q``, aligns the two ends."""
    return tuple(
        (a, b)
        for a, qp in enumerate(q_chunk)
        for b, kp in enumerate(k_chunk)
        if pieces_see(q_offset + qp.position, qp.length, kp.position, kp.length, causal, window)
    )


def ring_orders(
    visible: set[tuple[int, int]], q_chunks: int, k_chunks: int
) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """The order in which ``schedule="ring"`` chains the visible blocks: for
    each query chunk ``i`` its key chunks, for each key chunk ``j`` its query
    chunks. Block ``(i, j)`` belongs to step ``(j − start_i) mod k_chunks``,
    ``start_i = i · k_chunks // q_chunks``: query chunk ``i`` meets the key
    chunks from ``start_i`` on, cyclically, as a ring of workers passes K and
    V along, and each key chunk meets its query chunks by step (then by
    index). Every chain then runs forward in (step, query chunk), so the two
    together are acyclic; with equal chunk counts and every block visible,
    step ``s`` holds one block of each row and of each column."""

    def step(i: int, j: int) -> int:
        return (j - (i * k_chunks) // q_chunks) % k_chunks

    rows: dict[int, list[int]] = {}
    cols: dict[int, list[int]] = {}
    for i, j in visible:
        rows.setdefault(i, []).append(j)
        cols.setdefault(j, []).append(i)
    for i, js in rows.items():
        js.sort(key=lambda j: step(i, j))
    for j, is_ in cols.items():
        is_.sort(key=lambda i: (step(i, j), i))
    return rows, cols
