"""flashport on the GPU as a user waits for it, against PyTorch SDPA on the
same GPU in the same process (run on the lent NVIDIA machine:
docs/development.md#the-lent-nvidia-machine).

    python3 benchmarks/gpu_bench.py [--shapes 4x16x4096x64,...] [--dtypes float16]
                                    [--reps 7] [--json FILE]

Per shape, dtype and causal flag, medians of `--reps` calls after two
warm-up calls, each call timed with the host clock from the Python call to
its return (flashport's calls return when the GPU is done; the PyTorch
calls are followed by `torch.cuda.synchronize()` inside the timed region):

- `dev fwd`, `dev f+b`: flashport on DeviceArrays (`flashport.to_device`
  once, outside the timing): `attention`, and `attention` + its
  `attention_backward` with the forward's o and lse left on the GPU;
- `np fwd`, `np f+b`: the same with NumPy arrays in and out;
- `kern fwd`, `kern f+b`: the breakdown, the GPU time of the kernels of
  the DeviceArray calls (timestamp queries, summed; measured in calls of
  their own, each right after a timed call, where the extension can
  switch the timestamps off for the timed calls); `outside fwd ms`: `dev fwd` less
  `kern fwd`, and `outside bwd ms` the same for the backward call alone
  (`attention_backward` on DeviceArrays, timed apart from its forward);
- `torch`: SDPA with its default backend choice on CUDA tensors of the
  same dtype; for float16 also `torch FA2` (the FLASH_ATTENTION backend).

With `--ceiling BIN` (the tool `rust/tools/gemm-ceiling`, run first in
a process of its own), the run also measures the fastest float32 FMA and
float16 cooperative-matrix GEMMs written in WGSL through wgpu on this GPU,
and reports each forward as a fraction of the ceiling of its dtype
(`% ceiling`, on `dev fwd`): what a portable backend can reach.

TF/s by the convention of BENCHMARKS.md: forward 4·B·H·N²·d FLOPs, halved
when causal; forward+backward 3.5× that. The last lines are the Markdown
table of BENCHMARKS.md; `--json` writes every number, and
`--table A.json B.json ...` prints one table of the records of several
runs (the ceiling from the first run that measured it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import subprocess
import sys
import time

import flashport
import numpy as np
from flashport import _core

SHAPES = [(4, 16, 1024, 64), (4, 16, 4096, 64), (1, 16, 16384, 64), (4, 16, 4096, 128)]


def flops(shape, causal, backward=False):
    b, h, n, d = shape
    f = 4.0 * b * h * n * n * d / (2 if causal else 1)
    return f * (3.5 if backward else 1.0)


def kernel_seconds():
    """GPU time of the kernels of the calling thread's last call."""
    return sum(t for name, t in _core._gpu_kernel_times() if not name.startswith("host:"))


def phases():
    """Seconds of each GPU time and host phase of the last call, by name."""
    out = {}
    for name, t in _core._gpu_kernel_times():
        out[name] = out.get(name, 0.0) + t
    return out


def median_time(call, reps, warmup=2):
    """Median wall seconds of `call()` over `reps` runs after `warmup`, and
    the median of what each run returned besides (kernel seconds, or a
    dict of phases: the median of each)."""
    walls, extras = [], []
    for i in range(warmup + reps):
        t0 = time.perf_counter()
        extra = call()
        wall = time.perf_counter() - t0
        if i >= warmup:
            walls.append(wall)
            extras.append(extra)
    if not extras or extras[0] is None:
        extra = None
    elif isinstance(extras[0], dict):
        extra = {k: statistics.median(e.get(k, 0.0) for e in extras) for k in extras[0]}
    else:
        extra = statistics.median(extras)
    return statistics.median(walls), extra


def set_timing(on):
    """Kernel timestamps on or off for the calling thread's GPU calls (off
    by default; a wheel built without the test hooks has none)."""
    timing = getattr(_core, "_gpu_kernel_timing", None)
    if timing is not None:
        timing(on)


def paired(call, reps, warmup=2):
    """`call()` with the kernel timestamps off, each followed by the same
    call with them on, so that both see the GPU in the same state: the
    median wall seconds of the first, the median GPU seconds of the
    kernels of the second (what `call` returns; None without timestamps),
    and the median host phases of the first."""
    walls, kerns, host = [], [], []
    for i in range(warmup + reps):
        set_timing(False)
        t0 = time.perf_counter()
        call()
        wall = time.perf_counter() - t0
        ph = {k: v for k, v in phases().items() if k.startswith("host:")}
        set_timing(True)
        kern = call()
        if i >= warmup:
            walls.append(wall)
            kerns.append(kern)
            host.append(ph)
    set_timing(False)
    kern = statistics.median(kerns) if hasattr(_core, "_gpu_kernel_timing") else None
    host = {k: statistics.median(h.get(k, 0.0) for h in host) for k in host[0]}
    return statistics.median(walls), kern, host


def flashport_rows(shape, dtype, causal, reps):
    rng = np.random.default_rng(0)
    b, h, n, d = shape
    q, k, v, do = (
        rng.standard_normal((b, h, n, d), dtype=np.float32).astype(dtype) for _ in range(4)
    )
    dq, dk, dv, ddo = (flashport.to_device(x) for x in (q, k, v, do))
    row = {}

    # Calls on DeviceArrays return once their work is queued: each timed
    # call synchronizes, so that its wall time is until its results exist.
    def dev_fwd():
        flashport.attention(dq, dk, dv, causal=causal)
        flashport.synchronize()
        return kernel_seconds()

    def dev_both():
        o, lse = flashport.attention(dq, dk, dv, causal=causal, return_lse=True)
        kt = kernel_seconds()
        flashport.attention_backward(ddo, dq, dk, dv, o, lse, causal=causal)
        flashport.synchronize()
        return kt + kernel_seconds()

    saved = flashport.attention(dq, dk, dv, causal=causal, return_lse=True)

    def dev_bwd():
        flashport.attention_backward(ddo, dq, dk, dv, *saved, causal=causal)
        flashport.synchronize()
        return kernel_seconds()

    def np_fwd():
        flashport.attention(q, k, v, causal=causal, device="gpu")

    def np_both():
        o, lse = flashport.attention(q, k, v, causal=causal, return_lse=True, device="gpu")
        flashport.attention_backward(do, q, k, v, o, lse, causal=causal, device="gpu")

    row["dev_fwd"], row["kern_fwd"], row["fwd_phases"] = paired(dev_fwd, reps)
    row["dev_both"], row["kern_both"], _ = paired(dev_both, reps)
    row["dev_bwd"], row["kern_bwd"], row["bwd_phases"] = paired(dev_bwd, reps)
    row["np_fwd"], _ = median_time(np_fwd, reps)
    row["np_both"], _ = median_time(np_both, reps)
    set_timing(True)

    def np_both_kernels():
        o, lse = flashport.attention(q, k, v, causal=causal, return_lse=True, device="gpu")
        kt = kernel_seconds()
        flashport.attention_backward(do, q, k, v, o, lse, causal=causal, device="gpu")
        return kt + kernel_seconds()

    def idle_then_dev_both():
        time.sleep(1.0)
        return dev_both()

    # The same kernels on NumPy inputs, and after the GPU idled for 1 s
    # (its clocks drop): whether either changes the kernels' own time.
    _, row["kern_np_both"] = median_time(np_both_kernels, min(reps, 3), warmup=1)
    _, row["kern_both_after_idle"] = median_time(idle_then_dev_both, 2, warmup=0)
    set_timing(False)
    return row


def torch_rows(torch, shape, dtype, causal, reps):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, h, n, d = shape
    tdt = {"float32": torch.float32, "float16": torch.float16}[dtype]
    q, k, v = (
        torch.randn(b, h, n, d, device="cuda", dtype=tdt, requires_grad=True) for _ in range(3)
    )
    g = torch.randn(b, h, n, d, device="cuda", dtype=tdt)

    def fwd():
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        torch.cuda.synchronize()

    def both():
        o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        torch.autograd.grad(o, (q, k, v), g)
        torch.cuda.synchronize()

    rows = {}
    backends = [("torch", None)]
    if dtype == "float16":
        backends.append(("torch FA2", [SDPBackend.FLASH_ATTENTION]))
    for name, chosen in backends:
        if chosen is None:
            rows[name] = (median_time(fwd, reps)[0], median_time(both, reps)[0])
        else:
            with sdpa_kernel(chosen):
                rows[name] = (median_time(fwd, reps)[0], median_time(both, reps)[0])
    return rows


def machine():
    gpu = [d for d in flashport.devices() if d["device"].startswith("gpu")]
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "flashport": flashport.__version__,
        "adapter": gpu[0]["name"] if gpu else None,
        "driver": gpu[0].get("driver") if gpu else None,
        "python": platform.python_version(),
        "command": " ".join(sys.argv),
    }
    try:
        info["nvidia_smi"] = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=name,driver_version,clocks.max.sm",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout.strip()
    except OSError as e:
        info["nvidia_smi"] = f"unavailable: {e}"
    return info


def tf(shape, causal, seconds, backward=False):
    return flops(shape, causal, backward) / seconds / 1e12 if seconds else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=None, help="e.g. 4x16x4096x64,1x16x16384x64")
    ap.add_argument("--dtypes", default="float32,float16")
    ap.add_argument("--causal", default="0,1", help="0, 1 or 0,1")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--ceiling", default=None, help="path of the gemm-ceiling tool")
    ap.add_argument("--table", nargs="+", default=None, help="print the table of these JSON files")
    args = ap.parse_args()
    if args.table:
        runs = []
        for path in args.table:
            with open(path) as f:
                runs.append(json.load(f))
        ceiling = next((r["machine"]["ceiling"] for r in runs if "ceiling" in r["machine"]), {})
        print_table([rec for r in runs for rec in r["records"]], peaks(ceiling))
        return
    shapes = SHAPES
    if args.shapes:
        shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    torch = None
    info = machine()
    if not args.no_torch:
        import torch

        info["torch"] = torch.__version__
    print(json.dumps(info), flush=True)
    ceiling = {}
    if args.ceiling:
        done = subprocess.run(
            [args.ceiling, "--size", "4096", "--reps", "20"],
            capture_output=True,
            text=True,
            check=True,
            timeout=900,
        )
        ceiling = json.loads(done.stdout.strip().splitlines()[-1])
        info["ceiling"] = ceiling
        print(json.dumps(ceiling), flush=True)
    peak = peaks(ceiling)

    records = []
    for shape in shapes:
        for dtype in args.dtypes.split(","):
            for causal in (bool(int(c)) for c in args.causal.split(",")):
                rec = {"shape": shape, "dtype": dtype, "causal": causal}
                rec.update(flashport_rows(shape, dtype, causal, args.reps))
                if torch is not None:
                    rec["torch"] = torch_rows(torch, shape, dtype, causal, args.reps)
                    torch.cuda.empty_cache()
                records.append(rec)
                print(json.dumps(rec), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "records": records}, f, indent=1)

    print_table(records, peak)


def peaks(ceiling):
    """The ceiling of each dtype in TFLOP/s, from the gemm-ceiling tool's record."""
    return {"float32": ceiling.get("f32_fma_tflops"), "float16": ceiling.get("f16_coop_tflops")}


def print_table(records, peak):
    """BENCHMARKS.md's table: TF/s (ms) per cell, rows by shape, float16
    first, non-causal first."""
    head = [
        "shape",
        "dtype",
        "c",
        "dev fwd",
        "dev f+b",
        "np fwd",
        "np f+b",
        "kern fwd",
        "kern f+b",
        "outside fwd ms",
        "outside bwd ms",
        "torch fwd",
        "torch f+b",
        "torch FA2 fwd",
        "torch FA2 f+b",
        "×torch fwd",
        "×torch f+b",
        "% ceiling fwd",
    ]
    print("\n| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    order = {tuple(s): i for i, s in enumerate(SHAPES)}

    def key(r):
        return (order.get(tuple(r["shape"]), len(order)), r["dtype"] != "float16", r["causal"])

    for r in sorted(records, key=key):
        s, c = tuple(r["shape"]), r["causal"]

        def cell(seconds, backward=False, s=s, c=c):
            if not seconds:
                return "–"
            return f"{tf(s, c, seconds, backward):.1f} ({1e3 * seconds:.2f})"

        def outside(wall, kern):
            return f"{1e3 * (wall - kern):.2f}" if wall and kern else "–"

        t = r.get("torch", {})
        ceil = peak.get(r["dtype"])
        tfwd, tboth = t.get("torch", (None, None))
        ffwd, fboth = t.get("torch FA2", (None, None))
        cells = [
            "×".join(map(str, s)),
            r["dtype"],
            str(int(c)),
            cell(r["dev_fwd"]),
            cell(r["dev_both"], True),
            cell(r["np_fwd"]),
            cell(r["np_both"], True),
            cell(r["kern_fwd"]),
            cell(r["kern_both"], True),
            outside(r["dev_fwd"], r["kern_fwd"]),
            outside(r.get("dev_bwd"), r.get("kern_bwd")),
            cell(tfwd),
            cell(tboth, True),
            cell(ffwd),
            cell(fboth, True),
            f"{tfwd / r['dev_fwd']:.3f}" if tfwd else "–",
            f"{tboth / r['dev_both']:.3f}" if tboth else "–",
            f"{100 * tf(s, c, r['dev_fwd']) / ceil:.0f}%" if ceil else "–",
        ]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
