"""The public functions of flashport.dask: argument checks, then the graph."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, overload

import numpy as np
import numpy.typing as npt

from flashport import InvalidArgumentError

from . import _graph, _validate
from ._layout import Layout, contiguous_layout, zigzag_layout
from ._tasks import Options

if TYPE_CHECKING:
    import dask.array as da

__all__ = ["attention", "attention_backward"]

# "cpu", "gpu", "gpu:N" or "auto".
Device = str
Window = tuple[int | None, int | None]
Schedule = Literal["tree", "ring"]


def _schedule(schedule: Any) -> str:
    if schedule not in ("tree", "ring"):
        raise InvalidArgumentError(f'schedule={schedule!r}: expected "tree" or "ring"')
    return str(schedule)


def _window(window: Any) -> Window | None:
    """The window as the tasks and the visibility test take it, once the core
    has accepted it: ``None`` for an unbounded side (``-1`` too)."""
    if window is None:
        return None
    left, right = window
    return tuple(None if side is None or int(side) == -1 else int(side) for side in (left, right))  # type: ignore[return-value]


def _parameter(name: str, x: Any) -> np.ndarray | None:
    """``alibi_slopes`` and ``sinks``: small arrays every task gets a copy of
    (a dask array is computed here)."""
    if x is None:
        return None
    if hasattr(x, "compute") and hasattr(x, "dask"):
        x = x.compute()
    try:
        return np.array(x, copy=True)
    except (TypeError, ValueError) as error:
        raise InvalidArgumentError(f"{name}: expected an array, got {type(x).__name__}") from error


def _layouts(
    q_chunks: tuple[int, ...], k_chunks: tuple[int, ...], zigzag: bool
) -> tuple[Layout, Layout]:
    if zigzag:
        return (
            zigzag_layout(sum(q_chunks), len(q_chunks)),
            zigzag_layout(sum(k_chunks), len(k_chunks)),
        )
    return contiguous_layout(q_chunks), contiguous_layout(k_chunks)


def _keywords(
    causal: Any, scale: Any, window: Any, alibi_slopes: Any, softcap: Any, sinks: Any
) -> dict[str, Any]:
    """The variant keywords as given, for the validating call (which checks
    them, so that flashport.dask accepts exactly what flashport does), with
    the parameter arrays copied."""
    return {
        "causal": causal,
        "scale": scale,
        "window": window,
        "alibi_slopes": _parameter("alibi_slopes", alibi_slopes),
        "softcap": softcap,
        "sinks": _parameter("sinks", sinks),
    }


def _options(kwargs: dict[str, Any], device: Device | None) -> Options:
    """What every task passes to flashport, once the keywords are valid."""
    return Options(
        causal=bool(kwargs["causal"]),
        scale=None if kwargs["scale"] is None else float(kwargs["scale"]),
        window=_window(kwargs["window"]),
        alibi_slopes=kwargs["alibi_slopes"],
        softcap=None if kwargs["softcap"] is None else float(kwargs["softcap"]),
        device=device,
    )


@overload
def attention(
    q: da.Array,
    k: da.Array,
    v: da.Array,
    *,
    causal: bool = ...,
    scale: float | None = ...,
    window: Window | None = ...,
    alibi_slopes: npt.ArrayLike | None = ...,
    softcap: float | None = ...,
    sinks: npt.ArrayLike | None = ...,
    zigzag: bool = ...,
    schedule: Schedule = ...,
    return_lse: Literal[False] = ...,
    device: Device | None = ...,
) -> da.Array: ...
@overload
def attention(
    q: da.Array,
    k: da.Array,
    v: da.Array,
    *,
    causal: bool = ...,
    scale: float | None = ...,
    window: Window | None = ...,
    alibi_slopes: npt.ArrayLike | None = ...,
    softcap: float | None = ...,
    sinks: npt.ArrayLike | None = ...,
    zigzag: bool = ...,
    schedule: Schedule = ...,
    return_lse: Literal[True],
    device: Device | None = ...,
) -> tuple[da.Array, da.Array]: ...
def attention(
    q: da.Array,
    k: da.Array,
    v: da.Array,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: Window | None = None,
    alibi_slopes: npt.ArrayLike | None = None,
    softcap: float | None = None,
    sinks: npt.ArrayLike | None = None,
    zigzag: bool = False,
    schedule: Schedule = "tree",
    return_lse: bool = False,
    device: Device | None = None,
) -> da.Array | tuple[da.Array, da.Array]:
    """:func:`flashport.attention` over dask arrays chunked along the
    sequence: one task per (query chunk, key chunk) block that causal or the
    window leave visible, merged exactly by log-sum-exp.

    Arguments
    ---------
    q, k, v : dask arrays in flashport's layout
        ``(batch, heads_q, seq_q, d)``, ``(batch, heads_kv, seq_k, d)``,
        ``(batch, heads_kv, seq_k, d_v)`` (or unbatched, as for
        :func:`flashport.attention`; GQA alike), chunked along the sequence
        axis only. q and k may be chunked differently; v must be chunked
        like k.
    causal, scale, window, alibi_slopes, softcap, sinks
        As for :func:`flashport.attention`, on the whole sequence: causal and
        the window bottom-right aligned (query ``i`` at position
        ``seq_k − seq_q + i``, key ``j`` at ``j``). ``alibi_slopes`` and
        ``sinks`` are small arrays copied into every task that needs them.
    zigzag : bool
        q and k (each) are in the zig-zag order :func:`zigzag` makes; the
        results come back in that order too. For causal attention, every
        query chunk then has the same work.
    schedule : "tree" or "ring"
        How a query chunk's partial results are combined. ``"tree"``: every
        block is a task of its own and the states merge 4 at a time, in
        key-chunk order; the scheduler runs blocks in any order and balances
        them, but a block's result waits in memory until its group is
        complete. ``"ring"``: each block task merges its result into the
        state the query chunk's previous block passed on (and in the
        backward adds its dK, dV to its key chunk's running sums), in the
        order a ring of workers would meet the key chunks: a chain per query
        chunk (and per key chunk), so a worker holds O(chunk) at a time,
        but the blocks run in lock-step (balance causal work with
        ``zigzag=True``). Both are exact and bitwise reproducible; their
        results differ in rounding.
    return_lse : bool
        Also return the log-sum-exp (for :func:`attention_backward`).
    device : "cpu", "gpu", "gpu:N" or "auto", optional
        Passed to each task's flashport call, which resolves it where it
        runs: ``None`` follows flashport's rules on that worker
        (``$FLASHPORT_DEVICE``, else a hardware GPU where its cost model
        expects one to be faster, else the CPU). On a
        :func:`gpu_cluster` each worker's ``$FLASHPORT_DEVICE`` names its own
        GPU, so ``None`` and ``"gpu"`` put each block on its worker's GPU.

    Returns
    -------
    o : dask array ``(batch, heads_q, seq_q, d_v)``, chunked like q
    lse : dask array ``(batch, heads_q, seq_q)``, chunked like q along the
        sequence (only with ``return_lse=True``)

    Nothing is computed until the results are. Each task holds one query
    chunk and one key chunk (and a merge at most 4 partial results of one
    query chunk), never a whole sequence. The merges run in a fixed order,
    so the results are bitwise identical on any scheduler; they equal
    :func:`flashport.attention` to float rounding (not bitwise: a merge
    rounds differently from one call's online softmax).

    Raises
    ------
    InvalidArgumentError
        An argument that is not a dask array (wrap it with
        ``dask.array.from_array``), a bad ``device`` or ``schedule``; and as
        for :func:`flashport.attention`.
    ShapeError
        An array chunked along batch, heads or dim; v chunked unlike k;
        ``zigzag=True`` with chunks that are not a zig-zag layout; and the
        shape errors of :func:`flashport.attention`.
    DTypeError
        As for :func:`flashport.attention`.
    All raised here, when the graph is built.
    """
    _validate.dask_arrays("attention", q=q, k=k, v=v)
    _validate.check_device(device)
    chain = _schedule(schedule)
    kwargs = _keywords(causal, scale, window, alibi_slopes, softcap, sinks)
    out_dtype, lse_dtype, q_chunks, k_chunks = _validate.validated_forward(
        q, k, v, kwargs, bool(zigzag)
    )
    q_layout, k_layout = _layouts(q_chunks, k_chunks, bool(zigzag))
    options = _options(kwargs, device)
    sink_logits = kwargs["sinks"]
    o, lse = _graph.forward_graph(
        q,
        k,
        v,
        q_layout=q_layout,
        k_layout=k_layout,
        options=options,
        sinks=sink_logits,
        out_dtype=out_dtype,
        lse_dtype=lse_dtype,
        schedule=chain,
    )
    return (o, lse) if return_lse else o


def attention_backward(
    do: da.Array,
    q: da.Array,
    k: da.Array,
    v: da.Array,
    o: da.Array,
    lse: da.Array,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: Window | None = None,
    alibi_slopes: npt.ArrayLike | None = None,
    softcap: float | None = None,
    sinks: npt.ArrayLike | None = None,
    zigzag: bool = False,
    schedule: Schedule = "tree",
    device: Device | None = None,
) -> tuple[da.Array, ...]:
    """:func:`flashport.attention_backward` over dask arrays chunked along
    the sequence, ring attention's backward: each visible block calls
    flashport's backward with the **global** ``o`` and ``lse`` of its query
    rows and its positions, giving its key chunk's share of dK, dV and its
    query chunk's share of dQ.

    Arguments
    ---------
    do, o : dask arrays shaped like the output, chunked like q
    lse : dask array ``(batch, heads_q, seq_q)``, chunked like q along the
        sequence (as :func:`attention` returns it with ``return_lse=True``)
    q, k, v, causal, scale, window, alibi_slopes, softcap, sinks, zigzag, device
        Exactly as passed to :func:`attention`.
    schedule : "tree" or "ring"
        As for :func:`attention` (it need not be the forward's): ``"tree"``
        sums each gradient chunk's shares 4 at a time in index order;
        ``"ring"`` carries dQ along each query chunk's blocks and dK, dV
        along each key chunk's, inside the block tasks.

    Returns
    -------
    ``(dq, dk, dv)``, then ``dsinks`` (one chunk) when ``sinks`` is given:
    dask arrays, dq chunked like q, dk and dv like k. dQ of a query chunk is
    the sum of its blocks' shares over the key chunks, dK and dV of a key
    chunk the sum over the query chunks, each in index order (float16 is
    summed in float32 and rounded once), so the results are bitwise
    identical on any scheduler; they equal :func:`flashport.attention_backward`
    to float rounding. A chunk that no block reaches gets zeros.

    Raises
    ------
    As :func:`attention`; also ``ShapeError`` when do, o or lse are chunked
    unlike q, or have another number of rows.
    """
    _validate.dask_arrays("attention_backward", do=do, q=q, k=k, v=v, o=o, lse=lse)
    _validate.check_device(device)
    chain = _schedule(schedule)
    kwargs = _keywords(causal, scale, window, alibi_slopes, softcap, sinks)
    dtypes, q_chunks, k_chunks = _validate.validated_backward(
        do, q, k, v, o, lse, kwargs, bool(zigzag)
    )
    q_layout, k_layout = _layouts(q_chunks, k_chunks, bool(zigzag))
    options = _options(kwargs, device)
    sink_logits = kwargs["sinks"]
    return _graph.backward_graph(
        do,
        q,
        k,
        v,
        o,
        lse,
        q_layout=q_layout,
        k_layout=k_layout,
        options=options,
        sinks=sink_logits,
        dtypes=dtypes,
        schedule=chain,
    )
