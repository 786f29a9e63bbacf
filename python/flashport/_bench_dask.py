"""``python -m flashport bench dask``: flashport.dask against one
flashport call, measured in the same run.

For (1, 8, 16384, 64) float32 split into 4 query × 4 key chunks, causal and
not: the forward and the forward+backward of ``flashport.dask`` on Dask's
threaded scheduler and on a LocalCluster of 2 single-threaded worker
processes, each with half the cores for its flashport calls (inputs
persisted on the workers first, results gathered back),
against ``flashport.attention`` (+ ``attention_backward``) called once on
the whole arrays: medians of interleaved rounds after a warm-up, and their
ratios. Then, from one more untimed forward+backward each, the peak
resident memory: of this process for the single call and the threaded
scheduler, of each worker for the cluster (``VmHWM``, reset through
``/proc/self/clear_refs`` before the run; Linux only), next to the size of
the whole problem's arrays. Needs ``pip install 'flashport[dask]'``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import flashport

SHAPE = (1, 8, 16384, 64)
QUICK_SHAPE = (1, 8, 2048, 64)
CHUNKS = 4


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def reset_peak() -> int | None:
    """Resets this process's peak resident set (``VmHWM``) to its current
    one; returns that, in bytes, or None where Linux's clear_refs is absent."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status_kib("VmRSS") * 1024
    except OSError:
        return None


def peak() -> int | None:
    """This process's peak resident set since the last reset, in bytes."""
    try:
        return _status_kib("VmHWM") * 1024
    except (OSError, KeyError):
        return None


def _medians(cases: dict[str, Callable[[], object]], repeat: int) -> dict[str, float]:
    from ._bench import interleaved_medians

    return interleaved_medians(cases, repeat)


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / (1 << 20):.0f}"


def _persist(client, arrays: list) -> list:
    """The arrays' chunks stored on the workers, once (Dask warns about the
    NumPy arrays inside the graph that carries them there)."""
    import warnings

    from distributed import futures_of, wait

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*large graph.*")
        remote = client.persist(arrays)
    wait(futures_of(remote))
    return remote


def bench(shape, causal: bool, repeat: int, client, zigzag: bool) -> dict[str, Any]:
    import dask
    import dask.array as da

    import flashport.dask as fpd

    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal(shape, dtype=np.float32) for _ in range(4))
    seq = shape[2]
    chunks = (shape[0], shape[1], seq // CHUNKS, shape[3])
    local = [da.from_array(x, chunks=chunks) for x in (q, k, v, do)]
    layouts = {"threads": local, "cluster": _persist(client, local)}
    if zigzag:
        zz = [fpd.zigzag(x, CHUNKS) for x in (q, k, v, do)]
        layouts["threads zigzag"] = zz
        layouts["cluster zigzag"] = _persist(client, zz)

    def single_forward():
        return flashport.attention(q, k, v, causal=causal, return_lse=True)

    def single_both():
        o, lse = flashport.attention(q, k, v, causal=causal, return_lse=True)
        return flashport.attention_backward(do, q, k, v, o, lse, causal=causal)

    def graphs(arrays, backward: bool, zigzag: bool) -> list:
        dq_, dk_, dv_, ddo = arrays
        o, lse = fpd.attention(dq_, dk_, dv_, causal=causal, zigzag=zigzag, return_lse=True)
        if not backward:
            return [o, lse]
        grads = fpd.attention_backward(ddo, dq_, dk_, dv_, o, lse, causal=causal, zigzag=zigzag)
        return [o, lse, *grads]

    def run(name: str, backward: bool) -> Callable[[], Any]:
        arrays, zigzag = layouts[name], "zigzag" in name
        if name.startswith("cluster"):
            return lambda: client.compute(graphs(arrays, backward, zigzag), sync=True)
        return lambda: dask.compute(*graphs(arrays, backward, zigzag), scheduler="threads")

    cases: dict[str, Callable[[], object]] = {
        "single forward": single_forward,
        "single fwd+bwd": single_both,
    }
    for name in layouts:
        cases[f"{name} forward"] = run(name, False)
        cases[f"{name} fwd+bwd"] = run(name, True)
    times = _medians(cases, repeat)

    # Exactness, once: the cluster's fwd+bwd against the single call.
    want = single_both()
    got = run("cluster", True)()
    err = max(
        float(np.abs(np.asarray(g, np.float64) - w).max() / max(np.abs(w).max(), 1e-30))
        for g, w in zip(got[2:], want, strict=True)
    )

    memory: dict[str, Any] = {}
    base = reset_peak()
    single_both()
    memory["single"] = None if base is None else peak() - base  # type: ignore[operator]
    base = reset_peak()
    run("threads", True)()
    memory["threads"] = None if base is None else peak() - base  # type: ignore[operator]
    bases = client.run(reset_peak)
    run("cluster", True)()
    peaks = client.run(peak)
    memory["workers"] = {
        w: {"peak": peaks[w], "rise": None if bases[w] is None else peaks[w] - bases[w]}
        for w in peaks
    }
    o, lse = single_forward()
    problem = sum(x.nbytes for x in (q, k, v, do, o, lse, *want))
    return {
        "shape": list(shape),
        "causal": causal,
        "chunks": [CHUNKS, CHUNKS],
        "times_s": times,
        "max_rel_err_grads": err,
        "memory": memory,
        "problem_bytes": problem,
    }


def format_rows(rows: list[dict]) -> str:
    head = (
        f"{'causal':<7}{'path':<22}{'forward s':>11}{'vs single':>11}"
        f"{'fwd+bwd s':>11}{'vs single':>11}"
    )
    lines = [head, "-" * len(head)]
    for row in rows:
        t = row["times_s"]
        names = sorted({n.rsplit(" ", 1)[0] for n in t}, key=lambda n: (n != "single", n))
        for name in names:
            fwd, both = t[f"{name} forward"], t[f"{name} fwd+bwd"]
            lines.append(
                f"{row['causal']!s:<7}{name:<22}{fwd:11.2f}{fwd / t['single forward']:10.2f}x"
                f"{both:11.2f}{both / t['single fwd+bwd']:10.2f}x"
            )
    lines.append("")
    lines.append("peak resident memory during one fwd+bwd (MiB; rise above the level before it):")
    for row in rows:
        m = row["memory"]
        workers = ", ".join(
            f"{_mib(w['rise'])} (peak {_mib(w['peak'])})" for w in m["workers"].values()
        )
        lines.append(
            f"  causal={row['causal']!s:<5} single call {_mib(m['single'])}, threads "
            f"{_mib(m['threads'])}, each cluster worker {workers}; the whole problem's arrays "
            f"(q, k, v, do, o, lse, dq, dk, dv) {_mib(row['problem_bytes'])}"
        )
    lines.append(
        "  (the workers hold their persisted input chunks before the run; a process that has "
        "computed before reuses freed pages, so rises read low)"
    )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashport bench dask", description=__doc__)
    parser.add_argument("--repeat", type=int, default=3, help="timed rounds (median)")
    parser.add_argument("--quick", action="store_true", help=f"a small problem, {QUICK_SHAPE}")
    parser.add_argument("--zigzag", action="store_true", help="also the zig-zag order")
    parser.add_argument("--json", help="write the raw numbers to this file")
    args = parser.parse_args(argv)
    try:
        from distributed import Client, LocalCluster
    except ImportError:
        print("needs Dask: pip install 'flashport[dask]'", file=sys.stderr)
        return 2
    shape = QUICK_SHAPE if args.quick else SHAPE
    print(
        f"flashport {flashport.__version__} dask bench: {shape} float32, {CHUNKS} x {CHUNKS} "
        f"chunks, {os.cpu_count()} CPUs, {flashport.devices()[0]['threads']} flashport threads "
        f"per call; cluster: 2 worker processes x 1 thread, {max(1, (os.cpu_count() or 2) // 2)} "
        "flashport threads per call",
        flush=True,
    )
    # Each worker's flashport calls get their share of the cores, as a
    # deployment of one worker per core group would; the threaded scheduler
    # and the single call use flashport's default, every core.
    worker_threads = max(1, (os.cpu_count() or 2) // 2)
    cluster = LocalCluster(
        n_workers=2,
        processes=True,
        threads_per_worker=1,
        host="127.0.0.1",
        dashboard_address=None,
        env={"FLASHPORT_NUM_THREADS": str(worker_threads)},
    )
    rows = []
    with Client(cluster) as client:
        for causal in (False, True):
            print(f"causal={causal} ...", end=" ", flush=True)
            start = time.perf_counter()
            rows.append(bench(shape, causal, args.repeat, client, args.zigzag and causal))
            print(f"{time.perf_counter() - start:.0f} s", flush=True)
    cluster.close()
    print()
    print(format_rows(rows))
    errs = ", ".join(f"{r['max_rel_err_grads']:.1e}" for r in rows)
    print(f"cluster fwd+bwd vs single call, max relative error of dq, dk, dv: {errs}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
