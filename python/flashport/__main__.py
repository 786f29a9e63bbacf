"""``python -m flashport``: the main job.

Runs a realistic attention problem (by default batch 1, 8 heads, 4096 tokens,
head dim 64, causal and not) forward and backward on every available device,
checks each result against the float64 reference on a slice, and prints the
time, the GFLOP/s and the peak extra memory next to what naive attention would
need for its ``seq × seq`` matrices.

``python -m flashport devices`` lists the devices; ``python -m flashport bench``
compares the CPU path with PyTorch and naive NumPy; ``python -m flashport
generate`` runs a small transformer's beam search and sampling over the KV
cache.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

import flashport
from flashport import reference

from ._memory import forward_peak_bytes

# A software rasteriser (lavapipe, llvmpipe) runs a few GFLOP/s: it gets a
# smaller problem so the demo finishes, and the table says so.
SOFTWARE_SEQ = 512


def _gib(n: float) -> str:
    if n >= 1 << 30:
        return f"{n / (1 << 30):.2f} GiB"
    return f"{n / (1 << 20):.1f} MiB"


def _rel_err(got, want) -> float:
    want = np.asarray(want, dtype=np.float64)
    return float(np.abs(np.asarray(got, dtype=np.float64) - want).max() / np.abs(want).max())


def _check_slice(q, k, v, do, out, lse, grads, causal) -> tuple[float, float]:
    """Max error relative to max |ref| of the forward output and of the three
    gradients, on batch 0, head 0 (heads are independent without GQA)."""
    sl = (slice(0, 1), slice(0, 1))
    want_out = reference.attention(q[sl], k[sl], v[sl], causal=causal)
    want_grads = reference.attention_backward(do[sl], q[sl], k[sl], v[sl], causal=causal)
    fwd = _rel_err(out[sl], want_out)
    bwd = max(_rel_err(g[sl], w) for g, w in zip(grads, want_grads, strict=True))
    del lse
    return fwd, bwd


def _devices_to_run() -> list[tuple[str, str, bool]]:
    """(device argument, description, is software) for each device."""
    runs = []
    for dev in flashport.devices():
        if dev["device"] == "cpu":
            runs.append(("cpu", f"cpu ({dev['threads']} threads)", False))
        elif not any(r[0] == "gpu" for r in runs):
            # device="gpu" uses the best adapter; list it once.
            software = dev["type"] in ("software", "cpu")
            runs.append(("gpu", f"gpu: {dev['name']} ({dev['backend']})", software))
    return runs


def run_demo(args: argparse.Namespace) -> int:
    rows = []
    print(
        f"flashport {flashport.__version__}: exact FlashAttention-2, float32, "
        f"batch {args.batch}, heads {args.heads}, d {args.dim}; "
        f"median of {args.repeat} runs after a warm-up run",
        flush=True,
    )
    failures = 0
    for device, label, software in _devices_to_run():
        seq = min(args.seq, SOFTWARE_SEQ) if software else args.seq
        rng = np.random.default_rng(0)
        shape = (args.batch, args.heads, seq, args.dim)
        q, k, v, do = (rng.standard_normal(shape, dtype=np.float32) for _ in range(4))
        for causal in (False, True):
            fwd_times, bwd_times = [], []
            # One untimed call first: it builds the GPU pipelines and wakes an
            # idle GPU's clocks, which the timed calls would otherwise pay.
            out, lse = flashport.attention(q, k, v, causal=causal, return_lse=True, device=device)
            flashport.attention_backward(do, q, k, v, out, lse, causal=causal, device=device)
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                out, lse = flashport.attention(
                    q, k, v, causal=causal, return_lse=True, device=device
                )
                t1 = time.perf_counter()
                grads = flashport.attention_backward(
                    do, q, k, v, out, lse, causal=causal, device=device
                )
                t2 = time.perf_counter()
                fwd_times.append(t1 - t0)
                bwd_times.append(t2 - t1)
            memory = forward_peak_bytes(shape, causal, device)
            peak = None if memory is None else memory["peak_extra"]
            fwd_err, bwd_err = _check_slice(q, k, v, do, out, lse, grads, causal)
            ok = fwd_err < 1e-4 and bwd_err < 1e-3
            failures += not ok
            flops = 4.0 * args.batch * args.heads * seq * seq * args.dim * (0.5 if causal else 1)
            fwd_t, bwd_t = statistics.median(fwd_times), statistics.median(bwd_times)
            rows.append(
                {
                    "device": label + (f" [seq reduced to {seq}]" if seq != args.seq else ""),
                    "seq": seq,
                    "causal": causal,
                    "forward_ms": fwd_t * 1e3,
                    "forward_gflops": flops / fwd_t / 1e9,
                    "backward_ms": bwd_t * 1e3,
                    "backward_gflops": 2.5 * flops / bwd_t / 1e9,
                    "forward_peak_extra_bytes": peak,
                    "naive_matrices_bytes": 2 * args.batch * args.heads * seq * seq * 4,
                    "forward_rel_err": fwd_err,
                    "backward_rel_err": bwd_err,
                    "ok": ok,
                }
            )
            r = rows[-1]
            mem = "n/a" if peak is None else _gib(peak)
            print(
                f"  {r['device']:<44} causal={causal!s:<5}  "
                f"fwd {r['forward_ms']:9.1f} ms {r['forward_gflops']:7.1f} GFLOP/s   "
                f"bwd {r['backward_ms']:9.1f} ms {r['backward_gflops']:7.1f} GFLOP/s   "
                f"peak extra {mem:>10} (naive S+P: {_gib(r['naive_matrices_bytes'])})   "
                f"err fwd {fwd_err:.1e} bwd {bwd_err:.1e} {'ok' if ok else 'MISMATCH'}",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    print(
        "FLOPs: forward 4·B·H·N²·d (causal: half), backward 2.5× forward. "
        "Errors: max |flashport - float64 reference| / max |reference| on batch 0, head 0."
    )
    return 1 if failures else 0


def run_devices(_: argparse.Namespace) -> int:
    for dev in flashport.devices():
        print(json.dumps(dev, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if sys.platform == "linux" and "XDG_RUNTIME_DIR" not in os.environ:
        # Mesa's Vulkan drivers print an alarming "error:" line per adapter
        # probe when this is unset (common on headless servers). This is our
        # own process, so give it a private one.
        os.environ["XDG_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="flashport-xdg-")
    if argv[:1] == ["bench"]:
        from . import _bench

        return _bench.main(argv[1:])
    if argv[:1] == ["generate"]:
        from . import _generate

        return _generate.main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m flashport", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per row (median)")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    sub.add_parser("devices", help="list the devices flashport can use")
    sub.add_parser(
        "bench",
        help="CPU benchmark against PyTorch and NumPy (see bench --help); "
        "bench dask: flashport.dask against one call (bench dask --help); "
        "bench torch: a transformers training step, flashport against sdpa",
    )
    sub.add_parser(
        "generate",
        help="beam search and parallel sampling of a small NumPy transformer over the paged "
        "KV cache, checked against recomputation (see generate --help)",
    )
    args = parser.parse_args(argv)
    if args.command == "devices":
        return run_devices(args)
    return run_demo(args)


if __name__ == "__main__":
    sys.exit(main())
