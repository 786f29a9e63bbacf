"""``python -m flashport bench serve``: PagedAttention's experiment on
flashport's kernels. A trace of requests (Poisson arrivals; prompt and
output lengths drawn to match ShareGPT's or Alpaca's means, as the paper
reports them) is served by :class:`flashport.Scheduler` over a
:class:`flashport.KVCache` with a fixed KV memory budget, as the request
rate grows, against the baseline the paper's systems are: a contiguous
reservation of the model's maximum length per sequence (here a cache whose
blocks are ``--max-len`` positions long: one block, one reservation).

The clock is the serving's own: requests arrive at their trace times and
each step advances it by the step's measured wall time (model, attention,
scheduling). Per rate and system: throughput (requests/s and generated
tokens/s), the mean normalized latency (seconds from arrival to the last
token, per output token, as the paper plots it), the largest batch that
ran, the KV memory wasted (slots reserved but not holding a token, over the
steps), and the preemptions. The model is a small decoder of random
weights (``--layers`` layers of ``--heads`` heads of 64) whose every token
goes through the cache: its cost is the serving's, not a large model's.

Not the paper's other baselines (the next power of two, the oracle of the
exact output length): one block size per cache cannot reserve them.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

import flashport

TRACES = {
    # Mean input and output tokens (the PagedAttention paper, section 6.1).
    "sharegpt": (161.31, 337.99),
    "alpaca": (19.31, 58.45),
}
D = 64


def lengths(rng, mean: float, count: int, most: int) -> np.ndarray:
    """Lognormal lengths (sigma 0.8: a long tail, as conversations have),
    rounded, at least 1 and at most ``most``, whose mean after the clipping
    is ``mean``: the location is found by bisection on a fixed sample."""
    sigma = 0.8
    z = np.random.default_rng(12345).standard_normal(50_000)

    def clipped_mean(mu: float) -> float:
        return float(np.clip(np.round(np.exp(mu + sigma * z)), 1, most).mean())

    lo, hi = np.log(0.5), np.log(4.0 * most)
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if clipped_mean(mid) < mean else (lo, mid)
    return np.clip(np.round(rng.lognormal(lo, sigma, count)), 1, most).astype(int)


def trace(name: str, count: int, rate: float, max_len: int, seed: int):
    """(arrival seconds, prompt, output length) per request."""
    rng = np.random.default_rng(seed)
    mean_in, mean_out = TRACES[name]
    prompts = lengths(rng, mean_in, count, max_len // 2)
    outputs = lengths(rng, mean_out, count, max_len // 2)
    arrivals = np.cumsum(rng.exponential(1 / rate, count))
    return [
        (float(t), rng.integers(0, 256, p).tolist(), int(o))
        for t, p, o in zip(arrivals, prompts, outputs, strict=True)
    ]


class Decoder:
    """A decoder of random weights whose every token goes through the
    cache: per layer q, k, v projections, the cache's append and causal
    attention, the output added back; the next token's logits. Decode
    entries are one batch (one append_batch and one attention per layer)."""

    def __init__(self, layers: int, heads: int, vocab: int = 256, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.layers, self.heads, self.vocab = layers, heads, vocab
        width = heads * D
        self.width = width
        self.emb = rng.standard_normal((vocab, width)).astype(np.float32)
        w = rng.standard_normal((layers, 3, width, width)) / np.sqrt(width)
        self.w = w.astype(np.float32)
        self.out = rng.standard_normal((width, vocab)).astype(np.float32)

    def cache(self, num_blocks: int, block_size: int, device: str) -> flashport.KVCache:
        return flashport.KVCache(
            num_blocks, block_size, self.heads, D, layers=self.layers, device=device
        )

    def _split(self, x):
        return x.reshape(x.shape[0], self.heads, D).transpose(1, 0, 2)

    def __call__(self, cache, batch):
        logits = np.zeros((len(batch), self.vocab), np.float32)
        decode = [i for i, (_, t) in enumerate(batch) if len(t) == 1]
        if decode:
            ids = [batch[i][0] for i in decode]
            x = self.emb[[int(batch[i][1][0]) for i in decode]]
            for layer in range(self.layers):
                q, k, v = (x @ self.w[layer, j] for j in range(3))
                k = k.reshape(len(ids), self.heads, 1, D)
                v = v.reshape(len(ids), self.heads, 1, D)
                cache.append_batch(ids, k, v, layer=layer)
                o = cache.attention(q.reshape(len(ids), self.heads, 1, D), ids, layer=layer)
                x = x + np.asarray(o).reshape(len(ids), self.width)
            logits[decode] = x @ self.out
        for i, (sid, tokens) in enumerate(batch):
            if len(tokens) == 1:
                continue
            x = self.emb[tokens]
            for layer in range(self.layers):
                q, k, v = (self._split(x @ self.w[layer, j]) for j in range(3))
                cache.append(sid, k, v, layer=layer)
                o = np.asarray(cache.attention(q[None], [sid], layer=layer, causal=True))[0]
                x = x + o.transpose(1, 0, 2).reshape(len(tokens), self.width)
            logits[i] = x[-1] @ self.out
        return logits


def serve(model, requests, cache, max_batch: int) -> dict:
    """Serves ``requests`` on the trace's clock; the figures of one run."""
    s = flashport.Scheduler(cache, model, max_batch=max_batch, max_tokens=2048)
    clock, pending = 0.0, list(requests)
    arrival, finish, outputs = {}, {}, {}
    largest, waste = 0, []
    while pending or s.unfinished:
        while pending and pending[0][0] <= clock:
            t, prompt, out = pending.pop(0)
            rid = s.add(prompt, out)
            arrival[rid], outputs[rid] = t, out
        if not s.unfinished:
            clock = pending[0][0]
            continue
        start = time.perf_counter()
        done = s.step()
        clock += time.perf_counter() - start
        for rid in done:
            finish[rid] = clock
        running = [q.sid for r in s.running for q in s.requests[r].seqs if q.sid is not None]
        largest = max(largest, len(running))
        reserved = cache.num_used_blocks * cache.block_size
        if reserved:
            held = sum(cache.length(sid) for sid in running)
            waste.append(1 - held / reserved)
    span = max(finish.values()) - min(arrival.values())
    latency = [(finish[r] - arrival[r]) / outputs[r] for r in finish]
    return {
        "requests_per_s": len(finish) / span,
        "tokens_per_s": sum(outputs.values()) / span,
        "normalized_latency_s": float(np.mean(latency)),
        "largest_batch": largest,
        "kv_waste": float(np.mean(waste)) if waste else 0.0,
        "preemptions": s.stats["preemptions"],
        "steps": s.stats["steps"],
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashport bench serve", description=__doc__)
    parser.add_argument("--trace", choices=sorted(TRACES), default="sharegpt")
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--rates", default="0.5,1,2,4", help="requests per second")
    parser.add_argument("--kv-tokens", type=int, default=16384, help="KV slots per layer")
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--max-batch", type=int, default=256)
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the raw numbers to this file")
    args = parser.parse_args(argv)
    model = Decoder(args.layers, args.heads)
    systems = {
        f"paged (block {args.block_size})": args.block_size,
        f"max-length reservation ({args.max_len})": args.max_len,
    }
    print(
        f"flashport {flashport.__version__} bench serve on the {args.device}: {args.trace}-like "
        f"trace of {args.requests} requests (means {TRACES[args.trace][0]} in, "
        f"{TRACES[args.trace][1]} out, lognormal, at most {args.max_len // 2} each), "
        f"{args.kv_tokens} KV slots per layer, a {args.layers}-layer decoder of "
        f"{args.heads} heads of {D}, float32",
        flush=True,
    )
    print(
        "| rate req/s | system | req/s | tokens/s | normalized latency s/token | largest batch "
        "| KV waste | preemptions |\n|---|---|---|---|---|---|---|---|"
    )
    rows = []
    for rate in [float(r) for r in args.rates.split(",")]:
        requests = trace(args.trace, args.requests, rate, args.max_len, args.seed)
        for name, block in systems.items():
            cache = model.cache(args.kv_tokens // block, block, args.device)
            row = serve(model, requests, cache, args.max_batch)
            row.update(rate=rate, system=name)
            rows.append(row)
            print(
                f"| {rate:g} | {name} | {row['requests_per_s']:.3f} | {row['tokens_per_s']:.1f} "
                f"| {row['normalized_latency_s']:.4f} | {row['largest_batch']} "
                f"| {row['kv_waste']:.1%} | {row['preemptions']} |",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0
