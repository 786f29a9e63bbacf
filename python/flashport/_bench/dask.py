"""``python -m flashport bench dask``: flashport.dask against one
flashport call, measured in the same run.

For (1, 8, 16384, 64) float32 split into 4 query × 4 key chunks, causal and
not: the forward and the forward+backward of ``flashport.dask`` on Dask's
threaded scheduler and on a LocalCluster of 2 single-threaded worker
processes, each with half the cores for its flashport calls (inputs
persisted on the workers first, results gathered back),
against ``flashport.attention`` (+ ``attention_backward``) called once on
the whole arrays: medians of interleaved rounds after a warm-up, and their
ratios. Then, from one more untimed forward+backward each in fresh processes,
the rise of the peak resident memory: of a new interpreter for the single
call and the threaded scheduler, of each worker of a new LocalCluster
(``VmHWM``, reset through ``/proc/self/clear_refs`` before the run; Linux
only), next to the size of the whole problem's arrays. Both schedules,
``tree`` and ``ring``, are measured. Needs ``pip install 'flashport[dask]'``.
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
# flashport threads per call in each of the cluster's 2 workers.
WORKER_THREADS = max(1, (os.cpu_count() or 2) // 2)


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
    from .timing import interleaved_medians

    return interleaved_medians(cases, repeat)


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / (1 << 20):.0f}"


def _warm_up() -> None:
    """A tiny call, so that a fresh process's thread pool is not charged to
    the measured one."""
    tiny = np.ones((1, 1, 4, 64), np.float32)
    flashport.attention(tiny, tiny, tiny)


_PROBE = """
import json, sys
import numpy as np
from flashport._bench.dask import _local_peak
print(json.dumps(_local_peak(*json.loads(sys.argv[1]))))
"""


def _local_peak(shape, causal: bool, dask_path) -> int | None:
    """In this (fresh) process: the rise of the peak resident set during one
    forward+backward, single call (``dask_path`` None) or flashport.dask
    on the threaded scheduler (``dask_path = [zigzag, schedule]``)."""
    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal(tuple(shape), dtype=np.float32) for _ in range(4))
    _warm_up()
    if dask_path is None:
        base = reset_peak()
        o, lse = flashport.attention(q, k, v, causal=causal, return_lse=True)
        flashport.attention_backward(do, q, k, v, o, lse, causal=causal)
    else:
        import dask
        import dask.array as da

        import flashport.dask as fpd

        zigzag, schedule = dask_path
        if zigzag:
            arrays = [fpd.zigzag(x, CHUNKS) for x in (q, k, v, do)]
        else:
            arrays = [
                da.from_array(x, chunks=(1, shape[1], shape[2] // CHUNKS, shape[3]))
                for x in (q, k, v, do)
            ]
        dq_, dk_, dv_, ddo = arrays
        kw = {"causal": causal, "zigzag": zigzag, "schedule": schedule}
        base = reset_peak()
        o_, lse_ = fpd.attention(dq_, dk_, dv_, return_lse=True, **kw)
        grads = fpd.attention_backward(ddo, dq_, dk_, dv_, o_, lse_, **kw)
        dask.compute(o_, lse_, *grads, scheduler="threads")
    top = peak()
    return None if base is None or top is None else top - base


def _fresh_peak(shape, causal: bool, dask_path) -> int | None:
    import subprocess

    args = json.dumps([list(shape), causal, None if dask_path is None else list(dask_path)])
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, args], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _cluster():
    """2 single-threaded worker processes on the loopback interface, each
    with its share of the cores for its flashport calls (as a deployment
    of one worker per core group would; the threaded scheduler and the
    single call use flashport's default, every core)."""
    from distributed import LocalCluster

    return LocalCluster(
        n_workers=2,
        processes=True,
        threads_per_worker=1,
        host="127.0.0.1",
        dashboard_address=None,
        env={"FLASHPORT_NUM_THREADS": str(WORKER_THREADS)},
    )


def _fresh_cluster_peaks(shape, causal: bool, zigzag: bool, schedule: str) -> list[dict]:
    """On a new LocalCluster: each worker's peak resident set during one
    forward+backward and its rise above the level before (inputs persisted
    there, flashport warmed up)."""
    import dask.array as da
    from distributed import Client

    import flashport.dask as fpd

    rng = np.random.default_rng(0)
    xs = [rng.standard_normal(tuple(shape), dtype=np.float32) for _ in range(4)]
    chunks = (shape[0], shape[1], shape[2] // CHUNKS, shape[3])
    with _cluster() as cluster, Client(cluster, set_as_default=False) as client:
        arrays = [fpd.zigzag(x, CHUNKS) if zigzag else da.from_array(x, chunks=chunks) for x in xs]
        dq_, dk_, dv_, ddo = _persist(client, arrays)
        kw = {"causal": causal, "zigzag": zigzag, "schedule": schedule}
        client.run(_warm_up)
        bases = client.run(reset_peak)
        o, lse = fpd.attention(dq_, dk_, dv_, return_lse=True, **kw)  # type: ignore[call-overload]
        grads = fpd.attention_backward(ddo, dq_, dk_, dv_, o, lse, **kw)  # type: ignore[arg-type]
        client.compute([o, lse, *grads], sync=True)
        peaks = client.run(peak)
    return [
        {"peak": peaks[w], "rise": None if bases[w] is None else peaks[w] - bases[w]}
        for w in sorted(peaks)
    ]


def _persist(client, arrays: list) -> list:
    """The arrays' chunks stored on the workers, once (Dask warns about the
    NumPy arrays inside the graph that carries them there)."""
    import warnings

    from distributed import futures_of, wait

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*large graph.*")
        remote = client.persist(arrays)
    with client.as_current():
        wait(futures_of(remote))
    return remote


def bench(shape, causal: bool, repeat: int, client, zigzag: bool) -> dict[str, Any]:
    """One row of the table: times and memory of every path for ``shape``."""
    import dask
    import dask.array as da

    import flashport.dask as fpd

    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal(shape, dtype=np.float32) for _ in range(4))
    seq = shape[2]
    chunks = (shape[0], shape[1], seq // CHUNKS, shape[3])
    local = [da.from_array(x, chunks=chunks) for x in (q, k, v, do)]
    remote = _persist(client, local)
    # path name -> (arrays, on the cluster, zigzag, schedule)
    paths: dict[str, tuple[list, bool, bool, str]] = {
        "threads tree": (local, False, False, "tree"),
        "threads ring": (local, False, False, "ring"),
        "cluster tree": (remote, True, False, "tree"),
        "cluster ring": (remote, True, False, "ring"),
    }
    if zigzag:
        zz = [fpd.zigzag(x, CHUNKS) for x in (q, k, v, do)]
        paths["threads zigzag ring"] = (zz, False, True, "ring")
        paths["cluster zigzag ring"] = (_persist(client, zz), True, True, "ring")

    def single_forward():
        return flashport.attention(q, k, v, causal=causal, return_lse=True)

    def single_both():
        o, lse = flashport.attention(q, k, v, causal=causal, return_lse=True)
        return flashport.attention_backward(do, q, k, v, o, lse, causal=causal)

    def run(name: str, backward: bool) -> Callable[[], Any]:
        (dq_, dk_, dv_, ddo), on_cluster, zz_, schedule = paths[name]
        kw = {"causal": causal, "zigzag": zz_, "schedule": schedule}

        def graphs() -> list:
            o, lse = fpd.attention(dq_, dk_, dv_, return_lse=True, **kw)  # type: ignore[call-overload]
            if not backward:
                return [o, lse]
            return [o, lse, *fpd.attention_backward(ddo, dq_, dk_, dv_, o, lse, **kw)]  # type: ignore[arg-type]

        if on_cluster:
            return lambda: client.compute(graphs(), sync=True)
        return lambda: dask.compute(*graphs(), scheduler="threads")

    cases: dict[str, Callable[[], object]] = {
        "single forward": single_forward,
        "single fwd+bwd": single_both,
    }
    for name in paths:
        cases[f"{name} forward"] = run(name, False)
        cases[f"{name} fwd+bwd"] = run(name, True)
    times = _medians(cases, repeat)

    # Exactness, once: the cluster's fwd+bwd against the single call.
    want = single_both()
    got = run("cluster ring", True)()
    err = max(
        float(np.abs(np.asarray(g, np.float64) - w).max() / max(np.abs(w).max(), 1e-30))
        for g, w in zip(got[2:], want, strict=True)
    )

    # Peak memory of one more fwd+bwd per path, each in fresh processes (a
    # process that computed before reuses freed pages, and its peak reads
    # low): a new interpreter for the single call and the threaded
    # scheduler, a new LocalCluster for the cluster.
    memory: dict[str, Any] = {"single": _fresh_peak(shape, causal, None)}
    for name, (_, on_cluster, zz_, schedule) in paths.items():
        if on_cluster:
            memory[name] = _fresh_cluster_peaks(shape, causal, zz_, schedule)
        else:
            memory[name] = _fresh_peak(shape, causal, (zz_, schedule))
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
        f"{'fwd+bwd s':>11}{'vs single':>11}{'peak rise MiB (fwd+bwd)':>28}"
    )
    lines = [head, "-" * len(head)]
    for row in rows:
        t, m = row["times_s"], row["memory"]
        names = ["single", *(n for n in m if n != "single")]
        for name in names:
            fwd, both = t[f"{name} forward"], t[f"{name} fwd+bwd"]
            mem = m[name]
            if isinstance(mem, list):
                cell = " / ".join(_mib(w["rise"]) for w in mem) + " per worker"
            else:
                cell = _mib(mem)
            lines.append(
                f"{row['causal']!s:<7}{name:<22}{fwd:11.2f}{fwd / t['single forward']:10.2f}x"
                f"{both:11.2f}{both / t['single fwd+bwd']:10.2f}x{cell:>28}"
            )
    lines.append("")
    for row in rows:
        workers = [
            f"{name}: " + " / ".join(_mib(w["peak"]) for w in mem)
            for name, mem in row["memory"].items()
            if isinstance(mem, list)
        ]
        lines.append(
            f"causal={row['causal']!s}: the whole problem's arrays (q, k, v, do, o, lse, dq, dk, "
            f"dv) {_mib(row['problem_bytes'])} MiB; workers' peak resident sets (MiB), "
            + "; ".join(workers)
        )
    lines.append(
        "peak rise: the peak resident set during one fwd+bwd above the level before it, each "
        "in fresh processes (a new interpreter for single and threads, with the inputs "
        "allocated; a new LocalCluster for the cluster, whose workers hold their persisted "
        "input chunks and the results until they are gathered)"
    )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if "--split" in argv:
        from . import dask_split as _bench_dask_split

        return _bench_dask_split.main(argv)
    parser = argparse.ArgumentParser(prog="python -m flashport bench dask", description=__doc__)
    parser.add_argument("--repeat", type=int, default=3, help="timed rounds (median)")
    parser.add_argument("--quick", action="store_true", help=f"a small problem, {QUICK_SHAPE}")
    parser.add_argument("--zigzag", action="store_true", help="also the zig-zag order")
    parser.add_argument("--json", help="write the raw numbers to this file")
    parser.add_argument(
        "--split",
        action="store_true",
        help="instead: where one graph's time goes, per task kind (bench dask --split --help)",
    )
    args = parser.parse_args(argv)
    try:
        from distributed import Client
    except ImportError:
        print("needs Dask: pip install 'flashport[dask]'", file=sys.stderr)
        return 2
    shape = QUICK_SHAPE if args.quick else SHAPE
    print(
        f"flashport {flashport.__version__} dask bench: {shape} float32, {CHUNKS} x {CHUNKS} "
        f"chunks, {os.cpu_count()} CPUs, {flashport.devices()[0]['threads']} flashport threads "
        f"per call; cluster: 2 worker processes x 1 thread, {WORKER_THREADS} flashport threads "
        "per call",
        flush=True,
    )
    cluster = _cluster()
    rows = []
    with Client(cluster, set_as_default=False) as client:
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
