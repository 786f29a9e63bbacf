"""The task graphs of flashport.dask, written out key by key.

Forward, for query chunk ``i`` and key chunk ``j``:

- ``flashport-attention-block-<token>, i, j``: ``(o, lse)`` of the chunk's
  queries over the block's keys; only for blocks that causal or the window
  leave visible (``_layout.block_pairs``);
- ``flashport-attention-nokeys-<token>, i``: with ``sinks``, or for a query
  chunk no block reaches, the state over no keys;
- ``flashport-attention-merge-<token>, i, level, n``: ``merge_states`` of up
  to ``SPLIT_EVERY`` states, in order, level by level, up to one state per
  query chunk;
- ``flashport-attention-o-<token>`` and ``-lse-<token>``: the outputs'
  chunks, taken from that state.

Backward: ``flashport-attention-backward-block-<token>, i, j`` gives one
block's share of dQ and its dK, dV; the sums run through
``…-dq-sum-…``, ``…-dk-sum-…``, ``…-dv-sum-…`` trees (over key chunks for dQ,
over query chunks for dK and dV, in index order) into ``…-dq-…``,
``…-dk-…``, ``…-dv-…``; ``…-dsinks-part-…`` and ``…-dsinks-…`` with sinks.

The order of every merge and sum is fixed by the graph, never by which
task finishes first: results are bitwise identical on any scheduler.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Hashable
from itertools import pairwise
from typing import Any

import dask.array as da
import numpy as np
from dask.base import tokenize
from dask.highlevelgraph import HighLevelGraph, MaterializedLayer

from . import _tasks
from ._layout import Layout, block_pairs, ring_orders
from ._tasks import Block, Options

__all__ = ["SPLIT_EVERY", "backward_graph", "forward_graph"]

# Parts per merge or sum task: each holds at most this many chunk-sized
# parts at once, and a query chunk's W parts take ceil(log_4 W) levels.
SPLIT_EVERY = 4

Key = tuple[Hashable, ...]


def _chunk_key(x: da.Array, i: int) -> Key:
    """The key of chunk ``i`` along the sequence axis of an array whose other
    axes are one chunk each (the sequence axis is the second to last, or
    the last for lse)."""
    lead = (0,) * (x.ndim - 2)
    return (x.name, *lead, i, 0)


def _lse_key(x: da.Array, i: int) -> Key:
    return (x.name, *((0,) * (x.ndim - 1)), i)


def _tree(
    dsk: dict,
    name: str,
    index: tuple[int, ...],
    leaves: list[Any],
    combine: Callable[..., Any],
    root_kwargs: dict[str, Any],
    node_kwargs: dict[str, Any],
) -> Any:
    """Combines ``leaves`` (keys or tasks) in order, ``SPLIT_EVERY`` at a
    time, level by level; returns the root's key (or the single leaf).
    ``combine(*parts, **kwargs)``: with ``root_kwargs`` at the root, with
    ``node_kwargs`` below it."""
    level = 0
    while len(leaves) > 1:
        groups = [leaves[g : g + SPLIT_EVERY] for g in range(0, len(leaves), SPLIT_EVERY)]
        kwargs = root_kwargs if len(groups) == 1 else node_kwargs
        parents = []
        for n, group in enumerate(groups):
            key = (name, *index, level, n)
            dsk[key] = _call(combine, *group, **kwargs)
            parents.append(key)
        leaves = parents
        level += 1
    return leaves[0]


def _call(function: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple:
    """A task calling ``function(*args, **kwargs)`` (keyword arguments through
    ``dask.utils.apply``, the graph format's way to pass them)."""
    if not kwargs:
        return (function, *args)
    from dask.utils import apply

    return (apply, function, list(args), (dict, [[k, v] for k, v in kwargs.items()]))


def _graph(name: str, dsk: dict, inputs: list[Any], outputs: dict[str, dict]) -> HighLevelGraph:
    """One layer of tasks (``name``) over the inputs, and one layer per
    output array that reads from it, so that each output culls on its own."""
    base = HighLevelGraph.from_collections(name, dsk, dependencies=list(inputs))
    layers = dict(base.layers)
    dependencies = dict(base.dependencies)
    for out_name, out_dsk in outputs.items():
        layers[out_name] = MaterializedLayer(out_dsk)
        dependencies[out_name] = {name}
    return HighLevelGraph(layers, dependencies)


def _meta(ndim: int, dtype: np.dtype) -> np.ndarray:
    return np.empty((0,) * ndim, dtype=dtype)


def _blocks(
    q_layout: Layout, k_layout: Layout, q_offset: int, options: Options
) -> dict[tuple[int, int], Block]:
    """The visible blocks, by (query chunk, key chunk)."""
    blocks = {}
    for i, q_chunk in enumerate(q_layout):
        for j, k_chunk in enumerate(k_layout):
            pairs = block_pairs(q_chunk, k_chunk, q_offset, options.causal, options.window)
            if pairs:
                blocks[i, j] = Block(q_chunk, k_chunk, pairs, q_offset)
    return blocks


def forward_graph(
    q: da.Array,
    k: da.Array,
    v: da.Array,
    *,
    q_layout: Layout,
    k_layout: Layout,
    options: Options,
    sinks: np.ndarray | None,
    out_dtype: np.dtype,
    lse_dtype: np.dtype,
    schedule: str,
) -> tuple[da.Array, da.Array]:
    seq_q, seq_k = q.shape[-2], k.shape[-2]
    q_offset = seq_k - seq_q
    token = tokenize(q.name, k.name, v.name, q_layout, k_layout, options, sinks, schedule)
    name = f"flashport-attention-{token}"
    block_name = f"flashport-attention-block-{token}"
    nokeys_name = f"flashport-attention-nokeys-{token}"
    merge_name = f"flashport-attention-merge-{token}"
    o_name = f"flashport-attention-o-{token}"
    lse_name = f"flashport-attention-lse-{token}"

    blocks = _blocks(q_layout, k_layout, q_offset, options)
    rows, _ = ring_orders(set(blocks), len(q_layout), len(k_layout))
    dsk: dict = {}
    o_dsk: dict = {}
    lse_dsk: dict = {}
    for i in range(len(q_layout)):
        leaves: list[Any] = []
        row = rows.get(i, []) if schedule == "ring" else sorted(rows.get(i, []))
        key: Key
        if sinks is not None or not row:
            key = (nokeys_name, i)
            dsk[key] = (
                _tasks.forward_no_keys,
                _chunk_key(q, i),
                k.shape,
                v.shape[-1],
                sinks,
                options,
            )
            leaves.append(key)
        if schedule == "ring":
            # A chain: each block merges its state into the one passed on.
            carry = leaves[0] if leaves else None
            for j in row:
                key = (block_name, i, j)
                dsk[key] = (
                    _tasks.forward_ring_block,
                    _chunk_key(q, i),
                    _chunk_key(k, j),
                    _chunk_key(v, j),
                    carry,
                    blocks[i, j],
                    options,
                )
                carry = key
            root = carry
        else:
            for j in row:
                key = (block_name, i, j)
                dsk[key] = (
                    _tasks.forward_block,
                    _chunk_key(q, i),
                    _chunk_key(k, j),
                    _chunk_key(v, j),
                    blocks[i, j],
                    options,
                )
                leaves.append(key)
            root = _tree(dsk, merge_name, (i,), leaves, _tasks.merge, {}, {})
        lead = (0,) * (q.ndim - 2)
        o_dsk[(o_name, *lead, i, 0)] = (operator.getitem, root, 0)
        lse_dsk[(lse_name, *lead, i)] = (operator.getitem, root, 1)

    graph = _graph(name, dsk, [q, k, v], {o_name: o_dsk, lse_name: lse_dsk})
    seq = (tuple(sum(p.length for p in chunk) for chunk in q_layout),)
    o_chunks = tuple((n,) for n in q.shape[:-2]) + seq + ((v.shape[-1],),)
    lse_chunks = tuple((n,) for n in q.shape[:-2]) + seq
    o = da.Array(graph, o_name, o_chunks, meta=_meta(q.ndim, out_dtype))
    lse = da.Array(graph, lse_name, lse_chunks, meta=_meta(q.ndim - 1, lse_dtype))
    return o, lse


def backward_graph(
    do: da.Array,
    q: da.Array,
    k: da.Array,
    v: da.Array,
    o: da.Array,
    lse: da.Array,
    *,
    q_layout: Layout,
    k_layout: Layout,
    options: Options,
    sinks: np.ndarray | None,
    dtypes: tuple[np.dtype, ...],
    schedule: str,
) -> tuple[da.Array, ...]:
    seq_q, seq_k = q.shape[-2], k.shape[-2]
    q_offset = seq_k - seq_q
    token = tokenize(do.name, q.name, k.name, v.name, o.name, lse.name)
    token = tokenize(token, q_layout, k_layout, options, sinks, schedule)
    prefix = "flashport-attention-backward"
    name = f"{prefix}-{token}"
    block_name = f"{prefix}-block-{token}"
    names = {g: f"{prefix}-{g}-{token}" for g in ("dq", "dk", "dv", "dsinks")}
    sums = {g: f"{prefix}-{g}-sum-{token}" for g in ("dq", "dk", "dv")}
    dsinks_part = f"{prefix}-dsinks-part-{token}"
    dq_dtype, dk_dtype, dv_dtype = dtypes[:3]
    acc = _tasks.accumulation_dtype(dq_dtype)

    blocks = _blocks(q_layout, k_layout, q_offset, options)
    row_order, col_order = ring_orders(set(blocks), len(q_layout), len(k_layout))
    if schedule == "ring":
        # Chains: dQ runs along each row, dK and dV along each column, in
        # ring order; every sum happens inside the block tasks.
        before_in_row = {(i, b): a for i, js in row_order.items() for a, b in pairwise(js)}
        before_in_col = {(b, j): a for j, is_ in col_order.items() for a, b in pairwise(is_)}
        row_order = {i: js[-1:] for i, js in row_order.items()}
        col_order = {j: is_[-1:] for j, is_ in col_order.items()}
    dsk: dict = {}
    for (i, j), block in blocks.items():
        args = (
            _chunk_key(do, i),
            _chunk_key(q, i),
            _chunk_key(k, j),
            _chunk_key(v, j),
            _chunk_key(o, i),
            _lse_key(lse, i),
        )
        if schedule == "ring":
            a = before_in_row.get((i, j))
            b = before_in_col.get((i, j))
            carries = (
                None if a is None else (operator.getitem, (block_name, i, a), 0),
                None if b is None else (operator.getitem, (block_name, b, j), 1),
                None if b is None else (operator.getitem, (block_name, b, j), 2),
            )
            dsk[(block_name, i, j)] = (_tasks.backward_ring_block, *args, *carries, block, options)
        else:
            dsk[(block_name, i, j)] = (_tasks.backward_block, *args, block, options)

    lead_q = q.shape[:-2]
    lead_k = k.shape[:-2]
    outputs: dict[str, dict] = {names[g]: {} for g in ("dq", "dk", "dv")}

    def reduce(
        grad: str, index: int, parts: list[Any], out_key: Key, shape: tuple, dtype: np.dtype
    ) -> None:
        """The output chunk ``out_key``: the sum of ``parts`` (block results,
        in index order) as ``dtype``, or zeros when no block reaches it."""
        if not parts:
            task: Any = (_tasks.zeros, shape, dtype)
        elif len(parts) == 1 and acc == dtype:
            task = parts[0]
        else:
            task = _tree(
                dsk, sums[grad], (index,), parts, _tasks.add, {"dtype": dtype}, {"dtype": acc}
            )
            if len(parts) == 1:
                task = _call(_tasks.add, task, dtype=dtype)
        outputs[names[grad]][out_key] = task

    zeros_lead = (0,) * (q.ndim - 2)
    for i, chunk in enumerate(q_layout):
        rows = sum(p.length for p in chunk)
        parts = [(operator.getitem, (block_name, i, j), 0) for j in sorted(row_order.get(i, []))]
        key = (names["dq"], *zeros_lead, i, 0)
        reduce("dq", i, parts, key, (*lead_q, rows, q.shape[-1]), dq_dtype)
    for j, chunk in enumerate(k_layout):
        rows = sum(p.length for p in chunk)
        for grad, slot, width, dtype in (
            ("dk", 1, k.shape[-1], dk_dtype),
            ("dv", 2, v.shape[-1], dv_dtype),
        ):
            parts = [
                (operator.getitem, (block_name, i, j), slot) for i in sorted(col_order.get(j, []))
            ]
            key = (names[grad], *zeros_lead, j, 0)
            reduce(grad, j, parts, key, (*lead_k, rows, width), dtype)

    if sinks is not None:
        sink_parts: list[Any] = []
        for i in range(len(q_layout)):
            key = (dsinks_part, i)
            dsk[key] = (
                _tasks.dsinks_part,
                _chunk_key(do, i),
                _chunk_key(q, i),
                _chunk_key(o, i),
                _lse_key(lse, i),
                k.shape,
                sinks,
                options,
            )
            sink_parts.append(key)
        dsinks_dtype = dtypes[3]
        root = _tree(
            dsk,
            f"{prefix}-dsinks-sum-{token}",
            (),
            sink_parts,
            _tasks.add,
            {"dtype": dsinks_dtype},
            {"dtype": np.dtype(np.float64)},
        )
        outputs[names["dsinks"]] = {(names["dsinks"], 0): root}

    graph = _graph(name, dsk, [do, q, k, v, o, lse], outputs)
    q_seq = (tuple(sum(p.length for p in c) for c in q_layout),)
    k_seq = (tuple(sum(p.length for p in c) for c in k_layout),)
    lead_q_chunks = tuple((n,) for n in lead_q)
    lead_k_chunks = tuple((n,) for n in lead_k)
    results = [
        da.Array(
            graph,
            names["dq"],
            (*lead_q_chunks, *q_seq, (q.shape[-1],)),
            meta=_meta(q.ndim, dq_dtype),
        ),
        da.Array(
            graph,
            names["dk"],
            (*lead_k_chunks, *k_seq, (k.shape[-1],)),
            meta=_meta(k.ndim, dk_dtype),
        ),
        da.Array(
            graph,
            names["dv"],
            (*lead_k_chunks, *k_seq, (v.shape[-1],)),
            meta=_meta(v.ndim, dv_dtype),
        ),
    ]
    if sinks is not None:
        results.append(
            da.Array(graph, names["dsinks"], ((sinks.shape[0],),), meta=_meta(1, dtypes[3]))
        )
    return tuple(results)
