"""``python -m flashport bench torch``: one training step (forward, backward,
SGD update) of a small Llama-style model on the CPU, with flashport as the
transformers attention implementation against ``"sdpa"`` (PyTorch's CPU
kernels), in one process, and the share of the step that attention takes.

The model is built from a config with random weights (nothing is
downloaded). Each step's attention time is measured at the boundary of the
attention function transformers calls: its forward wall time, and its
backward from the gradient reaching its output to the gradients leaving for
query, key and value (autograd runs the attention's backward nodes between
those two, on this thread). Medians over interleaved rounds (see
``timing.interleaved_medians``).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time

import flashport

from .timing import SETTLE_SECONDS

FULL = {"hidden": 256, "layers": 4, "heads": 8, "kv_heads": 4, "batch": 2, "seq": 512}
QUICK = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "batch": 1, "seq": 64}
VOCAB = 2048


class _Clock:
    """The current step's attention seconds, forward and backward."""

    def __init__(self) -> None:
        self.forward = self.backward = 0.0
        self._backward_start = 0.0

    def reset(self) -> None:
        self.forward = self.backward = 0.0


def _timed(torch, fn, clock: _Clock):
    """``fn`` (a transformers attention function) with its forward and
    backward time added to ``clock``."""

    class Enter(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            return q.view_as(q), k.view_as(k), v.view_as(v)

        @staticmethod
        def backward(ctx, dq, dk, dv):
            clock.backward += time.perf_counter() - clock._backward_start
            return dq, dk, dv

    class Exit(torch.autograd.Function):
        @staticmethod
        def forward(ctx, out):
            return out.view_as(out)

        @staticmethod
        def backward(ctx, do):
            clock._backward_start = time.perf_counter()
            return do

    def attention(module, query, key, value, *args, **kwargs):
        start = time.perf_counter()
        query, key, value = Enter.apply(query, key, value)
        out, weights = fn(module, query, key, value, *args, **kwargs)
        out = Exit.apply(out)
        clock.forward += time.perf_counter() - start
        return out, weights

    return attention


def run(sizes: dict, repeat: int) -> dict:
    import torch
    from transformers import AttentionInterface, AutoModelForCausalLM, LlamaConfig

    import flashport.torch as fpt

    threads = flashport.devices()[0]["threads"]
    torch.set_num_threads(threads)
    names = {"flashport": fpt.register_transformers(), "sdpa": "sdpa"}
    config = LlamaConfig(
        hidden_size=sizes["hidden"],
        intermediate_size=sizes["hidden"] * 8 // 3,
        num_hidden_layers=sizes["layers"],
        num_attention_heads=sizes["heads"],
        num_key_value_heads=sizes["kv_heads"],
        vocab_size=VOCAB,
        max_position_embeddings=max(sizes["seq"], 64),
    )
    torch.manual_seed(0)
    models = {}
    for label, name in names.items():
        # A config of its own each: from_config records the implementation in it.
        models[label] = AutoModelForCausalLM.from_config(
            copy.deepcopy(config), attn_implementation=name
        )
        assert models[label].config._attn_implementation == name
        if label != "flashport":
            models[label].load_state_dict(models["flashport"].state_dict())
        models[label].train()
    optimizers = {
        label: torch.optim.SGD(model.parameters(), lr=1e-4) for label, model in models.items()
    }
    ids = torch.randint(0, VOCAB, (sizes["batch"], sizes["seq"]))

    # The same first-step logits from both implementations (a sanity check,
    # before any update).
    with torch.no_grad():
        logits = {label: m(input_ids=ids).logits for label, m in models.items()}
    max_diff = float((logits["flashport"] - logits["sdpa"]).abs().max())

    clocks = {label: _Clock() for label in names}
    originals = {name: AttentionInterface._global_mapping[name] for name in names.values()}
    samples: dict[str, dict[str, list[float]]] = {
        label: {"step": [], "forward": [], "backward": []} for label in names
    }
    try:
        for label, name in names.items():
            AttentionInterface.register(name, _timed(torch, originals[name], clocks[label]))

        def step(label: str) -> float:
            model, clock = models[label], clocks[label]
            clock.reset()
            start = time.perf_counter()
            optimizers[label].zero_grad(set_to_none=True)
            model(input_ids=ids, labels=ids).loss.backward()
            optimizers[label].step()
            return time.perf_counter() - start

        for label in names:  # warm-up
            time.sleep(SETTLE_SECONDS)
            step(label)
        for _ in range(repeat):
            for label in names:
                time.sleep(SETTLE_SECONDS)
                elapsed = step(label)
                samples[label]["step"].append(elapsed)
                samples[label]["forward"].append(clocks[label].forward)
                samples[label]["backward"].append(clocks[label].backward)
    finally:
        for name, fn in originals.items():
            AttentionInterface.register(name, fn)

    rows = {}
    for label, s in samples.items():
        shares = [
            (f + b) / t for f, b, t in zip(s["forward"], s["backward"], s["step"], strict=True)
        ]
        rows[label] = {
            "step_s": statistics.median(s["step"]),
            "attention_forward_s": statistics.median(s["forward"]),
            "attention_backward_s": statistics.median(s["backward"]),
            "attention_share": statistics.median(shares),
            "samples": s,
        }
    return {
        "sizes": sizes,
        "vocab": VOCAB,
        "threads": threads,
        "torch": torch.__version__,
        "repeat": repeat,
        "max_abs_logit_diff": max_diff,
        "rows": rows,
    }


def format_table(result: dict) -> str:
    head = (
        f"{'attention':<12}{'step ms':>10}{'attn fwd ms':>13}{'attn bwd ms':>13}{'attn share':>12}"
    )
    lines = [head, "-" * len(head)]
    for label, row in result["rows"].items():
        lines.append(
            f"{label:<12}{row['step_s'] * 1e3:10.1f}{row['attention_forward_s'] * 1e3:13.1f}"
            f"{row['attention_backward_s'] * 1e3:13.1f}{row['attention_share'] * 100:11.1f}%"
        )
    mine, theirs = (result["rows"][k]["step_s"] for k in ("flashport", "sdpa"))
    lines.append(
        f"step time sdpa / flashport: {theirs / mine:.2f}x; medians of {result['repeat']} "
        f"interleaved steps; max |logits difference| before training: "
        f"{result['max_abs_logit_diff']:.2g}"
    )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashport bench torch", description=__doc__)
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"a tiny model (default: hidden {FULL['hidden']}, {FULL['layers']} layers, "
        f"{FULL['heads']} heads, {FULL['kv_heads']} kv heads, batch {FULL['batch']}, "
        f"seq {FULL['seq']})",
    )
    parser.add_argument("--seq", type=int, help="tokens per sequence")
    parser.add_argument("--batch", type=int, help="sequences per step")
    parser.add_argument("--repeat", type=int, default=5, help="timed steps per model (median)")
    parser.add_argument("--json", help="write the raw numbers to this file")
    args = parser.parse_args(argv)
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        parser.error("needs torch and transformers: pip install 'flashport[transformers]'")
    sizes = dict(QUICK if args.quick else FULL)
    if args.seq:
        sizes["seq"] = args.seq
    if args.batch:
        sizes["batch"] = args.batch
    print(
        f"flashport {flashport.__version__} bench torch on {os.cpu_count()} CPUs: Llama-style "
        f"model, hidden {sizes['hidden']}, {sizes['layers']} layers, {sizes['heads']} heads "
        f"({sizes['kv_heads']} kv), vocab {VOCAB}, batch {sizes['batch']} x seq {sizes['seq']}, "
        f"float32, causal",
        flush=True,
    )
    result = run(sizes, args.repeat)
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
