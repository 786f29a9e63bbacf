"""Forward and backward attention over a 64k-token sequence on a local Dask
cluster of worker processes, checked against the single-machine result.

    .venv/bin/python examples/dask_long_sequence.py                # (1, 1, 65536, 64), causal
    .venv/bin/python examples/dask_long_sequence.py --zigzag --schedule ring
    .venv/bin/python examples/dask_long_sequence.py --seq 8192 --heads 4 --no-causal

The same code runs on a real cluster: replace the LocalCluster by
``Client("tcp://scheduler:8786")`` and load q, k, v where they live (zarr,
``da.from_delayed``, ...) instead of persisting NumPy arrays from here.
Needs ``pip install 'flashport[dask]'``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

import dask.array as da
import flashport
import flashport.dask as fpd
import numpy as np
from dask.highlevelgraph import HighLevelGraph
from distributed import Client, LocalCluster, futures_of, wait


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=65536, help="tokens (default 65536)")
    parser.add_argument("--heads", type=int, default=1)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--chunks", type=int, default=8, help="chunks of the sequence")
    parser.add_argument("--workers", type=int, default=2, help="worker processes")
    parser.add_argument("--no-causal", dest="causal", action="store_false")
    parser.add_argument("--zigzag", action="store_true", help="zig-zag chunk order")
    parser.add_argument("--schedule", choices=["tree", "ring"], default="tree")
    args = parser.parse_args(argv)

    shape = (1, args.heads, args.seq, args.dim)
    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal(shape, dtype=np.float32) for _ in range(4))
    cores = os.cpu_count() or 1
    cluster = LocalCluster(
        n_workers=args.workers,
        processes=True,
        threads_per_worker=1,
        host="127.0.0.1",
        dashboard_address=None,
        # One flashport call per worker at a time, each with its share of cores.
        env={"FLASHPORT_NUM_THREADS": str(max(1, cores // args.workers))},
    )
    with Client(cluster) as client:
        if args.zigzag:
            arrays = [fpd.zigzag(x, args.chunks) for x in (q, k, v, do)]
        else:
            chunks = (1, args.heads, -(-args.seq // args.chunks), args.dim)
            arrays = [da.from_array(x, chunks=chunks) for x in (q, k, v, do)]
        with warnings.catch_warnings():  # the NumPy arrays travel inside the graph, once
            warnings.filterwarnings("ignore", message=".*large graph.*")
            arrays = client.persist(arrays)
        wait(futures_of(arrays))
        dq_, dk_, dv_, ddo = arrays

        start = time.perf_counter()
        kw = {"causal": args.causal, "zigzag": args.zigzag, "schedule": args.schedule}
        o, lse = fpd.attention(dq_, dk_, dv_, return_lse=True, **kw)
        grads = fpd.attention_backward(ddo, dq_, dk_, dv_, o, lse, **kw)
        got = client.compute([o, lse, *grads], sync=True)
        on_cluster = time.perf_counter() - start
        graph = HighLevelGraph.merge(*(x.__dask_graph__() for x in (o, lse, *grads)))
        tasks = sum(str(key[0]).startswith("flashport-attention") for key in graph.keys())
    cluster.close()
    if args.zigzag:
        got = [fpd.unzigzag(x, args.chunks, axis=-1 if x.ndim == 3 else -2) for x in got]

    start = time.perf_counter()
    want_o, want_lse = flashport.attention(q, k, v, causal=args.causal, return_lse=True)
    want = [
        want_o,
        want_lse,
        *flashport.attention_backward(do, q, k, v, want_o, want_lse, causal=args.causal),
    ]
    single = time.perf_counter() - start

    print(
        f"{shape} causal={args.causal} zigzag={args.zigzag} schedule={args.schedule}: "
        f"{args.chunks} x {args.chunks} chunks on {args.workers} worker processes"
    )
    print(
        f"forward+backward: {on_cluster:.1f} s on the cluster ({tasks} flashport tasks), "
        f"{single:.1f} s in one flashport call each"
    )
    ok = True
    for name, g, w in zip(("o", "lse", "dq", "dk", "dv"), got, want, strict=True):
        err = float(np.abs(g - w).max() / np.abs(w).max())
        ok &= err < 1e-4
        print(f"  {name:<4} max |cluster - single| / max |single| = {err:.1e}")
    print("OK: the cluster's results match the single machine's" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
