"""``python -m flashport generate``: text generation over the paged KV cache.

A small decoder-only transformer in NumPy (RoPE, GQA, SwiGLU; random
weights from ``--seed``) prefills one prompt into a :class:`flashport.KVCache`,
then runs beam search of width 4 and parallel sampling of 8 from it side by
side, one batched ``cache.attention`` call per layer per step over the 12
live sequences. It prints tokens/s, the KV memory against contiguous
per-request caches, the memory saved by sharing, and the largest deviation
of every step's logits from recomputing the whole sequence without a cache;
it exits 1 if that check fails. With ``--serve N`` it serves N requests
at once through :class:`flashport.Scheduler` instead, in a cache too small
for all of them, with the same check. See docs/generate.md.
"""

from __future__ import annotations

import argparse
import json
import os

import flashport

from .model import Config, Model
from .report import Progress, table
from .run import Workload, generate
from .serve import serve


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: expected an integer >= 1")
    return value


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m flashport generate",
        description=__doc__.split("\n\n")[1].replace("\n", " "),
    )
    parser.add_argument("--device", choices=("cpu", "gpu", "all"), default="all")
    parser.add_argument("--prompt-len", type=_positive, default=64)
    parser.add_argument("--new-tokens", type=_positive, default=64)
    parser.add_argument("--block-size", type=_positive, default=16)
    parser.add_argument("--layers", type=_positive, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write each run's numbers to this JSON file")
    parser.add_argument(
        "--serve",
        type=int,
        default=0,
        metavar="N",
        help="serve N requests at once through flashport.Scheduler instead (prompts of 1 to "
        "--prompt-len tokens, 1 to --new-tokens each), in a cache a third of their size",
    )
    parser.add_argument("--preemption", choices=("swap", "recompute", "auto"), default="auto")
    args = parser.parse_args(argv)

    model = Model(Config(layers=args.layers), seed=args.seed)
    work = Workload(args.prompt_len, args.new_tokens, args.block_size, args.seed)
    c = model.config
    print(
        f"flashport {flashport.__version__} generate: vocabulary {c.vocab}, d_model {c.d_model}, "
        f"{c.heads_q} query heads over {c.heads_kv} key/value heads of {c.head_dim}, "
        f"MLP {c.hidden}, {c.layers} layers, float32, random weights (seed {args.seed})",
        flush=True,
    )
    if not any(os.environ.get(v) for v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")):
        print(
            "note: NumPy's BLAS threads and flashport's compete for the cores between the "
            "model's matrix products and the cache's attention; with OPENBLAS_NUM_THREADS=1 "
            "(set before Python starts) this run can be several times faster "
            "(docs/generate.md)",
            flush=True,
        )
    devices = flashport.devices()
    runs = []
    if args.device in ("cpu", "all"):
        runs.append(("cpu", f"cpu ({devices[0]['threads']} threads)"))
    gpus = [d for d in devices if d["device"].startswith("gpu")]
    if args.device in ("gpu", "all"):
        if gpus:
            runs.append(("gpu", f"gpu: {gpus[0]['name']} ({gpus[0]['backend']})"))
        else:
            print("gpu: no GPU adapter")
            if args.device == "gpu":
                return 1

    results, failed = [], False
    if args.serve > 0:
        for device, label in runs:
            r = serve(
                model, device, args.serve, args.prompt_len, args.new_tokens,
                args.block_size, args.preemption, args.seed,
            )  # fmt: skip
            print(
                f"{label}: served {r['requests']} requests ({r['tokens_generated']} tokens) "
                f"in {r['seconds']:.2f} s, {r['num_blocks']} blocks for "
                f"{r['blocks_wanted_at_once']} wanted at once: {r['preemptions']} "
                f"preemptions ({r['swaps']} swaps, {r['recomputations']} recomputations); "
                f"logits of {r['checked_positions']} positions against the no-cache "
                f"recompute: max relative deviation {r['max_rel_deviation']:.1e} "
                f"({'ok' if r['ok'] else 'FAILED'})",
                flush=True,
            )
            results.append({"label": label, **r})
            failed |= not r["ok"]
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=2)
        return 1 if failed else 0
    for device, label in runs:
        progress = Progress(label)
        try:
            result = generate(model, device, work, progress)
        except flashport.BackendUnavailableError as e:
            # An adapter that is listed may still refuse the pools (a lost device).
            print(f"gpu: KV cache not available on this device ({e})")
            if args.device == "gpu":
                return 1
            continue
        finally:
            progress.close()
        print(table(result, label), flush=True)
        results.append({"label": label, **result})
        failed |= not result["ok"]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 1 if failed else 0
