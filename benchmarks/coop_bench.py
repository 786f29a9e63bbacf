"""The cooperative-matrix float16 forward against the other GPU forwards,
by GPU kernel time (timestamp queries), with a float64 check on one head.

Run on the lent GPU, each a fresh process (the device enables cooperative
matrices at creation). Labels "coop" and "off" also time the float32 tiled
forward before and after; other labels time float16 only:
    python3 benchmarks/coop_bench.py coop
    FLASHPORT_GPU_COOP=0 python3 benchmarks/coop_bench.py off  # scalar f16
    FLASHPORT_GPU_COOP_TILES=4,64 python3 benchmarks/coop_bench.py t4x64
Shapes as BxHxNxd arguments after the label (default 4x16x1024x64 4x16x4096x64).
TFLOP/s by 4*B*H*N^2*d, halved when causal.
"""

import json
import statistics
import sys

import flashport
import numpy as np
from flashport import _core

label = sys.argv[1]
shapes = [(4, 16, 1024, 64), (4, 16, 4096, 64)]
if len(sys.argv) > 2:
    shapes = [tuple(int(x) for x in s.split("x")) for s in sys.argv[2:]]
results = []


def reference(q, k, v, causal):
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    s = q @ k.T / np.sqrt(q.shape[-1])
    if causal:
        s = np.where(np.tril(np.ones(s.shape, bool)), s, -np.inf)
    m = s.max(axis=1, keepdims=True)
    e = np.exp(s - m)
    total = e.sum(axis=1, keepdims=True)
    return (e @ v) / total, (m + np.log(total))[:, 0]


for B, H, N, d in shapes:
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((B, H, N, d)).astype(np.float16) for _ in range(3))
    # float32 before and after float16: whether the cooperative kernel or
    # the device's cooperative-matrix setup changes the float32 kernel.
    for run in ["float32", "float16", "float32-after"]:
        if run != "float16" and label not in ("coop", "off"):
            continue
        dtype = run.split("-")[0]
        qq, kk, vv = (x.astype(dtype) for x in (q, k, v))
        for causal in [False, True]:
            times = []
            for i in range(4):
                o, lse = flashport.attention(
                    qq, kk, vv, causal=causal, return_lse=True, device="gpu"
                )
                kt = [(n, t) for n, t in _core._gpu_kernel_times() if not n.startswith("host:")]
                if i > 0:
                    times.append(sum(t for _, t in kt))
            t = statistics.median(times)
            fl = 4.0 * B * H * N * N * d / (2 if causal else 1)
            ro, rl = reference(q[0, 0], k[0, 0], v[0, 0], causal)
            eo = float(np.abs(o[0, 0].astype(np.float64) - ro).max() / np.abs(ro).max())
            el = float(np.abs(lse[0, 0] - rl).max() / np.abs(rl).max())
            r = dict(
                label=label,
                shape=[B, H, N, d],
                dtype=run,
                causal=causal,
                kernels=sorted({n for n, _ in kt}),
                ms=t * 1e3,
                tflops=fl / t / 1e12,
                err_out=eo,
                err_lse=el,
            )
            results.append(r)
            print(json.dumps(r), flush=True)
