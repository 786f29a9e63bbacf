"""``python -m flashport bench varlen``: a packed batch of mixed lengths with
``attention_varlen`` against the same batch padded to its longest sequence
with ``attention`` (and PyTorch SDPA on the padded batch, on the CPU, when
torch is importable).

Each cell is the median wall time of the public call as its user makes it,
on the arrays that API takes (packed ``(total, heads, d)`` with
``cu_seqlens``, or padded ``(batch, heads, longest, d)``), NumPy arrays in and
out; packing or padding the data is not timed. The padded calls are correct
for every real row: causal needs nothing more (the padding keys lie after
every real query), non-causal gets a key-padding mask. Forward is one call;
forward+backward is the forward with ``return_lse=True`` followed by the
backward. ``work`` is the ratio of the (query, key) pairs the padded call's
rows see (padding rows included; the key-padding mask hides the padding keys
from the real rows, and flashport skips the tiles it hides entirely) to those
of the packed call: roughly the speed-up that no padding work should give.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable

import numpy as np

import flashport

from .timing import interleaved_medians, torch_or_none, torch_sdpa_cases

# The mix: sequences from 64 to 4096 tokens.
FULL = {"sequences": 12, "shortest": 64, "longest": 4096, "heads": 4, "repeat": 3}
QUICK = {"sequences": 8, "shortest": 64, "longest": 1024, "heads": 4, "repeat": 3}


def mixed_lengths(count: int, shortest: int, longest: int, seed: int = 0) -> list[int]:
    """``count`` lengths, log-uniform between ``shortest`` and ``longest``
    (both included), in a fixed random order."""
    rng = np.random.default_rng(seed)
    inner = np.exp(rng.uniform(np.log(shortest), np.log(longest), max(count - 2, 0)))
    lengths = [shortest, longest, *(round(float(x)) for x in inner)][:count]
    rng.shuffle(lengths)
    return [int(n) for n in lengths]


def visible_pairs(lengths: list[int], causal: bool) -> int:
    """The (query, key) pairs the packed call's rows see, per head."""
    return sum(n * (n + 1) // 2 if causal else n * n for n in lengths)


def padded_pairs(lengths: list[int], causal: bool) -> int:
    """The pairs the padded call's rows see, per head: its padding rows
    too, and with causal its padding keys (after every real query, but
    before the padding rows)."""
    longest = max(lengths)
    if causal:
        return len(lengths) * longest * (longest + 1) // 2
    return sum(longest * n for n in lengths)


def pad(x: np.ndarray, cu: np.ndarray, longest: int) -> np.ndarray:
    """Packed ``(total, heads, dim)`` as ``(batch, heads, longest, dim)``,
    zeros after each sequence."""
    batch = len(cu) - 1
    out = np.zeros((batch, x.shape[1], longest, x.shape[2]), x.dtype)
    for b in range(batch):
        out[b, :, : cu[b + 1] - cu[b]] = x[cu[b] : cu[b + 1]].transpose(1, 0, 2)
    return out


def unpad(x: np.ndarray, cu: np.ndarray) -> np.ndarray:
    """The inverse of :func:`pad`."""
    parts = [x[b, :, : cu[b + 1] - cu[b]].transpose(1, 0, 2) for b in range(len(cu) - 1)]
    return np.concatenate(parts)


def bench_row(lengths, heads, d, dtype, causal, device, repeat, torch) -> dict:
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    total, longest = int(cu[-1]), max(lengths)
    rng = np.random.default_rng(1)
    q, k, v, do = (rng.standard_normal((total, heads, d)).astype(dtype) for _ in range(4))
    qp, kp, vp, dop = (pad(x, cu, longest) for x in (q, k, v, do))
    common = {"causal": causal, "device": device}
    padded_kw: dict = dict(common)
    torch_kw: dict = {"is_causal": True} if causal else {}
    if not causal:
        keys = np.arange(longest)[None, :] < np.array(lengths)[:, None]
        padded_kw["mask"] = keys[:, None, None, :]
        torch_kw["attn_mask"] = padded_kw["mask"]

    def varlen_forward():
        return flashport.attention_varlen(q, k, v, cu, cu, **common)

    def varlen_fwd_bwd():
        out, lse = flashport.attention_varlen(q, k, v, cu, cu, return_lse=True, **common)
        return out, flashport.attention_varlen_backward(do, q, k, v, out, lse, cu, cu, **common)

    def padded_forward():
        return flashport.attention(qp, kp, vp, **padded_kw)

    def padded_fwd_bwd():
        out, lse = flashport.attention(qp, kp, vp, return_lse=True, **padded_kw)
        return out, flashport.attention_backward(dop, qp, kp, vp, out, lse, **padded_kw)

    cases: dict[str, Callable[[], object]] = {
        "varlen_forward": varlen_forward,
        "varlen_fwd_bwd": varlen_fwd_bwd,
        "padded_forward": padded_forward,
        "padded_fwd_bwd": padded_fwd_bwd,
    }
    if torch is not None:
        cases.update(torch_sdpa_cases(torch, (qp, kp, vp, dop), torch_kw))
    t = interleaved_medians(cases, repeat)

    # The two flashport paths compute the same real rows.
    out, grads = varlen_fwd_bwd()
    p_out, p_grads = padded_fwd_bwd()
    diff = max(
        float(np.abs(a.astype(np.float64) - unpad(b, cu)).max())
        for a, b in zip((out, *grads), (p_out, *p_grads), strict=True)
    )
    row = {
        "causal": causal,
        "work": padded_pairs(lengths, causal) / visible_pairs(lengths, causal),
        "varlen": {"forward_s": t["varlen_forward"], "fwd_bwd_s": t["varlen_fwd_bwd"]},
        "padded": {"forward_s": t["padded_forward"], "fwd_bwd_s": t["padded_fwd_bwd"]},
        "max_abs_diff_varlen_vs_padded": diff,
    }
    if torch is not None:
        row["torch_padded"] = {"forward_s": t["torch_forward"], "fwd_bwd_s": t["torch_fwd_bwd"]}
        check = cases["torch_forward"]().numpy()
        row["max_abs_diff_vs_torch"] = float(np.abs(unpad(check, cu) - out).max())
    return row


def format_table(rows: list[dict]) -> str:
    head = (
        f"{'causal':<8}{'pass':<9}{'varlen ms':>11}{'padded ms':>11}{'padded/varlen':>15}"
        f"{'torch pad ms':>14}{'torch/varlen':>14}{'work':>8}"
    )
    lines = [head, "-" * len(head)]
    for row in rows:
        for name, key in (("forward", "forward_s"), ("fwd+bwd", "fwd_bwd_s")):
            mine, padded = row["varlen"][key], row["padded"][key]
            th = row.get("torch_padded", {}).get(key)
            torch_cells = f"{th * 1e3:14.1f}{th / mine:13.2f}x" if th else f"{'-':>14}{'-':>14}"
            lines.append(
                f"{row['causal']!s:<8}{name:<9}{mine * 1e3:11.1f}{padded * 1e3:11.1f}"
                f"{padded / mine:14.2f}x{torch_cells}{row['work']:7.2f}x"
            )
    lines.append(
        "medians of the public calls; a ratio > 1 means attention_varlen is faster; "
        "work: (query, key) pairs the padded rows see / the packed rows'"
    )
    return "\n".join(lines)


def _lengths_arg(text: str) -> list[int]:
    lengths = [int(x) for x in text.split(",")]
    if not lengths or min(lengths) < 1:
        raise argparse.ArgumentTypeError("expected positive sequence lengths, e.g. 64,300,4096")
    return lengths


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashport bench varlen", description=__doc__)
    parser.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"{QUICK['sequences']} sequences of {QUICK['shortest']} to {QUICK['longest']} tokens "
        f"(default: {FULL['sequences']} of {FULL['shortest']} to {FULL['longest']})",
    )
    parser.add_argument("--lengths", type=_lengths_arg, help="the sequence lengths, e.g. 64,900")
    parser.add_argument("--heads", type=int, help=f"heads (default {FULL['heads']})")
    parser.add_argument("--dim", type=int, default=64, help="head dimension")
    parser.add_argument("--dtype", choices=["float32", "float16"], default="float32")
    parser.add_argument("--repeat", type=int, help="timed rounds per row (median)")
    parser.add_argument("--json", help="write the raw numbers to this file")
    args = parser.parse_args(argv)

    preset = QUICK if args.quick else FULL
    lengths = args.lengths or mixed_lengths(
        preset["sequences"], preset["shortest"], preset["longest"]
    )
    heads = args.heads or preset["heads"]
    repeat = args.repeat or preset["repeat"]
    # PyTorch runs on the CPU here; benchmarks/gpu_bench.py compares CUDA.
    torch = torch_or_none() if args.device == "cpu" else None
    kind = "gpu" if args.device.startswith("gpu") else args.device
    devices = [d for d in flashport.devices() if d["device"].startswith(kind)]
    if not devices:
        raise flashport.BackendUnavailableError(f"no {args.device} device: see flashport.devices()")
    device = devices[0]
    if args.device == "cpu":
        where = f"{os.cpu_count()} CPUs, {device['threads']} threads"
        competitor = f"torch {torch.__version__}" if torch else "torch not installed"
    else:
        where, competitor = device["name"], "torch on the CPU only"
    print(
        f"flashport {flashport.__version__} varlen bench on {args.device} ({where}); {competitor}",
        flush=True,
    )
    total = sum(lengths)
    print(
        f"{len(lengths)} sequences, {total} tokens (padded: {len(lengths)} x {max(lengths)} = "
        f"{len(lengths) * max(lengths)}), heads {heads}, d {args.dim}, {args.dtype}: "
        f"lengths {lengths}",
        flush=True,
    )
    rows = []
    for causal in (False, True):
        print(f"causal={causal} ...", end=" ", flush=True)
        start = time.perf_counter()
        rows.append(
            bench_row(
                lengths, heads, args.dim, np.dtype(args.dtype), causal, args.device, repeat, torch
            )
        )
        print(f"{time.perf_counter() - start:.0f} s", flush=True)
    print()
    print(format_table(rows))
    diff = max(row["max_abs_diff_varlen_vs_padded"] for row in rows)
    print(f"max |varlen - padded| over o, dq, dk, dv: {diff:.3g}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": device,
                    "lengths": lengths,
                    "heads": heads,
                    "dim": args.dim,
                    "dtype": args.dtype,
                    "repeat": repeat,
                    "rows": rows,
                },
                f,
                indent=2,
            )
    return 0
