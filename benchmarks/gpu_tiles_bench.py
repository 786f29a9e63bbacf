"""A/B of the GPU kernels' tile configurations in one process, on one GPU.

Each configuration is a set of the benchmark-only environment knobs the
GPU backend reads per call (FLASHPORT_GPU_FORWARD_ROWS,
FLASHPORT_GPU_FORWARD_RI, FLASHPORT_GPU_BACKWARD_ROWS,
FLASHPORT_GPU_PREFETCH, ...). The configurations take turns call by call
(round robin, after one untimed warm-up round that compiles the
pipelines), so a clock or load drift hits them alike. Inputs are
DeviceArrays uploaded once, so the GPU is fed back to back. Kernel time
comes from the timestamp queries (flashport._core._gpu_kernel_times()).

Every configuration's output (and gradients, with --backward) is checked
against a float64 NumPy reference on head (0, 0); the table prints the
largest relative error.

Example (on the lent GPU):
    python3 benchmarks/gpu_tiles_bench.py --shapes 4x16x4096x64 \\
        --config ri4: --config ri8:FLASHPORT_GPU_FORWARD_RI=8
"""

from __future__ import annotations

import argparse
import os
import statistics

import flashport
import numpy as np
from flashport import _core


def parse_config(text):
    name, _, settings = text.partition(":")
    env = {}
    for item in filter(None, settings.split(",")):
        key, _, value = item.partition("=")
        env[key] = value
    return name, env


def kernel_ms():
    return 1e3 * sum(t for name, t in _core._gpu_kernel_times() if not name.startswith("host:"))


def reference(q, k, v, do, causal):
    """Output and gradients of head (0, 0) in float64."""
    q, k, v = (x[0, 0].astype(np.float64) for x in (q, k, v))
    s = q @ k.T / np.sqrt(q.shape[-1])
    if causal:
        n, m = s.shape
        s = np.where(np.tril(np.ones((n, m), dtype=bool), m - n), s, -np.inf)
    p = np.exp(s - s.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    o = p @ v
    if do is None:
        return o, None
    g = do[0, 0].astype(np.float64)
    dp = g @ v.T
    ds = p * (dp - (dp * p).sum(axis=1, keepdims=True)) / np.sqrt(q.shape[-1])
    return o, (ds @ k, ds.T @ q, p.T @ g)


def rel(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


def run(configs, shape, causal, backward, reps):
    B, H, N, d = shape
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((B, H, N, d), dtype=np.float32) for _ in range(3))
    do = rng.standard_normal((B, H, N, d), dtype=np.float32) if backward else None
    dq_, dk_, dv_ = (flashport.to_device(x) for x in (q, k, v))
    ddo = flashport.to_device(do) if backward else None
    times = {name: [] for name, _ in configs}
    errors = {}
    saved = dict(os.environ)
    try:
        for rep in range(reps + 1):
            for name, env in configs:
                os.environ.clear()
                os.environ.update(saved)
                os.environ.update(env)
                o, lse = flashport.attention(dq_, dk_, dv_, causal=causal, return_lse=True)
                t = kernel_ms()
                grads = None
                if backward:
                    grads = flashport.attention_backward(ddo, dq_, dk_, dv_, o, lse, causal=causal)
                    t += kernel_ms()
                if rep > 0:
                    times[name].append(t)
                else:
                    want_o, want_g = reference(q, k, v, do, causal)
                    errs = [rel(o.numpy()[0, 0], want_o)]
                    if backward:
                        errs += [
                            rel(g.numpy()[0, 0], w) for g, w in zip(grads, want_g, strict=True)
                        ]
                    errors[name] = max(errs)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return {name: statistics.median(ts) for name, ts in times.items()}, errors


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--config",
        action="append",
        required=True,
        help="NAME:ENV=VALUE,ENV=VALUE (repeat; the first is the baseline)",
    )
    ap.add_argument("--shapes", default="4x16x4096x64")
    ap.add_argument("--causal", default="0", help="0, 1 or 0,1")
    ap.add_argument("--backward", action="store_true", help="time forward+backward")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    configs = [parse_config(c) for c in args.config]
    base = configs[0][0]
    head = f"{'shape':>15} c {'pass':>7} {'config':>12} {'kern ms':>9} {'TF/s':>7} {'x base':>7}"
    print(head + " err")
    for text in args.shapes.split(","):
        shape = tuple(int(x) for x in text.split("x"))
        B, H, N, d = shape
        for causal in (c == "1" for c in args.causal.split(",")):
            medians, errors = run(configs, shape, causal, args.backward, args.reps)
            work = 4.0 * B * H * N * N * d / (2 if causal else 1) * (3.5 if args.backward else 1)
            for name, _ in configs:
                ms = medians[name]
                print(
                    f"{text:>15} {int(causal)} {'fwd+bwd' if args.backward else 'fwd':>7} "
                    f"{name:>12} {ms:9.3f} {work / ms / 1e9:7.2f} "
                    f"{medians[base] / ms:7.3f} {errors[name]:.1e}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
