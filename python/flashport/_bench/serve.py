"""``python -m flashport bench serve``: PagedAttention's experiment on
flashport's kernels. A trace of requests (Poisson arrivals; prompt and
output lengths drawn to match ShareGPT's or Alpaca's means, as the paper
reports them) is served by :class:`flashport.Scheduler` over a
:class:`flashport.KVCache` with a fixed KV memory budget, at each request
rate of a sweep, by paged blocks and by the paper's baselines, contiguous
reservations of the model's maximum length, of the next power of two of a
request's prompt plus output, and of exactly that (the oracle); see
``serve_replay``.

First, the scheduler's own time in a decode step at batches up to 32 and
beyond (the issue's target: at most 5% of the step at batch 32 on the
GPU), with sequences as long as the trace's are on average while they
decode (its mean prompt and half its mean output): this also shows what
a larger batch buys the model step, which decides what paged memory's
larger batches are worth. Then per
rate and system: throughput (requests/s and generated tokens/s), the mean
normalized latency (seconds from arrival to the last token, per output
token, as the paper plots it), the largest batch that ran, the KV memory
wasted (slots granted but not holding a token, averaged over the steps),
the preemptions (and how many were swaps), and the scheduler's share of
the steps. Last, each system's **sustained rate**: the highest rate of the
sweep at which it, and at every lower rate of the sweep, keeps the mean
normalized latency at or under ``--latency-bound`` (by default 4 times the
lowest normalized latency any system had at the sweep's lowest rate, the
unloaded server's).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time

import flashport

from .serve_replay import TRACES, D, Decoder, overhead, serve, systems, trace


def sustained(rows: list[dict], bound: float) -> dict[str, float | None]:
    """Per system, the highest rate at and below which every rate of the
    sweep kept the normalized latency at most ``bound`` (None: not even
    the lowest)."""
    out: dict[str, float | None] = {}
    for name in dict.fromkeys(r["system"] for r in rows):
        out[name] = None
        for row in sorted((r for r in rows if r["system"] == name), key=lambda r: r["rate"]):
            if row["normalized_latency_s"] > bound:
                break
            out[name] = row["rate"]
    return out


def plot(rows: list[dict], bound: float, title: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(r["system"] for r in rows):
        mine = sorted((r for r in rows if r["system"] == name), key=lambda r: r["rate"])
        ax.plot(
            [r["rate"] for r in mine], [r["normalized_latency_s"] for r in mine],
            marker="o", label=name,
        )  # fmt: skip
    ax.axhline(bound, color="grey", linestyle="--", linewidth=1, label="latency bound")
    ax.set_xlabel("request rate (requests/s)")
    ax.set_ylabel("normalized latency (s/token)")
    ax.set_ylim(0, 5 * bound)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


class Every:
    """A progress line on stderr at most every ``seconds`` of wall time."""

    def __init__(self, seconds: float, label: str) -> None:
        self.seconds, self.label = seconds, label
        self.next = time.perf_counter() + seconds

    def __call__(self, state: dict) -> None:
        now = time.perf_counter()
        if now < self.next:
            return
        self.next = now + self.seconds
        print(
            f"  [{self.label}] trace clock {state['clock']:.1f} s: {state['finished']}/"
            f"{state['requests']} finished, {state['running']} running, {state['waiting']} "
            f"waiting, {state['steps']} steps, {state['preemptions']} preemptions",
            file=sys.stderr,
            flush=True,
        )


def _rates(text: str) -> list[float]:
    try:
        rates = [float(r) for r in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected rates like 1,2,4") from None
    if not rates or min(rates) <= 0 or rates != sorted(set(rates)):
        raise argparse.ArgumentTypeError(f"{text!r}: expected increasing rates above 0")
    return rates


def _batches(text: str) -> list[int]:
    try:
        batches = [int(b) for b in text.split(",") if b]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected batch sizes like 1,8,32") from None
    if min(batches, default=1) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: batch sizes are at least 1")
    return batches


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashport bench serve", description=__doc__)
    parser.add_argument("--trace", choices=sorted(TRACES), default="sharegpt")
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--rates", type=_rates, default=_rates("0.5,1,2,4"), help="requests/s")
    parser.add_argument("--kv-tokens", type=int, default=16384, help="KV slots per layer")
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--max-batch", type=int, default=256)
    parser.add_argument("--preemption", choices=("swap", "recompute", "auto"), default="auto")
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--overhead-batches", type=_batches, default=_batches("1,8,16,32,64,128"),
        help="decode batches whose step the scheduler's share is measured in ('' for none)",
    )  # fmt: skip
    parser.add_argument(
        "--latency-bound", type=float,
        help="s/token a sustained rate keeps to (default: 4 x the unloaded latency)",
    )  # fmt: skip
    parser.add_argument(
        "--clock", choices=("wall", "process"), default="wall",
        help="what a step's time is: wall time, or the process's CPU time (for a CPU run on a "
        "machine others share; needs FLASHPORT_NUM_THREADS=1 and OPENBLAS_NUM_THREADS=1)",
    )  # fmt: skip
    parser.add_argument("--progress", type=float, metavar="SECONDS", help="a line every SECONDS")
    parser.add_argument("--json", help="write the raw numbers to this file")
    parser.add_argument("--plot", help="draw normalized latency against rate to this PNG")
    parser.add_argument(
        "--from-json", metavar="JSON",
        help="draw --plot from the numbers a run wrote with --json instead of running (for a "
        "run made where matplotlib is not installed)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        # Before a run of minutes, not after it.
        parser.error("--plot needs matplotlib (pip install -r requirements-bench.txt)")
    if args.from_json:
        if not args.plot:
            parser.error("--from-json draws a chart: give --plot PATH")
        with open(args.from_json) as f:
            result = json.load(f)
        plot(result["rows"], result["latency_bound_s"], _title(result["args"]), args.plot)
        print(f"chart: {args.plot}")
        return 0
    if args.max_len > args.kv_tokens:
        parser.error(f"--max-len {args.max_len} is more than --kv-tokens {args.kv_tokens}")
    threads = {v: os.environ.get(v) for v in ("FLASHPORT_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    if args.clock == "process":
        # A process's CPU time is a step's time only where one thread does
        # all the work and the GPU none.
        if args.device != "cpu" or any(n != "1" for n in threads.values()):
            parser.error(
                f"--clock process on the {args.device} with {threads}: needs --device cpu, "
                "FLASHPORT_NUM_THREADS=1 and OPENBLAS_NUM_THREADS=1"
            )
    timer = time.process_time if args.clock == "process" else time.perf_counter
    model = Decoder(args.layers, args.heads)
    mean_in, mean_out = TRACES[args.trace]
    print(
        f"flashport {flashport.__version__} bench serve on the {args.device}: a "
        f"{args.layers}-layer decoder of {args.heads} heads of {D}, float32, every token "
        f"through the cache; a step's time: {args.clock} clock; {threads}",
        flush=True,
    )
    if args.device == "cpu" and threads["OPENBLAS_NUM_THREADS"] is None:
        print(
            "note: NumPy's BLAS threads and flashport's fight over the cores between the "
            "model's products and the cache's attention; set OPENBLAS_NUM_THREADS=1 before "
            "Python starts (docs/generate.md)",
            flush=True,
        )
    result: dict = {"args": {**vars(args), "version": flashport.__version__}}
    result.update(overhead=[], rows=[])
    if args.overhead_batches:
        context = round(mean_in + mean_out / 2)
        print(
            f"\nThe scheduler's own time in a decode step (median of 20 steps, each sequence "
            f"at about {context} positions: the {args.trace}-like trace's mean while decoding)\n\n"
            "| batch | step ms | model ms | scheduler ms | scheduler share | decode tokens/s |\n"
            "|---|---|---|---|---|---|",
            flush=True,
        )
        for batch in args.overhead_batches:
            o = overhead(
                model, batch, block_size=args.block_size, device=args.device, prompt=context,
                timer=timer,
            )  # fmt: skip
            result["overhead"].append(o)
            print(
                f"| {batch} | {o['step_s'] * 1e3:.3f} | {o['model_s'] * 1e3:.3f} "
                f"| {o['scheduler_s'] * 1e3:.3f} | {o['scheduler_share']:.1%} "
                f"| {o['tokens_per_s']:.0f} |",
                flush=True,
            )
    print(
        f"\n{args.trace}-like trace of {args.requests} requests (means {mean_in} in, {mean_out} "
        f"out, lognormal, at most {args.max_len // 2} each), {args.kv_tokens} KV slots per "
        f"layer, preemption {args.preemption!r}\n\n"
        "| rate req/s | system | req/s | tokens/s | normalized latency s/token | largest batch "
        "| KV waste | preemptions (swaps) | scheduler share |\n" + "|---" * 9 + "|",
        flush=True,
    )
    rows = result["rows"]
    for rate in args.rates:
        requests = trace(args.trace, args.requests, rate, args.max_len, args.seed)
        for system in systems(args.block_size, args.max_len):
            label = f"{rate:g} req/s, {system.name}"
            progress = None if args.progress is None else Every(args.progress, label)
            row = serve(
                model, requests, system, kv_tokens=args.kv_tokens, block_size=args.block_size,
                max_batch=args.max_batch, device=args.device, preemption=args.preemption,
                progress=progress, timer=timer,
            )  # fmt: skip
            row["rate"] = rate
            rows.append(row)
            print(
                f"| {rate:g} | {system.name} | {row['requests_per_s']:.3f} "
                f"| {row['tokens_per_s']:.1f} | {row['normalized_latency_s']:.3g} "
                f"| {row['largest_batch']} | {row['kv_waste']:.1%} "
                f"| {row['preemptions']} ({row['swaps']}) | {row['scheduler_share']:.1%} |",
                flush=True,
            )
    lowest = [r["normalized_latency_s"] for r in rows if r["rate"] == args.rates[0]]
    bound = args.latency_bound if args.latency_bound else 4 * min(lowest)
    how = "given" if args.latency_bound else f"4 x {min(lowest):.3g} at {args.rates[0]:g} req/s"
    rates = sustained(rows, bound)
    result.update(latency_bound_s=bound, sustained=rates)
    base = rates.get(systems(args.block_size, args.max_len)[1].name)
    print(
        f"\nSustained rate: the highest rate of the sweep at and below which the normalized "
        f"latency stays at most {bound:.3g} s/token ({how})\n\n"
        "| system | sustained rate req/s | against the max-length reservation |\n|---|---|---|"
    )
    for name, rate in rates.items():
        ratio = f"{rate / base:.2f}x" if rate and base else "-"
        print(f"| {name} | {rate:g} | {ratio} |" if rate else f"| {name} | below the sweep | - |")
    paged = systems(args.block_size, args.max_len)[0].name
    measured = [r for r in rows if r["system"] == paged and r["preemptions"]]
    if measured:
        r = measured[-1]
        swap, redo = r["swap_bytes_per_s"], r["recompute_tokens_per_s"]
        print(
            f"\nWhat preemption={args.preemption!r} measured in the paged run at {r['rate']:g} "
            f"req/s: swap {f'{swap / 1e9:.2f} GB/s' if swap else 'unmeasured'} (a block out and "
            f"back in), recompute {f'{redo:.0f} tokens/s' if redo else 'unmeasured'}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.plot:
        plot(rows, bound, _title(result["args"]), args.plot)
        print(f"\nchart: {args.plot}")
    return 0


def _title(args: dict) -> str:
    return (
        f"{args['trace']}-like, {args['requests']} requests, {args['kv_tokens']} KV slots, "
        f"{args['device']}, flashport {args['version']}"
    )
