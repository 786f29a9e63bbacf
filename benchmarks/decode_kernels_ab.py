"""A/B of decoding's two GPU kernels in one process: attention_with_kvcache
on DeviceArrays (by default 32 query heads over 8 key/value heads, d = 128;
one query row per sequence, full caches), the workgroup kernel (overrides
no_subgroups=True) against the subgroup kernel in the layouts and split
counts given, interleaved round by round after a warm-up (an H100's clocks
ramp up over its first calls). Prints, per case and configuration, the
median wall time and the median kernel timestamps (the decode kernel, the
combine pass), the bandwidth of the K and V bytes over each, and the
largest difference from the workgroup kernel's output. Needs the
development build (cargo feature ``testing``: the overrides).

With ``--paged BLOCK`` the caches are pools of BLOCK-key blocks in a
random order with their block tables (as a cache manager leaves them);
with ``--torch`` the same process also times PyTorch's SDPA
(``enable_gqa=True``) on the contiguous caches and a CUDA device copy of
2 GiB (read + written), the vendor's bandwidth the fractions are quoted
against. Two builds (a baseline wheel, a branch) compare by running this
script in two processes on the same machine, alternately.

Usage: python benchmarks/decode_kernels_ab.py [--rounds 6] [--calls 15]
       [--shapes 1x131072,8x32768,32x4096] [--paged 16] [--torch]
       [--heads 32/8] [--dim 128]
       [--configs subgroup,...] [--json out.json]

BENCHMARKS.md ("The subgroup decode kernel (H100)") quotes runs of it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import flashport as fp
import numpy as np
from flashport import _core
from flashport._bench.decode import paged_cache

HEADS_Q, HEADS_KV, D = 32, 8, 128
# Configurations: (test overrides, num_splits per batch size or None).
# The workgroup kernel's default split counts on a discrete GPU (twice the
# subgroup kernel's) at the default shapes.
WORKGROUP_SPLITS = {1: 128, 8: 16, 32: 4}
FEWER_SPLITS = {1: 32, 8: 4, 32: 1}
MORE_SPLITS = {1: 256, 8: 32, 32: 8}
CONFIGS = {
    "subgroup": ({}, None),
    "workgroup": ({"no_subgroups": True}, None),
    "subgroup-8-keys": ({"decode_keys": 8}, None),
    "subgroup-8-keys-prefetch": ({"decode_keys": 8, "decode_prefetch": True}, None),
    "subgroup-prefetch": ({"decode_prefetch": True}, None),
    "subgroup-no-prefetch": ({"decode_prefetch": False}, None),
    "subgroup-checked": ({"decode_checked": True}, None),
    "subgroup-8-lanes": ({"decode_lanes": 8}, None),
    "subgroup-256-invocations": ({"decode_workgroup": 256}, None),
    "subgroup-64-invocations": ({"decode_workgroup": 64}, None),
    "subgroup-workgroup-splits": ({}, WORKGROUP_SPLITS),
    "subgroup-fewer-splits": ({}, FEWER_SPLITS),
    "subgroup-more-splits": ({}, MORE_SPLITS),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--calls", type=int, default=15)
    ap.add_argument("--shapes", default="1x131072,8x32768,32x4096")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--paged", type=int, default=0, help="block size (0: contiguous caches)")
    ap.add_argument("--torch", action="store_true")
    ap.add_argument("--json")
    ap.add_argument(
        "--heads", default=f"{HEADS_Q}/{HEADS_KV}", help="query/key-value heads (default 32/8)"
    )
    ap.add_argument("--dim", type=int, default=D, help="head dimension d = d_v (default 128)")
    args = ap.parse_args()
    heads_q, heads_kv = (int(x) for x in args.heads.split("/"))
    d = args.dim
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    configs = {name: CONFIGS[name] for name in args.configs.split(",")}
    base = np.random.default_rng(0).standard_normal(1 << 22).astype(np.float32)

    def arr(shape, dtype):
        return np.resize(base, int(np.prod(shape))).reshape(shape).astype(dtype)

    torch = None
    if args.torch:
        import torch
        import torch.nn.functional as F

        x = torch.empty(1 << 29, dtype=torch.float32, device="cuda")
        y = torch.empty_like(x)
        copy = torch_medians(torch, lambda: y.copy_(x), 50)
        copy_bw = 2 * x.numel() * 4 / copy
        print(
            f"torch CUDA copy of 2 GiB: {copy * 1e3:.3f} ms, "
            f"{copy_bw / 1e9:.0f} GB/s (read + written)"
        )
        del x, y
    cases = {}
    torch_ms = {}
    for dtype in ("float32", "float16"):
        for b, n in shapes:
            qh = arr((b, heads_q, 1, d), dtype) * 0.3
            kh = arr((b, heads_kv, n, d), dtype)
            vh = arr((b, heads_kv, n, d), dtype)[:, :, ::-1].copy()
            kv_bytes = 2 * b * heads_kv * n * d * np.dtype(dtype).itemsize
            if torch is not None:
                tq, tk, tv = (torch.from_numpy(a).cuda() for a in (qh, kh, vh))

                def sdpa(tq=tq, tk=tk, tv=tv):
                    return F.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)

                torch_ms[(dtype, b, n)] = torch_medians(torch, sdpa, 100) * 1e3
                del tq, tk, tv
            table = None
            if args.paged:
                kh, table = paged_cache(kh, args.paged)
                vh, _ = paged_cache(vh, args.paged)
            q, k, v = (fp.to_device(a) for a in (qh, kh, vh))
            cases[(dtype, b, n)] = (q, k, v, np.full(b, n, np.int32), kv_bytes, table)
    splits: dict[int, int] = {}

    def use(config):
        knobs, per_batch = config
        _core._testing_set_overrides(**knobs)
        splits.clear()
        splits.update(per_batch or {})

    def call(key):
        q, k, v, lens, _, table = cases[key]
        num_splits = splits.get(key[1])
        return fp.attention_with_kvcache(
            q,
            k,
            v,
            lens,
            block_table=table,
            device="gpu",
            return_lse=True,
            num_splits=num_splits,
        )

    # Kernel timestamps on (opt-in on main since 94df349): the wall times
    # include their cost, 0.04-0.3 ms a call on an H100, for every
    # configuration alike (BENCHMARKS.md's run had them on).
    _core._gpu_kernel_timing(True)
    largest = max(cases, key=lambda key: cases[key][4])
    for config in configs.values():
        use(config)
        for _ in range(10):
            call(largest)
        for key in cases:
            call(key)
    results = {}
    for key, case in cases.items():
        walls = {c: [] for c in configs}
        kernels = {c: [] for c in configs}
        outputs = {}
        names = list(configs)
        for r in range(args.rounds):
            for c in names[r % len(names) :] + names[: r % len(names)]:
                use(configs[c])
                if r == 0:
                    out, lse = call(key)
                    outputs[c] = (out.numpy().astype(np.float64), lse.numpy().astype(np.float64))
                times = []
                for _ in range(args.calls):
                    t = time.perf_counter()
                    call(key)
                    times.append(time.perf_counter() - t)
                    kernels[c].append(
                        {n: s for n, s in _core._gpu_kernel_times() if not n.startswith("host:")}
                    )
                walls[c].append(statistics.median(times))
        for c in names:
            wall = statistics.median(walls[c])
            ks = kernels[c]
            decode = statistics.median(
                sum(s for n, s in d.items() if n in ("decode", "decode_subgroup")) for d in ks
            )
            combine = statistics.median(d.get("decode_combine", 0.0) for d in ks)
            total = statistics.median(sum(d.values()) for d in ks)
            ref_out, ref_lse = outputs[names[0]]
            out, lse = outputs[c]
            row = {
                "wall_ms": wall * 1e3,
                "decode_ms": decode * 1e3,
                "combine_ms": combine * 1e3,
                "kernels_ms": total * 1e3,
                "wall_gbs": case[4] / wall / 1e9,
                "decode_gbs": case[4] / decode / 1e9 if decode else None,
                "max_diff": [
                    float(np.abs(out - ref_out).max()),
                    float(np.abs(lse - ref_lse).max()),
                ],
            }
            if key in torch_ms:
                row["torch_ms"] = torch_ms[key]
                row["vs_torch"] = torch_ms[key] / row["wall_ms"]
                row["of_copy"] = row["wall_gbs"] * 1e9 / copy_bw
            results[f"{key[0]} {key[1]}x{key[2]} {c}"] = row
            extra = ""
            if key in torch_ms:
                extra = (
                    f" | {row['of_copy']:.0%} of copy, torch {torch_ms[key]:.3f} ms, "
                    f"{row['vs_torch']:.2f}x torch"
                )
            print(
                f"{key[0]:8s} {key[1]:2d}x{key[2]:<6d} {c:26s} wall {row['wall_ms']:7.3f} ms "
                f"{row['wall_gbs']:6.0f} GB/s | decode {row['decode_ms']:6.3f} ms "
                f"{row['decode_gbs'] or 0:6.0f} GB/s, combine {row['combine_ms']:.3f} ms | "
                f"vs {names[0]} {row['max_diff'][0]:.1e} {row['max_diff'][1]:.1e}{extra}",
                flush=True,
            )
    _core._testing_set_overrides()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


def torch_medians(torch, fn, calls: int) -> float:
    """Median seconds of ``fn`` on the GPU, each call timed by CUDA events
    after a warm-up of the same length."""
    for _ in range(calls):
        fn()
    times = []
    for _ in range(calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


if __name__ == "__main__":
    main()
