"""Attention variants on the GPU: kernel time of each against the attention
it modifies or cuts down, in one run (run on the lent GPU, like
gpu_bench.py):

    python3 benchmarks/gpu_variants_bench.py [--shape 4 16 4096 64]

Rows: causal, causal + window (256, 0), dense, a block-sparse boolean mask
(64×64 blocks, ~11% kept), softcap, ALiBi, sinks and dropout on the dense
problem. Cells: median GPU kernel ms (timestamp queries) of the forward and
of forward+backward, and the speed-up over the row's baseline. Also checks
each against the float64 reference on the first (batch, head).
"""

from __future__ import annotations

import argparse
import statistics

import flashport
import numpy as np
from flashport import _core, reference
from flashport._bench import SPARSE_BLOCK, SPARSE_DENSITY, block_sparse_mask


def kernel_seconds() -> float:
    return sum(t for name, t in _core._gpu_kernel_times() if not name.startswith("host:"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", type=int, nargs=4, default=[4, 16, 4096, 64])
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    # Kernel times are this script's measure: timestamp queries on.
    _core._gpu_kernel_timing(True)
    shape = tuple(args.shape)
    heads, seq = shape[1], shape[2]
    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal(shape, dtype=np.float32) for _ in range(4))
    mask = block_sparse_mask(seq, SPARSE_BLOCK, SPARSE_DENSITY)
    rows = {
        "causal": ("causal", {"causal": True}),
        "causal + window (256, 0)": ("causal", {"causal": True, "window": (256, 0)}),
        "dense": ("dense", {}),
        f"block mask {100 * mask.mean():.0f}% kept": ("dense", {"mask": mask}),
        "softcap 30": ("dense", {"softcap": 30.0}),
        "alibi": ("dense", {"alibi_slopes": 2.0 ** -np.arange(1, heads + 1)}),
        "sinks": ("dense", {"sinks": rng.standard_normal(heads).astype(np.float32)}),
        "dropout 0.1": ("dense", {"dropout_p": 0.1, "seed": 5}),
    }
    times = {}
    print(f"GPU variants at {shape} float32, kernel ms (median of {args.reps})")
    print(
        f"{'variant':<28}{'fwd ms':>9}{'f+b ms':>9}{'fwd vs base':>13}{'f+b vs base':>13}"
        f"{'err out':>10}{'err dq':>10}"
    )
    for name, (base, kw) in rows.items():
        fwd, total = [], []
        for i in range(args.reps + 1):
            o, lse = flashport.attention(q, k, v, return_lse=True, device="gpu", **kw)
            f = kernel_seconds()
            flashport.attention_backward(do, q, k, v, o, lse, device="gpu", **kw)
            if i > 0:
                fwd.append(f)
                total.append(f + kernel_seconds())
        times[name] = (statistics.median(fwd), statistics.median(total))
        grads = flashport.attention_backward(do, q, k, v, o, lse, device="gpu", **kw)
        one = {
            key: (val[:1, :1] if key in ("mask",) and val.ndim == 4 else val)
            for key, val in kw.items()
        }
        if "alibi_slopes" in one:
            one["alibi_slopes"] = one["alibi_slopes"][:1]
        if "sinks" in one:
            one["sinks"] = one["sinks"][:1]
        err_out = err_dq = float("nan")
        if "dropout_p" not in kw:
            ro = reference.attention(q[0, :1], k[0, :1], v[0, :1], **one)
            rg = reference.attention_backward(do[0, :1], q[0, :1], k[0, :1], v[0, :1], **one)
            err_out = float(np.abs(o[0, :1] - ro).max() / np.abs(ro).max())
            err_dq = float(np.abs(grads[0][0, :1] - rg[0]).max() / np.abs(rg[0]).max())
        b = times[rows[name][0]] if name != base else None
        gain = (
            f"{b[0] / times[name][0]:12.2f}x{b[1] / times[name][1]:12.2f}x"
            if b
            else f"{'(base)':>13}{'(base)':>13}"
        )
        print(
            f"{name:<28}{times[name][0] * 1e3:9.2f}{times[name][1] * 1e3:9.2f}{gain}"
            f"{err_out:10.1e}{err_dq:10.1e}",
            flush=True,
        )


if __name__ == "__main__":
    main()
