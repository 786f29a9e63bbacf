"""What the tasks of a flashport.dask graph run: plain functions of NumPy
arrays and :class:`Resident` chunks (no Dask here), importable by worker
processes.

Where a task's device is a GPU (``device="gpu"``/``"gpu:N"``, or ``None``
on a worker whose ``$FLASHPORT_DEVICE`` names one, as on
:func:`flashport.dask.gpu_cluster`), the graph keeps its arrays on that
GPU: :func:`stage` uploads each input chunk once, as one
:class:`flashport.DeviceArray` per piece, the blocks compute on those and
return their states there, and the forward's merges run there too. Data
crosses the host only where a chunk goes to another worker (a
:class:`Resident` pickles as NumPy: DeviceArrays never pickle), where the
graph's results are read (:func:`to_host`), and where the backward's
gradient shares are summed (flashport has no device-side add). Elsewhere
(the CPU, ``"auto"``, dtypes the GPU does not keep) the tasks take and
return NumPy arrays.

Every sum and merge takes its parts in the order it is given them, and the
graph gives them in a fixed order, so results do not depend on which task
finishes first or where it ran.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

import flashport

from ._layout import Piece

__all__ = [
    "TRANSFERS",
    "Block",
    "Options",
    "Resident",
    "add",
    "backward_block",
    "backward_ring_block",
    "dsinks_part",
    "forward_block",
    "forward_no_keys",
    "forward_ring_block",
    "merge",
    "stage",
    "to_host",
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


# Host <-> GPU crossings the tasks make themselves, by kind: "upload" and
# "download" (calls) and "upload_bytes" and "download_bytes", per process.
# NumPy-path calls (on the CPU or "auto") cross inside flashport and are
# not counted here. Tests and benchmarks read it; nothing depends on it.
TRANSFERS: Counter[str] = Counter()

# The dtypes a DeviceArray keeps.
_RESIDENT_DTYPES = (np.dtype(np.float16), np.dtype(np.float32))


def _download(x: Any) -> np.ndarray:
    """``x`` as a NumPy array (a DeviceArray read back, counted)."""
    if isinstance(x, flashport.DeviceArray):
        TRANSFERS["download"] += 1
        TRANSFERS["download_bytes"] += x.nbytes
        return x.numpy()
    return np.asarray(x)


def _upload(x: Any, gpu: str) -> flashport.DeviceArray:
    """``x`` on ``gpu``: a DeviceArray there as it is, anything else copied
    (through the host from another GPU), counted."""
    if isinstance(x, flashport.DeviceArray):
        moved = x.to(gpu)
        if moved is not x:
            TRANSFERS["download"] += 1
            TRANSFERS["download_bytes"] += x.nbytes
            TRANSFERS["upload"] += 1
            TRANSFERS["upload_bytes"] += x.nbytes
        return moved
    x = np.ascontiguousarray(x)
    TRANSFERS["upload"] += 1
    TRANSFERS["upload_bytes"] += x.nbytes
    return flashport.to_device(x, gpu)


class Resident:
    """A chunk (or a block's state) as its pieces on one worker's GPU: one
    array per piece of its layout, in order (a :class:`flashport.DeviceArray`
    each, or NumPy once it crossed to another process).

    DeviceArrays do not pickle, and must not: a worker's GPU memory means
    nothing to another process. A ``Resident`` that Dask moves to another
    worker (or spills) pickles as NumPy, read back here explicitly, and the
    task that receives it uploads it to its own GPU."""

    __slots__ = ("parts",)

    def __init__(self, parts: Any) -> None:
        self.parts = tuple(parts)

    def __reduce__(self) -> tuple:
        return (Resident, (tuple(_download(p) for p in self.parts),))

    @property
    def nbytes(self) -> int:
        return sum(int(p.nbytes) for p in self.parts)

    def on(self, gpu: str) -> list[flashport.DeviceArray]:
        return [_upload(p, gpu) for p in self.parts]

    def host(self, axis: int) -> np.ndarray:
        """The whole chunk as one NumPy array, pieces joined along ``axis``."""
        parts = [_download(p) for p in self.parts]
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=axis)

    def __repr__(self) -> str:
        return f"Resident({', '.join(repr(p) for p in self.parts)})"


try:  # Dask's memory accounting and placement read the bytes held.
    from dask.sizeof import sizeof as _sizeof

    @_sizeof.register(Resident)
    def _sizeof_resident(x: Resident) -> int:
        return x.nbytes + 64

except ImportError:  # pragma: no cover - flashport.dask needs Dask anyway
    pass


def gpu_of(options: Options) -> str | None:
    """The GPU the tasks keep their arrays on: ``device`` when it names one,
    ``$FLASHPORT_DEVICE`` when ``device`` is None and that names one (a
    :func:`flashport.dask.gpu_cluster` worker), else None (NumPy tasks:
    the CPU, or ``"auto"``'s choice per call)."""
    device = options.device
    if device is None:
        device = os.environ.get("FLASHPORT_DEVICE", "").strip() or None
    return device if device is not None and device.startswith("gpu") else None


def _mode(options: Options, x: Any) -> str | None:
    """This task's GPU (see :func:`gpu_of`), or None for NumPy: also for
    a dtype the GPU does not keep (float64; bfloat16, widened per call)."""
    if isinstance(x, Resident):
        return gpu_of(options) or None
    dtype = np.dtype(x.dtype)
    return gpu_of(options) if dtype in _RESIDENT_DTYPES else None


def _host(x: Any, axis: int = -2) -> np.ndarray:
    return x.host(axis) if isinstance(x, Resident) else x


def stage(x: np.ndarray, pieces: tuple[Piece, ...], axis: int, options: Options) -> Any:
    """An input chunk as the graph's tasks take it: on a GPU, its pieces
    uploaded once (a :class:`Resident`) for every block that reads it; else
    the NumPy chunk itself."""
    gpu = _mode(options, x)
    if gpu is None:
        return x
    return Resident(_upload(_rows(x, p, axis), gpu) for p in pieces)


def to_host(state: Any, slot: int, axis: int) -> np.ndarray:
    """An output chunk, ``state[slot]``, as NumPy (pieces joined)."""
    return _host(state[slot], axis)


def _on(x: Any, pieces: tuple[Piece, ...], used: set[int], axis: int, gpu: str) -> dict:
    """The used pieces of ``x`` (Resident or NumPy) on ``gpu``."""
    if isinstance(x, Resident):
        return {i: _upload(x.parts[i], gpu) for i in sorted(used)}
    return {i: _upload(_rows(x, pieces[i], axis), gpu) for i in sorted(used)}


def _empty_keys(q: Any, k_shape: tuple[int, ...], v_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Zero-length k and v for ``q``: a call that sees no key."""
    k = np.empty((*k_shape[:-2], 0, k_shape[-1]), dtype=q.dtype)
    v = np.empty((*k_shape[:-2], 0, v_dim), dtype=q.dtype)
    return k, v


def _pieces(x: np.ndarray, pieces: tuple[Piece, ...], used: set[int], axis: int = -2) -> dict:
    """The rows of each used piece, sliced once."""
    return {i: _rows(x, pieces[i], axis) for i in sorted(used)}


def forward_block(q: Any, k: Any, v: Any, block: Block, options: Options) -> tuple[Any, Any]:
    """The attention of one query chunk over one key chunk, ``(o, lse)``:
    one flashport call per visible piece pair, at its global positions.
    A query piece that sees several key pieces merges them; one that sees
    none gets ``o = 0``, ``lse = −inf`` from a call over no keys. On a GPU
    the state stays there, one array per query piece (two Residents)."""
    gpu = _mode(options, q)
    if gpu is not None:
        return _forward_block_gpu(q, k, v, block, options, gpu)
    q, k, v = _host(q), _host(k), _host(v)
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


def _shape(x: Any, pieces: tuple[Piece, ...]) -> tuple[int, ...]:
    """The chunk's shape (a Resident's pieces joined)."""
    if isinstance(x, Resident):
        return (*x.parts[0].shape[:-2], sum(p.length for p in pieces), x.parts[0].shape[-1])
    return tuple(x.shape)


def _forward_block_gpu(
    q: Any, k: Any, v: Any, block: Block, options: Options, gpu: str
) -> tuple[Resident, Resident]:
    kw = options.kwargs()
    used = {b for _, b in block.pairs}
    qs = _on(q, block.q_pieces, set(range(len(block.q_pieces))), -2, gpu)
    ks = _on(k, block.k_pieces, used, -2, gpu)
    vs = _on(v, block.k_pieces, used, -2, gpu)
    outs, lses = [], []
    for a, qp in enumerate(block.q_pieces):
        parts = [
            flashport.attention(
                qs[a],
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
            k_shape, v_dim = _shape(k, block.k_pieces), _shape(v, block.k_pieces)[-1]
            k0, v0 = (_upload(x, gpu) for x in _empty_keys(qs[a], k_shape, v_dim))
            parts = [
                flashport.attention(
                    qs[a], k0, v0, scale=options.scale, device=options.device, return_lse=True
                )
            ]
        if len(parts) == 1:
            o, lse = parts[0]
        else:
            o, lse = flashport.merge_states(
                [p[0] for p in parts], [p[1] for p in parts], device=gpu
            )
        outs.append(o)
        lses.append(lse)
    return Resident(outs), Resident(lses)


def forward_ring_block(
    q: Any,
    k: Any,
    v: Any,
    carry: tuple[Any, Any] | None,
    block: Block,
    options: Options,
) -> tuple[Any, Any]:
    """``schedule="ring"``: this block's ``(o, lse)`` merged into the state
    the query chunk's previous block (in ring order) passed on, in that
    order: ``merge(carry, own)``."""
    own = forward_block(q, k, v, block, options)
    return own if carry is None else merge(carry, own, options=options)


def forward_no_keys(
    q: np.ndarray,
    k_shape: tuple[int, ...],
    v_dim: int,
    sinks: np.ndarray | None,
    options: Options,
    pieces: tuple[Piece, ...] | None = None,
) -> tuple[Any, Any]:
    """A query chunk's state over no keys: with ``sinks``, the sinks' own
    share of the softmax (``o = 0``, ``lse = sink``), merged in once per
    query chunk; without, ``o = 0``, ``lse = −inf`` for a chunk that no
    block reaches. Computed by flashport itself, on zero-length keys (on a
    GPU, uploaded as the blocks' states are: per piece of ``pieces``)."""
    gpu = _mode(options, q)
    q = np.ascontiguousarray(_host(q))
    k, v = _empty_keys(q, k_shape, v_dim)
    out, lse = flashport.attention(
        q, k, v, sinks=sinks, scale=options.scale, device=options.device, return_lse=True
    )
    if gpu is None or pieces is None:
        return out, lse
    return (
        Resident(_upload(_rows(out, p, -2), gpu) for p in pieces),
        Resident(_upload(_rows(lse, p, -1), gpu) for p in pieces),
    )


def merge(*states: tuple[Any, Any], options: Options | None = None) -> tuple[Any, Any]:
    """``merge_states`` of ``(o, lse)`` parts, in the order given. Host
    arrays merge on the CPU (``merge_states`` reads each value once);
    Resident states merge on the task's GPU, piece by piece, and stay
    there."""
    gpu = None
    if options is not None and all(isinstance(s[0], Resident) for s in states):
        gpu = gpu_of(options)
    if gpu is not None:
        outs, lses = [], []
        for p in range(len(states[0][0].parts)):
            out, lse = flashport.merge_states(
                [_upload(s[0].parts[p], gpu) for s in states],
                [_upload(s[1].parts[p], gpu) for s in states],
                device=gpu,
            )
            outs.append(out)
            lses.append(lse)
        return Resident(outs), Resident(lses)
    outs_h = [_host(s[0], -2) for s in states]
    lses_h = [_host(s[1], -1) for s in states]
    out, lse = flashport.merge_states(outs_h, lses_h, device="cpu")
    return np.asarray(out), np.asarray(lse)


def backward_block(
    do: Any,
    q: Any,
    k: Any,
    v: Any,
    o: Any,
    lse: Any,
    block: Block,
    options: Options,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One block's share of dQ and its dK, dV (in the accumulation dtype):
    per visible piece pair, flashport's backward with the **global** ``o``
    and ``lse`` of the query rows and the pair's positions; each query
    piece's dQ summed over its key pieces in order, each key piece's dK, dV
    over its query pieces in order. Pieces no pair reaches get zeros. On a
    GPU the inputs are used where they are (Resident, uploaded once per
    chunk) and the shares are read back for the sums."""
    kw = options.kwargs()
    q_used, k_used = {a for a, _ in block.pairs}, {b for _, b in block.pairs}
    gpu = _mode(options, q)
    if gpu is not None:
        dos, qs, os_ = (_on(x, block.q_pieces, q_used, -2, gpu) for x in (do, q, o))
        lses = _on(lse, block.q_pieces, q_used, -1, gpu)
        ks, vs = (_on(x, block.k_pieces, k_used, -2, gpu) for x in (k, v))
    else:
        do, q, k, v, o = (_host(x) for x in (do, q, k, v, o))
        lse = _host(lse, -1)
        dos, qs, os_ = (_pieces(x, block.q_pieces, q_used) for x in (do, q, o))
        lses = _pieces(lse, block.q_pieces, q_used, axis=-1)
        ks, vs = (_pieces(x, block.k_pieces, k_used) for x in (k, v))
    q_shape, k_shape = _shape(q, block.q_pieces), _shape(k, block.k_pieces)
    v_shape = _shape(v, block.k_pieces)
    acc = accumulation_dtype(qs[min(q_used)].dtype)
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
        dq[a].append(_download(g[0]))
        dk[b].append(_download(g[1]))
        dv[b].append(_download(g[2]))

    def gather(parts: list[list[np.ndarray]], like: tuple[int, ...], pieces: tuple[Piece, ...]):
        sums = [
            (p[0] if len(p) == 1 and p[0].dtype == acc else add(*p, dtype=acc))
            if p
            else np.zeros((*like[:-2], piece.length, like[-1]), acc)
            for p, piece in zip(parts, pieces, strict=True)
        ]
        return sums[0] if len(sums) == 1 else np.concatenate(sums, axis=-2)

    return (
        gather(dq, q_shape, block.q_pieces),
        gather(dk, k_shape, block.k_pieces),
        gather(dv, v_shape, block.k_pieces),
    )


def backward_ring_block(
    do: Any,
    q: Any,
    k: Any,
    v: Any,
    o: Any,
    lse: Any,
    dq_carry: np.ndarray | None,
    dk_carry: np.ndarray | None,
    dv_carry: np.ndarray | None,
    block: Block,
    options: Options,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``schedule="ring"``: this block's shares added to the running sums
    its row's previous block (dQ) and its column's previous block (dK, dV)
    passed on, ``carry + share``, in the accumulation dtype. The carries are
    not modified (another task may still read them)."""
    shares = backward_block(do, q, k, v, o, lse, block, options)
    carries = (dq_carry, dk_carry, dv_carry)
    dq, dk, dv = (s if c is None else c + s for c, s in zip(carries, shares, strict=True))
    return dq, dk, dv


def dsinks_part(
    do: Any,
    q: Any,
    o: Any,
    lse: Any,
    k_shape: tuple[int, ...],
    sinks: np.ndarray,
    options: Options,
) -> np.ndarray:
    """The gradient of ``sinks`` from one query chunk's rows: it depends on
    ``do``, ``o`` and ``lse`` only, so flashport's backward over zero-length
    keys computes it."""
    do, q, o = (np.ascontiguousarray(_host(x)) for x in (do, q, o))
    lse = np.ascontiguousarray(_host(lse, -1))
    k, v = _empty_keys(q, k_shape, o.shape[-1])
    grads = flashport.attention_backward(
        do, q, k, v, o, lse, sinks=sinks, scale=options.scale, device=options.device
    )
    return grads[3]


def add(*parts: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``parts[0] + parts[1] + …`` left to right, in the accumulation dtype
    of ``dtype``, returned as ``dtype``."""
    acc = np.result_type(accumulation_dtype(np.dtype(dtype)), parts[0].dtype)
    total = np.array(parts[0], dtype=acc, copy=True)
    for p in parts[1:]:
        total += p
    return total.astype(dtype, copy=False)


def zeros(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """The gradient of a key chunk (or a query chunk) that no block reaches."""
    return np.zeros(shape, dtype)
