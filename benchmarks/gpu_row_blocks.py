"""The register-tiled float32 forward's GPU time by the height of its row
blocks: the tiles the backend picks for d = 128 (44 rows, V loaded over K,
no prefetch) and smaller ones, and d = 64's own tiles (64 rows, K and V
side by side, the register prefetch) against d = 64 in d = 128's structure.
The blocks are forced through the workgroup-memory override, which makes
the tile choice (`tiles::tiled_forward_tiles`) fall to smaller tiles.
Prints per case the median kernel timestamps of the forward on
DeviceArrays. Needs the development build (cargo feature ``testing``: the
overrides and timestamps).

Usage: python benchmarks/gpu_row_blocks.py [--reps 7]

docs/gpu.md ("What limits each tier") quotes a run of it.
"""

from __future__ import annotations

import argparse
import statistics

import flashport as fp
import numpy as np
from flashport import _core

# (shape, workgroup-memory bytes or None for the adapter's, what the
# tiles are on NVIDIA's 48 KiB: tiles::tiled_forward_tiles).
CASES = [
    ((4, 16, 4096, 128), None, "44 rows, V over K"),
    ((4, 16, 4096, 128), 44032, "40 rows, V over K"),
    ((4, 16, 4096, 128), 38656, "32 rows, V over K"),
    ((4, 16, 4096, 128), 27904, "16 rows, V over K"),
    ((4, 16, 4096, 64), None, "64 rows, K and V side by side, prefetch"),
    ((4, 16, 4096, 64), 27904, "44 rows, V over K"),
]


def kernel_ms(shape, workgroup_bytes, reps):
    rng = np.random.default_rng(0)
    q, k, v = (fp.to_device(rng.standard_normal(shape, dtype=np.float32)) for _ in range(3))
    _core._testing_set_overrides(workgroup_bytes=workgroup_bytes)
    _core._gpu_kernel_timing(True)
    try:
        times = []
        for i in range(3 + reps):
            fp.attention(q, k, v)
            t = sum(s for name, s in _core._gpu_kernel_times() if not name.startswith("host:"))
            if i >= 3:
                times.append(t)
    finally:
        _core._gpu_kernel_timing(False)
        _core._testing_set_overrides()
    return 1e3 * statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    print("| shape | workgroup bytes | tiles (48 KiB adapter) | kernel ms | TFLOP/s |")
    print("|---|---|---|---|---|")
    for shape, wb, tiles in CASES:
        ms = kernel_ms(shape, wb, args.reps)
        b, h, n, d = shape
        tflops = 4 * b * h * n * n * d / (ms * 1e-3) / 1e12
        label = "×".join(map(str, shape))
        print(f"| {label} | {wb or 'adapter'} | {tiles} | {ms:.2f} | {tflops:.1f} |", flush=True)


if __name__ == "__main__":
    main()
