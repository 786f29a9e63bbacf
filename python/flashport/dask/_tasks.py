"""What the tasks of a flashport.dask graph run: plain functions of NumPy
arrays (no Dask here), importable by worker processes.

Every sum and merge takes its parts in the order it is given them, and the
graph gives them in a fixed order, so results do not depend on which task
finishes first or where it ran.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

import flashport
from flashport import _core

from ._layout import Piece

__all__ = [
    "Block",
    "Options",
    "add",
    "backward_block",
    "backward_ring_block",
    "dsinks_part",
    "forward_block",
    "forward_no_keys",
    "forward_ring_block",
    "merge",
    "zeros",
]


@dataclass(frozen=True)
class Options:
    """The keywords every call of the graph passes to flashport. A frozen
    object (not a dict or tuple), so Dask never looks inside it for keys."""

    causal: bool
    scale: float | None
    window: tuple[int | None, int | None] | None
    alibi_slopes: np.ndarray | None
    softcap: float | None
    device: str | None

    def kwargs(self) -> dict[str, Any]:
        return {
            "causal": self.causal,
            "scale": self.scale,
            "window": self.window,
            "alibi_slopes": self.alibi_slopes,
            "softcap": self.softcap,
            "device": self.device,
        }


@dataclass(frozen=True)
class Block:
    """One (query chunk, key chunk) block: the chunks' pieces and the piece
    pairs that see each other (at least one). ``q_offset`` is the position
    of query row 0 of the whole sequence."""

    q_pieces: tuple[Piece, ...]
    k_pieces: tuple[Piece, ...]
    pairs: tuple[tuple[int, int], ...]
    q_offset: int


def accumulation_dtype(dtype: np.dtype) -> np.dtype:
    """Gradients are summed in float32 for float16 and bfloat16 problems
    (and rounded once, at the end), in their own dtype otherwise."""
    dtype = np.dtype(dtype)
    return np.dtype(np.float32) if dtype.name in ("float16", "bfloat16") else dtype


def _rows(x: np.ndarray, piece: Piece, axis: int) -> np.ndarray:
    """The piece's rows of a chunk, C-contiguous. A chunk of a larger array
    (``dask.array.from_array`` hands out views) or a piece of a chunk is
    strided; the binding copies such an array element by element, which
    measured twice as slow as the whole call at (1, 8, 1024, 64), while
    NumPy copies it row by row."""
    index = [slice(None)] * x.ndim
    index[axis] = slice(piece.start, piece.start + piece.length)
    return np.ascontiguousarray(x[tuple(index)])


def _empty_keys(
    q: np.ndarray, k_shape: tuple[int, ...], v_dim: int
) -> tuple[np.ndarray, np.ndarray]:
    """Zero-length k and v for ``q``: a call that sees no key."""
    k = np.empty((*k_shape[:-2], 0, k_shape[-1]), dtype=q.dtype)
    v = np.empty((*k_shape[:-2], 0, v_dim), dtype=q.dtype)
    return k, v


def _pieces(x: np.ndarray, pieces: tuple[Piece, ...], used: set[int], axis: int = -2) -> dict:
    """The rows of each used piece, sliced once."""
    return {i: _rows(x, pieces[i], axis) for i in sorted(used)}


def forward_block(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, block: Block, options: Options
) -> tuple[np.ndarray, np.ndarray]:
    """The attention of one query chunk over one key chunk, ``(o, lse)``:
    one flashport call per visible piece pair, at its global positions.
    A query piece that sees several key pieces merges them; one that sees
    none gets ``o = 0``, ``lse = −inf`` from a call over no keys."""
    kw = options.kwargs()
    used = {b for _, b in block.pairs}
    ks, vs = _pieces(k, block.k_pieces, used), _pieces(v, block.k_pieces, used)
    outs, lses = [], []
    for a, qp in enumerate(block.q_pieces):
        q_a = _rows(q, qp, -2)
        parts = [
            flashport.attention(
                q_a,
                ks[b],
                vs[b],
                q_offset=block.q_offset + qp.position,
                k_offset=block.k_pieces[b].position,
                return_lse=True,
                **kw,
            )
            for pa, b in block.pairs
            if pa == a
        ]
        if not parts:
            k0, v0 = _empty_keys(q_a, k.shape, v.shape[-1])
            parts = [
                flashport.attention(
                    q_a, k0, v0, scale=options.scale, device=options.device, return_lse=True
                )
            ]
        o, lse = parts[0] if len(parts) == 1 else merge(*parts)
        outs.append(o)
        lses.append(lse)
    if len(outs) == 1:
        return outs[0], lses[0]
    return np.concatenate(outs, axis=-2), np.concatenate(lses, axis=-1)


def forward_ring_block(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    carry: tuple[np.ndarray, np.ndarray] | None,
    block: Block,
    options: Options,
) -> tuple[np.ndarray, np.ndarray]:
    """``schedule="ring"``: this block's ``(o, lse)`` merged into the state
    the query chunk's previous block (in ring order) passed on, in that
    order: ``merge(carry, own)``."""
    own = forward_block(q, k, v, block, options)
    return own if carry is None else merge(carry, own)


def forward_no_keys(
    q: np.ndarray,
    k_shape: tuple[int, ...],
    v_dim: int,
    sinks: np.ndarray | None,
    options: Options,
) -> tuple[np.ndarray, np.ndarray]:
    """A query chunk's state over no keys: with ``sinks``, the sinks' own
    share of the softmax (``o = 0``, ``lse = sink``), merged in once per
    query chunk; without, ``o = 0``, ``lse = −inf`` for a chunk that no
    block reaches. Computed by flashport itself, on zero-length keys."""
    q = np.ascontiguousarray(q)
    k, v = _empty_keys(q, k_shape, v_dim)
    out, lse = flashport.attention(
        q, k, v, sinks=sinks, scale=options.scale, device=options.device, return_lse=True
    )
    return out, lse


def merge(*states: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """``merge_states`` of ``(o, lse)`` parts, in the order given. Host
    arrays merge on the CPU (``merge_states`` reads each value once)."""
    out, lse = flashport.merge_states([s[0] for s in states], [s[1] for s in states], device="cpu")
    return np.asarray(out), np.asarray(lse)


def backward_block(
    do: np.ndarray,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    o: np.ndarray,
    lse: np.ndarray,
    block: Block,
    options: Options,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One block's share of dQ and its dK, dV (in flashport's dtype, or the
    accumulation dtype where a piece's share is already a sum):
    per visible piece pair, flashport's backward with the **global** ``o``
    and ``lse`` of the query rows and the pair's positions; each query
    piece's dQ summed over its key pieces in order, each key piece's dK, dV
    over its query pieces in order. Pieces no pair reaches get zeros."""
    kw = options.kwargs()
    acc = accumulation_dtype(q.dtype)
    q_used, k_used = {a for a, _ in block.pairs}, {b for _, b in block.pairs}
    dos, qs, os_ = (_pieces(x, block.q_pieces, q_used) for x in (do, q, o))
    lses = _pieces(lse, block.q_pieces, q_used, axis=-1)
    ks, vs = (_pieces(x, block.k_pieces, k_used) for x in (k, v))
    dq: list[list[np.ndarray]] = [[] for _ in block.q_pieces]
    dk: list[list[np.ndarray]] = [[] for _ in block.k_pieces]
    dv: list[list[np.ndarray]] = [[] for _ in block.k_pieces]
    for a, b in block.pairs:
        g = flashport.attention_backward(
            dos[a],
            qs[a],
            ks[b],
            vs[b],
            os_[a],
            lses[a],
            q_offset=block.q_offset + block.q_pieces[a].position,
            k_offset=block.k_pieces[b].position,
            **kw,
        )
        dq[a].append(g[0])
        dk[b].append(g[1])
        dv[b].append(g[2])

    def gather(parts: list[list[np.ndarray]], like: np.ndarray, pieces: tuple[Piece, ...]):
        # A piece's lone share stays in flashport's dtype: the sums that
        # take it (``add``, ``backward_ring_block``) widen it to the
        # accumulation dtype exactly, so converting it here would only copy
        # it and double its bytes in memory and between workers.
        sums = [
            (p[0] if len(p) == 1 else add(*p, dtype=acc))
            if p
            else np.zeros((*like.shape[:-2], piece.length, like.shape[-1]), acc)
            for p, piece in zip(parts, pieces, strict=True)
        ]
        if len(sums) == 1:
            return sums[0]
        # Pieces of mixed dtypes (a sum beside a lone share) concatenate in
        # the wider one, which holds both exactly.
        return np.concatenate(sums, axis=-2, dtype=np.result_type(*sums))

    return (
        gather(dq, q, block.q_pieces),
        gather(dk, k, block.k_pieces),
        gather(dv, v, block.k_pieces),
    )


def backward_ring_block(
    do: np.ndarray,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    o: np.ndarray,
    lse: np.ndarray,
    dq_carry: np.ndarray | None,
    dk_carry: np.ndarray | None,
    dv_carry: np.ndarray | None,
    block: Block,
    options: Options,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``schedule="ring"``: this block's shares added to the running sums
    its row's previous block (dQ) and its column's previous block (dK, dV)
    passed on, ``carry + share``, in the accumulation dtype (a chain's
    first share stays as the block gave it). The carries are not modified
    (another task may still read them)."""
    shares = backward_block(do, q, k, v, o, lse, block, options)
    carries = (dq_carry, dk_carry, dv_carry)
    acc = accumulation_dtype(q.dtype)
    dq, dk, dv = (
        s if c is None else add(c, s, dtype=np.result_type(acc, c.dtype, s.dtype))
        for c, s in zip(carries, shares, strict=True)
    )
    return dq, dk, dv


def dsinks_part(
    do: np.ndarray,
    q: np.ndarray,
    o: np.ndarray,
    lse: np.ndarray,
    k_shape: tuple[int, ...],
    sinks: np.ndarray,
    options: Options,
) -> np.ndarray:
    """The gradient of ``sinks`` from one query chunk's rows: it depends on
    ``do``, ``o`` and ``lse`` only, so flashport's backward over zero-length
    keys computes it."""
    do, q, o, lse = (np.ascontiguousarray(x) for x in (do, q, o, lse))
    k, v = _empty_keys(q, k_shape, o.shape[-1])
    grads = flashport.attention_backward(
        do, q, k, v, o, lse, sinks=sinks, scale=options.scale, device=options.device
    )
    return grads[3]


_HALF = ("float16", "bfloat16")
_WIDENED = (*_HALF, "float32")


def add(*parts: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``parts[0] + parts[1] + …`` left to right, in the accumulation dtype
    of ``dtype`` (or wider, for wider parts), returned as ``dtype``. A lone
    part already in ``dtype`` is returned as it is; the parts are never
    modified (another task may still read them)."""
    dtype = np.dtype(dtype)
    if len(parts) == 1 and parts[0].dtype == dtype:
        return parts[0]
    acc = np.result_type(accumulation_dtype(dtype), *(p.dtype for p in parts))
    names = {dtype.name, *(p.dtype.name for p in parts)}
    if len(parts) > 1 and acc == np.float32 and names <= set(_WIDENED) and names & set(_HALF):
        # Float16 or bfloat16 in or out: flashport's core sums the same
        # way in one pass, with NumPy's bits (tests/test_dask_sums.py).
        # NumPy's float16 casts cost 1.5 ns an element: on an H200 the 12
        # sums of a (1, 16, 65536, 64) graph took 2.0 s of host work, twice
        # the single flashport call. Float32 alone NumPy adds as fast.
        return _core.sum_widened(list(parts), dtype.name)
    if len(parts) == 1:
        total = np.array(parts[0], dtype=acc, copy=True)
    else:
        # The first sum writes a new array: no copy of parts[0] first.
        total = np.add(parts[0], parts[1], dtype=acc)
        for p in parts[2:]:
            total += p
    return total.astype(dtype, copy=False)


def zeros(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """The gradient of a key chunk (or a query chunk) that no block reaches."""
    return np.zeros(shape, dtype)
