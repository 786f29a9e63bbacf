"""flashport's GPU backend against PyTorch SDPA on the same GPU, in one run.

Times, per shape and causal flag, forward and forward+backward of:
- flashport (device="gpu", float32, or float16 with --dtype float16): GPU
  kernel time from timestamp queries
  (flashport._core._gpu_kernel_times(), summed over the call's kernels) and
  end-to-end wall time of the call, NumPy in to NumPy out (uploads,
  kernels, downloads); medians over --reps calls after one warm-up call;
- flashport forward+backward on DeviceArrays: q, k, v and do uploaded once
  (flashport.to_device, timed apart), the forward's o and lse passed to the
  backward on the GPU; wall time of the two calls ("device-only", the calls
  return when the GPU is done) and until dq, dk, dv are NumPy arrays;
- PyTorch SDPA float32 (EFFICIENT_ATTENTION backend, TF32 inside) and
  bfloat16 / float16 FLASH_ATTENTION, on CUDA tensors: triton's do_bench,
  median (as in shared/anchors/torch_gpu_anchor.py).
FLOPs as in PERFORMANCE.md: forward 4*B*H*N*N*d (halved when causal),
forward+backward 3.5x that. Ratios are flashport kernel speed over each
torch backend's speed (>1: flashport faster). Also checks flashport's
output (and gradients) against a float64 torch reference on head 0.

Run on the lent GPU (see benchmarks/GPU_NOTES.md for the exact command):
    python3 benchmarks/gpu_bench.py --json $OUT/gpu_bench.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import flashport
import numpy as np
from flashport import _core

SHAPES = [(4, 16, 1024, 64), (4, 16, 4096, 64), (1, 16, 16384, 64), (4, 16, 4096, 128)]


def flops(B, H, N, d, causal, bwd=False):
    f = 4.0 * B * H * N * N * d / (2 if causal else 1)
    return f * (3.5 if bwd else 1.0)


def kernel_seconds():
    return sum(t for name, t in _core._gpu_kernel_times() if not name.startswith("host:"))


def breakdown():
    """Per kernel and host phase of the last call, seconds (summed by name)."""
    out = {}
    for name, t in _core._gpu_kernel_times():
        out[name] = out.get(name, 0.0) + t
    return out


def output_gradient(q, v):
    rng = np.random.default_rng(7)
    return rng.standard_normal((*q.shape[:3], v.shape[3]), dtype=np.float32).astype(q.dtype)


def time_flashport(q, k, v, causal, reps, backward):
    """(median kernel s, median end-to-end s, outputs of the last call)."""
    do = output_gradient(q, v) if backward else None
    ks, es = [], []
    res = None
    for i in range(reps + 1):
        t0 = time.perf_counter()
        o, lse = flashport.attention(q, k, v, causal=causal, return_lse=True, device="gpu")
        kt = kernel_seconds()
        parts = {"fwd " + n: t for n, t in breakdown().items()}
        grads = None
        if backward:
            grads = flashport.attention_backward(do, q, k, v, o, lse, causal=causal, device="gpu")
            kt += kernel_seconds()
            parts.update({"bwd " + n: t for n, t in breakdown().items()})
        t1 = time.perf_counter()
        if i > 0:  # the first call compiles pipelines
            ks.append(kt)
            es.append(t1 - t0)
        res = (o, lse, do, grads)
    time_flashport.last_parts = parts
    return statistics.median(ks), statistics.median(es), res


def time_flashport_device(q, k, v, causal, reps):
    """Forward+backward on DeviceArrays: a dict of the one-time upload of q, k,
    v, do and the medians of kernel time, device-only wall time (the two
    calls) and wall time until dq, dk, dv are NumPy; and those gradients."""
    do = output_gradient(q, v)
    t0 = time.perf_counter()
    tq, tk, tv, tdo = (flashport.to_device(x) for x in (q, k, v, do))
    upload = time.perf_counter() - t0
    ks, ds, es = [], [], []
    grads = None
    for i in range(reps + 1):
        t0 = time.perf_counter()
        o, lse = flashport.attention(tq, tk, tv, causal=causal, return_lse=True)
        kt = kernel_seconds()
        dq, dk, dv = flashport.attention_backward(tdo, tq, tk, tv, o, lse, causal=causal)
        kt += kernel_seconds()
        t1 = time.perf_counter()
        grads = tuple(g.numpy() for g in (dq, dk, dv))
        t2 = time.perf_counter()
        if i > 0:  # the first call compiles pipelines
            ks.append(kt)
            ds.append(t1 - t0)
            es.append(t2 - t0)
    times = {
        "upload_s": upload,
        "kernel_s": statistics.median(ks),
        "device_s": statistics.median(ds),
        "e2e_s": statistics.median(es),
    }
    return times, grads


def rel(a, b):
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def check_head0(torch, q, k, v, causal, res):
    """Relative errors of head (0, 0) against float64 torch on the GPU."""
    o, _, do, grads = res
    dev = "cuda"
    tq, tk, tv = (
        torch.tensor(x[0, 0], dtype=torch.float64, device=dev, requires_grad=True)
        for x in (q, k, v)
    )
    n = tq.shape[0]
    s = (tq @ tk.T) / np.sqrt(q.shape[-1])
    if causal:
        mask = torch.ones(n, tk.shape[0], dtype=torch.bool, device=dev).tril(tk.shape[0] - n)
        s = s.masked_fill(~mask, float("-inf"))
    ref = torch.softmax(s, -1) @ tv
    out = {"out": rel(o[0, 0], ref.detach().cpu().numpy())}
    if grads is not None:
        g = torch.autograd.grad(
            ref, (tq, tk, tv), torch.tensor(do[0, 0], dtype=torch.float64, device=dev)
        )
        for name, mine, want in zip(("dq", "dk", "dv"), grads, g, strict=True):
            out[name] = rel(mine[0, 0], want.cpu().numpy())
    del tq, tk, tv, s, ref
    torch.cuda.empty_cache()
    return out


def time_torch(torch, F, tt, backend, dtype, B, H, N, d, causal):
    q, k, v = (
        torch.randn(B, H, N, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3)
    )
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel([backend]):
        fwd = tt.do_bench(
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal), return_mode="median"
        )
        o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        g = torch.randn_like(o)
        both = tt.do_bench(
            lambda: torch.autograd.grad(
                F.scaled_dot_product_attention(q, k, v, is_causal=causal), (q, k, v), g
            ),
            return_mode="median",
        )
    return fwd / 1e3, both / 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument(
        "--no-simple", action="store_true", help="skip the simple forward kernel for comparison"
    )
    ap.add_argument("--fwd-only", action="store_true")
    ap.add_argument(
        "--no-device-arrays", action="store_true", help="skip forward+backward on DeviceArrays"
    )
    ap.add_argument("--shapes", default=None, help="e.g. 4x16x4096x64,1x16x16384x64")
    ap.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "float16"],
        help="flashport's input dtype (the PyTorch columns are the same either way)",
    )
    args = ap.parse_args()
    shapes = SHAPES
    if args.shapes:
        shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]

    gpu = [d for d in flashport.devices() if d["device"] == "gpu"]
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "flashport_gpu": gpu[0] if gpu else None,
        "python": platform.python_version(),
        "command": " ".join(sys.argv),
    }
    try:
        info["nvidia_smi"] = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout.strip()
    except Exception as e:
        info["nvidia_smi"] = f"unavailable: {e}"
    torch = F = tt = None
    if not args.no_torch:
        import torch
        import torch.nn.functional as F
        import triton.testing as tt

        info["torch"] = torch.__version__
        info["cuda_device"] = torch.cuda.get_device_name()
    print(json.dumps(info, default=str), flush=True)

    records = []
    rng = np.random.default_rng(0)
    for B, H, N, d in shapes:
        q, k, v = (
            rng.standard_normal((B, H, N, d), dtype=np.float32).astype(args.dtype) for _ in range(3)
        )
        for causal in (False, True):
            rec = {"shape": [B, H, N, d], "causal": causal}
            kf, ef, res = time_flashport(q, k, v, causal, args.reps, backward=False)
            rec["fp_fwd_kernel_s"], rec["fp_fwd_e2e_s"] = kf, ef
            rec["fp_fwd_parts_s"] = time_flashport.last_parts
            resb = res
            if not args.fwd_only:
                kb, eb, resb = time_flashport(
                    q, k, v, causal, max(2, args.reps // 2), backward=True
                )
                rec["fp_fwdbwd_kernel_s"], rec["fp_fwdbwd_e2e_s"] = kb, eb
                rec["fp_fwdbwd_parts_s"] = time_flashport.last_parts
                if not args.no_device_arrays:
                    times, dev_grads = time_flashport_device(
                        q, k, v, causal, max(2, args.reps // 2)
                    )
                    rec.update({f"fp_dev_fwdbwd_{n}": t for n, t in times.items()})
                    # The same bits as the NumPy path.
                    rec["dev_same_as_numpy"] = all(
                        a.tobytes() == b.tobytes() for a, b in zip(dev_grads, resb[3], strict=True)
                    )
            if not args.no_simple:
                os.environ["FLASHPORT_GPU_KERNELS"] = "simple"
                ks, es, ress = time_flashport(q, k, v, causal, 2, backward=False)
                del os.environ["FLASHPORT_GPU_KERNELS"]
                rec["fp_simple_fwd_kernel_s"], rec["fp_simple_fwd_e2e_s"] = ks, es
                rec["simple_vs_tiled_out_rel"] = rel(ress[0], res[0])
            if torch is not None:
                rec["check"] = check_head0(torch, q, k, v, causal, resb)
                from torch.nn.attention import SDPBackend

                for name, be, dt in (
                    ("t32", SDPBackend.EFFICIENT_ATTENTION, torch.float32),
                    ("bf16", SDPBackend.FLASH_ATTENTION, torch.bfloat16),
                    ("f16", SDPBackend.FLASH_ATTENTION, torch.float16),
                ):
                    try:
                        rec[f"{name}_fwd_s"], rec[f"{name}_fwdbwd_s"] = time_torch(
                            torch, F, tt, be, dt, B, H, N, d, causal
                        )
                    except Exception as e:
                        rec[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
                    torch.cuda.empty_cache()
            records.append(rec)
            print(json.dumps(rec), flush=True)
        del q, k, v

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "records": records}, f, indent=1)

    # The table, last.
    print()
    print(
        f"flashport GPU ({args.dtype}) vs PyTorch SDPA, {info.get('cuda_device', '?')}, "
        f"driver {info['flashport_gpu'] and info['flashport_gpu'].get('driver')}, {info['date']}"
    )
    hdr = (
        f"{'shape':>16} {'c':>1} {'pass':>7} | {'kern ms':>8} {'kern TF/s':>9} {'e2e ms':>8} | "
        f"{'dev ms':>7} {'dev>np ms':>9} | "
        f"{'t32 ms':>7} {'x t32':>6} | {'bf16 ms':>7} {'x bf16':>6} | {'f16 ms':>7} {'x f16':>6} | "
        f"{'simple ms':>9}"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in records:
        B, H, N, d = r["shape"]
        for pas, bwd in (("fwd", False), ("fwd+bwd", True)):
            key = "fwdbwd" if bwd else "fwd"
            if f"fp_{key}_kernel_s" not in r:
                continue
            kern = r[f"fp_{key}_kernel_s"]
            e2e = r[f"fp_{key}_e2e_s"]
            tf = flops(B, H, N, d, r["causal"], bwd) / kern / 1e12 if kern > 0 else float("nan")
            cols = []
            for name in ("t32", "bf16", "f16"):
                t = r.get(f"{name}_{key}_s")
                cols.append(
                    f"{t * 1e3:7.3f} {t / kern:6.3f}" if t and kern > 0 else f"{'-':>7} {'-':>6}"
                )
            simple = r.get("fp_simple_fwd_kernel_s") if not bwd else None
            dev = r.get("fp_dev_fwdbwd_device_s") if bwd else None
            dev_np = r.get("fp_dev_fwdbwd_e2e_s") if bwd else None
            dev_cols = (
                f"{dev * 1e3:7.1f} {dev_np * 1e3:9.1f}" if dev is not None else f"{'-':>7} {'-':>9}"
            )
            print(
                f"{B}x{H}x{N}x{d:<4} {int(r['causal']):>1} {pas:>7} | "
                f"{kern * 1e3:8.3f} {tf:9.2f} {e2e * 1e3:8.1f} | {dev_cols} | "
                + " | ".join(cols)
                + f" | {simple * 1e3 if simple else float('nan'):9.3f}"
            )
    print("x <backend> = torch time / flashport kernel time (>1: flashport faster).")
    print(
        "dev ms: forward+backward on DeviceArrays (q, k, v, do uploaded once, o and lse kept "
        "on the GPU), the two calls; dev>np ms: until dq, dk, dv are NumPy arrays."
    )
    for r in records:
        if "fp_dev_fwdbwd_upload_s" in r:
            print(
                f"device arrays {r['shape']} causal={int(r['causal'])}: one-time upload of "
                f"q, k, v, do {r['fp_dev_fwdbwd_upload_s'] * 1e3:.1f} ms; "
                f"kernels {r['fp_dev_fwdbwd_kernel_s'] * 1e3:.3f} ms; "
                f"same bits as NumPy in: {r['dev_same_as_numpy']}"
            )
    for r in records:
        parts = r.get("fp_fwdbwd_parts_s") or r.get("fp_fwd_parts_s") or {}
        print(
            f"parts {r['shape']} causal={int(r['causal'])} (last call, ms): "
            + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in parts.items())
        )
    for r in records:
        if "check" in r:
            print(
                f"check {r['shape']} causal={int(r['causal'])}: rel err vs float64 "
                + ", ".join(f"{k} {v:.2e}" for k, v in r["check"].items())
                + (
                    f"; simple vs tiled out {r['simple_vs_tiled_out_rel']:.1e}"
                    if "simple_vs_tiled_out_rel" in r
                    else ""
                )
            )


if __name__ == "__main__":
    main()
