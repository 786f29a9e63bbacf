"""How the GPU's idle clock shows in kernel times: the same (1,8,4096,64)
forward, four calls per row, rows separated by a 1 s pause (run on the lent
GPU: `python3 benchmarks/idle_clock_diag.py`). Prints, per call, the wall
time of the NumPy-to-NumPy forward and its kernel time (timestamp queries);
each forward is followed by its backward, as in `python -m flashport`.
Session 3's output: gpu-results/2026-11-22-h100-s3warm-idle-diag.log.
"""

import time

import flashport
import numpy as np


def kernel_ms() -> float:
    times = flashport._core._gpu_kernel_times()
    return 1e3 * sum(t for name, t in times if not name.startswith("host:"))


def main() -> None:
    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((1, 8, 4096, 64), dtype=np.float32) for _ in range(4))
    for causal in (False, True, True, False):
        calls = []
        for _ in range(4):
            t0 = time.perf_counter()
            o, lse = flashport.attention(q, k, v, causal=causal, return_lse=True, device="gpu")
            wall = 1e3 * (time.perf_counter() - t0)
            calls.append((round(wall, 1), round(kernel_ms(), 2)))
            flashport.attention_backward(do, q, k, v, o, lse, causal=causal, device="gpu")
        print("causal", causal, "fwd (e2e ms, kernel ms):", calls, flush=True)
        time.sleep(1.0)


if __name__ == "__main__":
    main()
