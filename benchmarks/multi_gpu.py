"""Every GPU in the machine, measured (issue #38, item 3): on a host with 2 or
more GPUs, in one process (plus one Dask cluster at a time), at most
``--budget`` seconds (default 450), a few dozen lines of output, no files.

1. The GPUs flashport lists, by index.
2. Two threads on two GPUs: causal float16 forward+backward of
   ``--thread-shape`` (default (1, 16, 16384, 64)), ``--calls`` calls per
   thread, on DeviceArrays and on NumPy arrays: one thread on gpu:0 against
   one thread per GPU at once (2, then every GPU where there are more), the
   throughput ratio, and whether every GPU's results are gpu:0's bits.
3. ``flashport.dask`` on one GPU against every GPU: causal forward+backward
   of (1, 16, N, 64) for each N of ``--seqs`` (default 65536 and 131072),
   float16 and float32, on ``flashport.dask.gpu_cluster(1)`` and on
   ``gpu_cluster()`` (one worker process per GPU), the same graph
   (``--chunks-per-gpu`` x GPUs chunks, ``--schedule``), inputs made on
   the workers and persisted first, outputs persisted there (the timed
   region: building the graph, running it, waiting); next to one
   ``flashport.attention`` + ``attention_backward`` call on gpu:0 with NumPy
   in and out. Exactness: the all-GPU results against the one-GPU graph's
   (bit for bit), against the single call (largest difference relative to
   the largest value), and o and dq of ``--rows`` sampled rows against a
   float64 computation here.
4. The largest sequence: float16 causal forward+backward of (1, 16, N, 64),
   N doubling from twice the largest of ``--seqs``, for the single call
   and for the all-GPU cluster, while the last run took under a quarter of
   ``--cap`` seconds (the next takes about 4 times as long) and the budget
   allows; the largest that ran, and what stopped the search.

FLOPs follow the FlashAttention papers: causal forward 2·N²·H·d (half of
4·N²·H·d), backward 2.5 times that.

    python3 benchmarks/multi_gpu.py                # on the lent multi-GPU host
    python3 benchmarks/multi_gpu.py --quick        # seconds: the code paths, tiny shapes

Needs ``flashport[dask]`` (dask and distributed). With one GPU (or with the
development build's ``FLASHPORT_TEST_GPU_COPIES=2`` on lavapipe) it runs,
but measures nothing about several GPUs.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import sys
import threading
import time
import warnings
from datetime import date

import flashport
import numpy as np


def log(line: str = "") -> None:
    print(line, flush=True)


class Budget:
    """Seconds since the start, and whether a step expected to take
    ``seconds`` more still fits."""

    def __init__(self, seconds: float) -> None:
        self.start, self.seconds = time.perf_counter(), seconds

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def allows(self, seconds: float) -> bool:
        return self.elapsed() + seconds <= self.seconds


def flops(seq: int, heads: int, dim: int) -> float:
    """Causal forward+backward: 3.5 x the causal forward's 2·N²·H·d."""
    return 3.5 * 2.0 * seq * seq * heads * dim


def forward_backward(q, k, v, do, device):
    o, lse = flashport.attention(q, k, v, causal=True, return_lse=True, device=device)
    dq, dk, dv = flashport.attention_backward(do, q, k, v, o, lse, causal=True, device=device)
    return [o, lse, dq, dk, dv]


def same_bits(a: list, b: list) -> bool:
    return all(
        np.asarray(x).tobytes() == np.asarray(y).tobytes() for x, y in zip(a, b, strict=True)
    )


# ------------------------------------------------------------------ threads


def thread_section(gpus: list[str], shape: tuple[int, ...], calls: int) -> None:
    rng = np.random.default_rng(0)
    host = [rng.standard_normal(shape, dtype=np.float32).astype(np.float16) for _ in range(4)]
    on = {g: [flashport.to_device(x, g) for x in host] for g in gpus}
    want = [np.asarray(x) for x in forward_backward(*on[gpus[0]], gpus[0])]
    for g in gpus:  # warm-up: each GPU's pipelines compiled, pools filled
        forward_backward(*on[g], g)
        forward_backward(*host, g)
        flashport.synchronize(g)

    def loop(g: str, arrays: list, out: dict) -> None:
        for _ in range(calls):
            last = forward_backward(*arrays, g)
        flashport.synchronize(g)
        out[g] = [np.asarray(x) for x in last]

    def timed(group: list[str], inputs) -> tuple[float, dict]:
        out: dict = {}
        threads = [threading.Thread(target=loop, args=(g, inputs(g), out)) for g in group]
        t = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        return time.perf_counter() - t, out

    tf = flops(shape[2], shape[1], shape[3]) * shape[0] / 1e12
    log(f"threads: causal float16 forward+backward of {shape}, {calls} calls per thread")
    groups = [gpus[:2]] + ([gpus] if len(gpus) > 2 else [])
    for label, inputs in [("DeviceArrays", lambda g: on[g]), ("NumPy in/out", lambda g: host)]:
        one, out1 = timed(gpus[:1], inputs)
        parts = [
            f"1 thread on gpu:0 {one / calls * 1e3:.1f} ms/call ({tf * calls / one:.1f} TFLOP/s)"
        ]
        exact = same_bits(out1[gpus[0]], want)
        for group in groups:
            wall, out = timed(group, inputs)
            ratio = (len(group) * calls / wall) / (calls / one)
            exact = exact and all(same_bits(out[g], want) for g in group)
            parts.append(f"{len(group)} threads on {','.join(group)}: {ratio:.2f}x the throughput")
        parts.append(f"all GPUs' bits = gpu:0's: {'yes' if exact else 'NO'}")
        log(f"  {label}: " + "; ".join(parts))


# --------------------------------------------------------------------- dask


def oracle_rows(q, k, v, do, rows, scale):
    """o and dq of the query rows ``rows`` (causal, bottom-right with seq_q
    = seq_k, so row r sees keys 0..r), in float64, head by head."""
    heads, dim = q.shape[1], q.shape[3]
    o = np.zeros((heads, len(rows), v.shape[3]))
    dq = np.zeros((heads, len(rows), dim))
    for h in range(heads):
        for i, r in enumerate(rows):
            kh = k[0, h, : r + 1].astype(np.float64)
            vh = v[0, h, : r + 1].astype(np.float64)
            s = kh @ q[0, h, r].astype(np.float64) * scale
            p = np.exp(s - s.max())
            p /= p.sum()
            o[h, i] = p @ vh
            dp = vh @ do[0, h, r].astype(np.float64)
            ds = p * (dp - do[0, h, r].astype(np.float64) @ o[h, i])
            dq[h, i] = scale * (ds @ kh)
    return o, dq


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def check_rows(inputs, result, rows) -> float:
    q, k, v, do = inputs
    o, dq = oracle_rows(q, k, v, do, rows, q.shape[3] ** -0.5)
    got_o = np.asarray(result[0])[0][:, rows].astype(np.float64)
    got_dq = np.asarray(result[2])[0][:, rows].astype(np.float64)
    return max(rel(got_o, o), rel(got_dq, dq))


class DaskRun:
    """One cluster (``devices``: a number of GPUs, or None for all) and the
    graphs run on it."""

    def __init__(self, devices, chunks: int, schedule: str, threads: int) -> None:
        import distributed
        import flashport.dask as fpd

        self.fpd, self.distributed = fpd, distributed
        self.chunks, self.schedule = chunks, schedule
        self.cluster = fpd.gpu_cluster(
            devices,
            threads_per_worker=threads,
            host="127.0.0.1",
            dashboard_address=None,
            silence_logs=logging.ERROR,
        )
        # The default client: distributed.wait finds it there.
        self.client = distributed.Client(self.cluster)
        self.gpus = sorted(w["name"] for w in self.client.scheduler_info()["workers"].values())

    def close(self) -> None:
        self.client.close()
        self.cluster.close()

    def inputs(self, seq: int, heads: int, dim: int, dtype, seed: int) -> list:
        """q, k, v, do made on the workers (the same values on every cluster
        for the same chunks and seed) and persisted there."""
        import dask.array as da

        rs = da.random.RandomState(seed)
        step = -(-seq // self.chunks)
        chunks = (1, heads, step, dim)
        arrays = [
            rs.standard_normal((1, heads, seq, dim), chunks=chunks).astype(dtype) for _ in range(4)
        ]
        arrays = self.client.persist(arrays)
        self.distributed.wait(arrays)
        return arrays

    def run(self, arrays: list) -> tuple[float, list]:
        """Seconds to build, run and persist the forward+backward graph;
        its five results, persisted."""
        q, k, v, do = arrays
        t = time.perf_counter()
        kw = {"causal": True, "schedule": self.schedule}
        o, lse = self.fpd.attention(q, k, v, return_lse=True, **kw)
        dq, dk, dv = self.fpd.attention_backward(do, q, k, v, o, lse, **kw)
        out = self.client.persist([o, lse, dq, dk, dv])
        self.distributed.wait(out)
        return time.perf_counter() - t, out

    def gather(self, arrays: list) -> list[np.ndarray]:
        return self.client.compute(arrays, sync=True)


def dask_section(args, gpus: list[str], budget: Budget) -> None:
    heads, dim = args.heads, args.dim
    chunks = args.chunks_per_gpu * len(gpus)
    dtypes = [np.dtype(np.float16), np.dtype(np.float32)]
    cases = [(dt, n) for dt in dtypes for n in sorted(args.seqs)]
    log(
        f"dask: causal forward+backward of (1, {heads}, N, {dim}), {chunks} chunks "
        f"({args.chunks_per_gpu} per GPU), schedule={args.schedule!r}, "
        f"{args.threads_per_worker} thread(s) per worker, inputs and outputs on the workers; "
        f"TF = TFLOP/s; rows: o and dq of {args.rows} rows against float64"
    )

    def rows_of(n: int) -> list[int]:
        return sorted({0, 1, n // 3, n // 2, n - 2, n - 1})[: args.rows]

    def cell(seconds: float, n: int) -> str:
        return f"{seconds:.2f} s ({flops(n, heads, dim) / seconds / 1e12:.1f} TF)"

    found: dict = {}
    # One cluster at a time: first one GPU (and the single call beside it),
    # then every GPU, compared with what the first computed. A case is
    # skipped where the one before it of its dtype, scaled by N², predicts
    # more than the budget has left.
    one = DaskRun(1, chunks, args.schedule, args.threads_per_worker)
    one.run(one.inputs(chunks * 256, heads, dim, np.float16, 1))
    previous: dict = {}
    for dt, n in cases:
        if dt.name in previous:
            m, seconds = previous[dt.name]
            predicted = seconds * (n / m) ** 2 * (1 + len(gpus) / 2) + 10
        else:
            predicted = 10
        if not budget.allows(predicted):
            log(f"  {n} {dt.name}: skipped, ~{predicted:.0f} s predicted, over the budget")
            continue
        arrays = one.inputs(n, heads, dim, dt, seed=n)
        host = one.gather(arrays)
        forward_backward(*(x[:, :, :256] for x in host), "gpu:0")  # warm-up
        t = time.perf_counter()
        single = forward_backward(*host, "gpu:0")
        t_single = time.perf_counter() - t
        t_one, out = one.run(arrays)
        one_out = one.gather(out)
        del out, arrays
        previous[dt.name] = (n, t_single + t_one)
        found[dt.name, n] = {"host": host, "single": (t_single, single), "one": (t_one, one_out)}
        log(
            f"  {n} {dt.name}: 1 call gpu:0 {cell(t_single, n)}, dask 1 GPU {cell(t_one, n)}; "
            f"rows: call {check_rows(host, single, rows_of(n)):.1e}, "
            f"dask 1 GPU {check_rows(host, one_out, rows_of(n)):.1e}"
        )
    one.close()
    if len(gpus) < 2 or not found:
        return
    every = DaskRun(None, chunks, args.schedule, args.threads_per_worker)
    every.run(every.inputs(chunks * 256, heads, dim, np.float16, 1))
    for (name, n), f in found.items():
        t_one, one_out = f["one"]
        if not budget.allows(t_one + 10):
            log(f"  {n} {name}: {len(gpus)} GPUs skipped, over the budget")
            continue
        t_all, out = every.run(every.inputs(n, heads, dim, np.dtype(name), seed=n))
        all_out = every.gather(out)
        del out
        t_single, single = f["single"]
        err_call = max(rel(a, b) for a, b in zip(all_out, single, strict=True))
        log(
            f"  {n} {name}: dask {len(gpus)} GPUs {cell(t_all, n)}: {t_single / t_all:.2f}x the "
            f"call, {t_one / t_all:.2f}x dask 1 GPU (efficiency {t_one / t_all / len(gpus):.0%}); "
            f"bits = dask 1 GPU's: {'yes' if same_bits(all_out, one_out) else 'NO'}; "
            f"vs call {err_call:.1e}; rows {check_rows(f['host'], all_out, rows_of(n)):.1e}"
        )
    every.close()


# ------------------------------------------------------------------ largest


def largest_section(args, gpus: list[str], budget: Budget) -> None:
    heads, dim = args.heads, args.dim
    start = 2 * max(args.seqs)
    log(
        f"largest: float16 causal forward+backward of (1, {heads}, N, {dim}), N doubling from "
        f"{start} while the last run took < {args.cap / 4:.1f} s (next ~4x) and the budget allows"
    )
    configs = [("1 call gpu:0", None)] + (
        [(f"dask {len(gpus)} GPUs", "all")] if len(gpus) > 1 else []
    )
    for label, kind in configs:
        run = None
        if kind == "all":
            run = DaskRun(
                None, args.chunks_per_gpu * len(gpus), args.schedule, args.threads_per_worker
            )
        n, best, why, last = start, None, "", 0.0
        while True:
            if last and last * 4 > args.cap:
                why = f"N={n} not run: ~{last * 4:.0f} s predicted, over the cap {args.cap:.0f} s"
                break
            if not budget.allows(max(last * 4, 5)):
                why = f"N={n} not run: over the budget"
                break
            try:
                if run is None:
                    rng = np.random.default_rng(n)
                    host = [
                        rng.standard_normal((1, heads, n, dim), dtype=np.float32).astype(np.float16)
                        for _ in range(4)
                    ]
                    t = time.perf_counter()
                    out = forward_backward(*host, "gpu:0")
                    last = time.perf_counter() - t
                else:
                    arrays = run.inputs(n, heads, dim, np.float16, seed=n)
                    last, persisted = run.run(arrays)
                    host = run.gather(arrays)
                    o, dq = run.gather([persisted[0], persisted[2]])
                    out = [o, None, dq]
                    del persisted, arrays
            except flashport.FlashportError as e:
                why = f"N={n} failed: {type(e).__name__}: {str(e)[:120]}"
                break
            rows = sorted({0, n // 2, n - 1})
            err = check_rows(host, out, rows)
            best = (n, last, err)
            del host, out
            n *= 2
        if run is not None:
            run.close()
        ran = (
            f"{best[0]} in {best[1]:.1f} s ({flops(best[0], heads, dim) / best[1] / 1e12:.1f} "
            f"TFLOP/s, rows vs float64 {best[2]:.1e})"
            if best
            else "none"
        )
        log(f"  {label}: largest run {ran}; {why}")


# --------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny shapes: the code paths only")
    p.add_argument("--seqs", type=int, nargs="+", default=[65536, 131072])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--thread-shape", type=int, nargs=4, default=[1, 16, 16384, 64])
    p.add_argument("--calls", type=int, default=20, help="calls per thread")
    p.add_argument("--chunks-per-gpu", type=int, default=2)
    p.add_argument("--schedule", choices=["tree", "ring"], default="tree")
    p.add_argument("--threads-per-worker", type=int, default=1)
    p.add_argument("--rows", type=int, default=6, help="sampled rows checked in float64")
    p.add_argument("--cap", type=float, default=60.0, help="seconds one largest-N run may take")
    p.add_argument("--budget", type=float, default=450.0, help="seconds in all")
    p.add_argument("--skip", nargs="*", default=[], choices=["threads", "dask", "largest"])
    args = p.parse_args(argv)
    if args.quick:
        args.seqs, args.heads, args.dim = [1024], 2, 32
        args.thread_shape, args.calls, args.cap = [1, 2, 512, 32], 3, 2.0
    warnings.filterwarnings("ignore")
    logging.getLogger("distributed").setLevel(logging.ERROR)
    budget = Budget(args.budget)

    listed = [d for d in flashport.devices() if d["device"].startswith("gpu")]
    log(
        f"flashport {flashport.__version__} multi-GPU measurement, {date.today()}, "
        f"{platform.node()} ({os.cpu_count()} CPUs), Python {platform.python_version()}"
    )
    for d in listed:
        log(
            f"  {d['device']}: {d['name']} ({d['type']}, {d['backend']}, pci "
            f"{d['pci_bus_id'] or '-'}, driver {d['driver']})"
        )
    if not listed:
        log("no GPU: nothing to measure")
        return 1
    hardware = [d["device"] for d in listed if d["type"] != "software"]
    gpus = hardware or [d["device"] for d in listed]
    if len(gpus) < 2:
        log("one GPU: the two-GPU rows below are skipped")
    if "threads" not in args.skip and len(gpus) > 1:
        thread_section(gpus, tuple(args.thread_shape), args.calls)
    if "dask" not in args.skip:
        dask_section(args, gpus, budget)
    if "largest" not in args.skip:
        largest_section(args, gpus, budget)
    log(f"total {budget.elapsed():.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
