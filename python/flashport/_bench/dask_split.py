"""``python -m flashport bench dask --split``: where the time of one
flashport.dask forward+backward goes, task kind by task kind.

In every process that runs the graph's tasks (this one on the threaded
scheduler; the worker with ``--cluster``), the task functions of
``flashport.dask._tasks`` and the flashport calls they make
(``attention``, ``attention_backward``, ``merge_states``) are wrapped with
clocks. Per task kind it prints the tasks' seconds, the part spent in
flashport calls and the rest (the tasks' own host work: slicing, sums,
concatenations, conversions in NumPy), and what the graph's wall time leaves
outside the tasks (the scheduler, moving results, idle). On a GPU
(``--device gpu``) one more run repeats each attention call right after it
on DeviceArrays of its arguments, uploaded beforehand and waited for: the
GPU's own work, so that a call's NumPy time splits into that and the NumPy
in/out around it (uploads, downloads and conversions in the binding);
those runs are not timed otherwise.

Next to it, one ``flashport.attention`` + ``attention_backward`` call on the
whole arrays (and on a GPU the same on DeviceArrays). Every number is the
median over ``--repeat`` runs after a warm-up run. The wrappers cost a few
microseconds per call; nothing else changes in the graph.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import threading
import time
from collections import defaultdict
from typing import Any

import numpy as np

import flashport

# Task functions of flashport.dask._tasks a graph calls directly.
TASKS = (
    "forward_block",
    "forward_ring_block",
    "forward_no_keys",
    "merge",
    "backward_block",
    "backward_ring_block",
    "dsinks_part",
    "add",
    "zeros",
)
CALLS = ("attention", "attention_backward", "merge_states")
# flashport calls that run on the GPU with DeviceArrays (merge_states in a
# task merges host arrays on the CPU).
REPLAYED = ("attention", "attention_backward")


class _Clocks:
    """Seconds per task kind in one process: the tasks, the flashport calls
    inside them, and (replaying) those calls' work on DeviceArrays."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.local = threading.local()
        self.replay: str | None = None
        self.originals: dict[tuple[Any, str], Any] = {}
        self.reset()

    def reset(self) -> None:
        self.tasks: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0])

    def add(self, kind: str, slot: int, value: float) -> None:
        with self.lock:
            self.tasks[kind][slot] += value

    def stack(self) -> list[str]:
        if not hasattr(self.local, "stack"):
            self.local.stack = []
        return self.local.stack


_CLOCKS = _Clocks()


def _wrap_task(kind: str, function):
    @functools.wraps(function)
    def task(*args, **kwargs):
        stack = _CLOCKS.stack()
        stack.append(kind)
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            seconds = time.perf_counter() - start
            stack.pop()
            if not stack:  # a task function another one calls is part of it
                _CLOCKS.add(kind, 0, 1)
                _CLOCKS.add(kind, 1, seconds)

    return task


def _on_device(x: Any, device: str) -> Any:
    if isinstance(x, np.ndarray) and x.dtype in (np.float32, np.float16) and x.size:
        return flashport.to_device(x, device)
    return x


def _wrap_call(name: str, function):
    @functools.wraps(function)
    def call(*args, **kwargs):
        stack = _CLOCKS.stack()
        start = time.perf_counter()
        result = function(*args, **kwargs)
        seconds = time.perf_counter() - start
        if stack:
            _CLOCKS.add(stack[0], 2, seconds)
            device = _CLOCKS.replay
            if device is not None and name in REPLAYED:
                moved = [_on_device(x, device) for x in args]
                # Only calls whose every array is on the GPU (not bfloat16,
                # not zero-length keys): one NumPy array would make the call
                # move data and wait.
                if not any(isinstance(x, np.ndarray) for x in moved):
                    flashport.synchronize(device)
                    start = time.perf_counter()
                    function(*moved, **kwargs)
                    flashport.synchronize(device)
                    _CLOCKS.add(stack[0], 3, time.perf_counter() - start)
                    _CLOCKS.add(stack[0], 4, 1)
        return result

    return call


def install(replay: str | None = None) -> None:
    """Wraps the task functions and flashport's calls in this process
    (again: resets the clocks). ``replay``: the GPU to repeat attention
    calls on, or None."""
    from flashport.dask import _tasks

    if not _CLOCKS.originals:
        for name in TASKS:
            _CLOCKS.originals[_tasks, name] = getattr(_tasks, name)
            setattr(_tasks, name, _wrap_task(name, getattr(_tasks, name)))
        for name in CALLS:
            _CLOCKS.originals[flashport, name] = getattr(flashport, name)
            setattr(flashport, name, _wrap_call(name, getattr(flashport, name)))
    _CLOCKS.replay = replay
    _CLOCKS.reset()


def collect() -> dict[str, list[float]]:
    """This process's clocks since ``install``:
    kind -> [tasks, task s, flashport s, replayed device s, replayed calls]."""
    with _CLOCKS.lock:
        return {kind: list(v) for kind, v in _CLOCKS.tasks.items()}


def uninstall() -> None:
    for (owner, name), function in _CLOCKS.originals.items():
        setattr(owner, name, function)
    _CLOCKS.originals.clear()


class _Runner:
    """The inputs and a way to run the graph: on the threaded scheduler in
    this process, or on a one-worker cluster (a gpu_cluster for a GPU)."""

    def __init__(self, args) -> None:
        import dask.array as da

        self.args = args
        shape, dtype = tuple(args.shape), np.dtype(args.dtype)
        rng = np.random.default_rng(0)
        self.host = [rng.standard_normal(shape, dtype=np.float32).astype(dtype) for _ in range(4)]
        chunks = (*shape[:2], -(-shape[2] // args.chunks), shape[3])
        self.client = self.cluster = None
        if args.cluster:
            import distributed

            import flashport.dask as fpd

            kw = {"host": "127.0.0.1", "dashboard_address": None, "threads_per_worker": 1}
            if args.device.startswith("gpu"):
                # "gpu": the first GPU, as gpu_cluster(1) picks it.
                which = 1 if args.device == "gpu" else [args.device]
                self.cluster = fpd.gpu_cluster(which, **kw)
            else:
                self.cluster = distributed.LocalCluster(n_workers=1, processes=True, **kw)
            self.client = distributed.Client(self.cluster, set_as_default=False)
            local = [da.from_array(x, chunks=chunks) for x in self.host]
            self.arrays = self._persist(local)
        else:
            self.arrays = [da.from_array(x, chunks=chunks) for x in self.host]

    def device(self) -> str | None:
        """The device the tasks name: on a gpu_cluster the worker's own."""
        if self.args.cluster and self.args.device.startswith("gpu"):
            return None
        return self.args.device

    def graph(self) -> list:
        import flashport.dask as fpd

        q, k, v, do = self.arrays
        kw = {"causal": self.args.causal, "schedule": self.args.schedule, "device": self.device()}
        o, lse = fpd.attention(q, k, v, return_lse=True, **kw)
        return [o, lse, *fpd.attention_backward(do, q, k, v, o, lse, **kw)]

    def run(self) -> float:
        """Seconds to build and run the graph, results in memory where
        they were computed (persisted on the worker)."""
        import dask

        start = time.perf_counter()
        if self.client is None:
            dask.compute(*self.graph(), scheduler="threads", num_workers=1)
        else:
            self._persist(self.graph())
        return time.perf_counter() - start

    def _persist(self, arrays: list) -> list:
        """The arrays computed and kept on the worker, waited for."""
        import warnings

        from distributed import futures_of, wait

        with warnings.catch_warnings():
            # The inputs' first persist ships them inside the graph.
            warnings.filterwarnings("ignore", message=".*large graph.*")
            remote = self.client.persist(arrays)
        with self.client.as_current():
            wait(futures_of(remote))
        return remote

    def install(self, replay: str | None) -> None:
        if self.client is None:
            install(replay)
        else:
            self.client.run(install, replay)

    def collect(self) -> dict[str, list[float]]:
        if self.client is None:
            return collect()
        (clocks,) = self.client.run(collect).values()
        return clocks

    def close(self) -> None:
        if self.client is None:
            uninstall()
        else:
            self.client.close()
            self.cluster.close()


def _single(host: list[np.ndarray], causal: bool, device: str) -> float:
    q, k, v, do = host
    start = time.perf_counter()
    o, lse = flashport.attention(q, k, v, causal=causal, return_lse=True, device=device)
    flashport.attention_backward(do, q, k, v, o, lse, causal=causal, device=device)
    flashport.synchronize(device)
    return time.perf_counter() - start


def _median_clocks(runs: list[dict[str, list[float]]]) -> dict[str, list[float]]:
    kinds = sorted({k for r in runs for k in r})
    zero = [0, 0.0, 0.0, 0.0, 0]
    return {
        kind: [statistics.median(r.get(kind, zero)[slot] for r in runs) for slot in range(5)]
        for kind in kinds
    }


def measure(args) -> dict[str, Any]:
    gpu = args.device.startswith("gpu")
    runner = _Runner(args)
    try:
        runner.install(None)
        runner.run()  # warm-up: pipelines, pools, thread pools
        walls, clocks = [], []
        for _ in range(args.repeat):
            runner.install(None)
            walls.append(runner.run())
            clocks.append(runner.collect())
        replayed = None
        if gpu:
            replays = []
            for _ in range(args.repeat):
                # A gpu_cluster's worker calls its own GPU "gpu".
                runner.install("gpu" if args.cluster else args.device)
                runner.run()
                replays.append(runner.collect())
            replayed = _median_clocks(replays)
    finally:
        runner.close()
    singles = [_single(runner.host, args.causal, args.device) for _ in range(args.repeat + 1)][1:]
    resident = None
    if gpu:
        on = [flashport.to_device(x, args.device) for x in runner.host]
        _single(on, args.causal, args.device)
        resident = statistics.median(
            _single(on, args.causal, args.device) for _ in range(args.repeat)
        )
    return {
        "wall": statistics.median(walls),
        "clocks": _median_clocks(clocks),
        "replayed": replayed,
        "single": statistics.median(singles),
        "single_resident": resident,
    }


def report(args, m: dict[str, Any]) -> str:
    shape = tuple(args.shape)
    where = "a 1-worker cluster (1 thread)" if args.cluster else "the threaded scheduler (1 thread)"
    lines = [
        f"flashport {flashport.__version__} dask split: {shape} {args.dtype}, "
        f"causal={args.causal}, {args.chunks} x {args.chunks} chunks, "
        f"schedule={args.schedule!r}, device={args.device!r}, on {where}; "
        f"medians of {args.repeat} runs after a warm-up",
        f"one call (attention + attention_backward, NumPy in/out): {m['single']:.3f} s"
        + (
            f"; on DeviceArrays: {m['single_resident']:.3f} s"
            if m["single_resident"] is not None
            else ""
        ),
        f"graph wall (build + run): {m['wall']:.3f} s",
        "",
        f"{'task kind':<22}{'tasks':>6}{'task s':>10}{'flashport s':>13}{'other s':>10}"
        + (f"{'GPU work s':>12}{'NumPy in/out s':>16}" if m["replayed"] is not None else ""),
    ]
    totals = [0.0] * 5
    for kind, (n, task_s, call_s, _, _) in m["clocks"].items():
        line = f"{kind:<22}{n:6.0f}{task_s:10.3f}{call_s:13.3f}{task_s - call_s:10.3f}"
        if m["replayed"] is not None:
            device_s = m["replayed"].get(kind, [0, 0, 0, 0.0])[3]
            line += f"{device_s:12.3f}{call_s - device_s:16.3f}"
            totals[3] += device_s
        lines.append(line)
        totals[0] += n
        totals[1] += task_s
        totals[2] += call_s
    line = (
        f"{'all tasks':<22}{totals[0]:6.0f}{totals[1]:10.3f}{totals[2]:13.3f}"
        f"{totals[1] - totals[2]:10.3f}"
    )
    if m["replayed"] is not None:
        line += f"{totals[3]:12.3f}{totals[2] - totals[3]:16.3f}"
    lines.append(line)
    lines.append(
        f"outside the tasks (graph building, scheduler, moving results, idle): "
        f"{m['wall'] - totals[1]:.3f} s"
    )
    lines.append(
        "flashport s: inside flashport calls (kernels, and with NumPy arrays on a GPU the "
        "uploads, downloads and conversions); other s: the tasks' own host work"
        + (
            "; GPU work s: the same attention calls repeated on DeviceArrays (in runs of their own)"
            if m["replayed"] is not None
            else ""
        )
    )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m flashport bench dask --split", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--split", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--shape", type=int, nargs=4, default=[1, 8, 16384, 64])
    parser.add_argument("--dtype", default="float16", choices=["float16", "float32"])
    parser.add_argument("--chunks", type=int, default=4, help="query and key chunks")
    parser.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--schedule", choices=["tree", "ring"], default="tree")
    parser.add_argument("--device", default="cpu", help='"cpu", "gpu" or "gpu:N"')
    parser.add_argument(
        "--cluster", action="store_true", help="a 1-worker cluster (gpu_cluster for a GPU)"
    )
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    try:
        import dask  # noqa: F401
    except ImportError:
        print("needs Dask: pip install 'flashport[dask]'", file=sys.stderr)
        return 2
    print(report(args, measure(args)))
    return 0
