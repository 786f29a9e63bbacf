"""What ``python -m flashport bench serve`` replays and how: the request
trace, the model, the systems compared, one serving run on the trace's
clock, and the scheduler's own share of a step.

The systems share the trace, the KV budget (``kv_tokens`` slots per layer),
the model step and :class:`flashport.Scheduler`; they differ in how a
request's KV memory is granted, as in the PagedAttention paper's
experiment (section 6):

* **paged**: blocks of ``block_size`` slots taken as the sequence grows,
  the pool holding exactly the budget; preemption when it runs short.
* **reservations** (the paper's Orca baselines): a request is admitted,
  first come first served, only when its reservation fits in what the
  admitted requests have not reserved, and holds it until it finishes:
  the model's maximum length, the next power of two of its prompt plus
  output, or exactly its prompt plus output (the oracle). The reservation
  is the budget's accounting; the keys and values go to a block pool large
  enough beneath it (the budget, plus a block per request for rounding),
  so the systems run the same kernels on the same block tables and differ
  only in what they admit."""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections import deque
from collections.abc import Callable

import numpy as np

import flashport

TRACES = {
    # Mean input and output tokens (the PagedAttention paper, section 6.1).
    "sharegpt": (161.31, 337.99),
    "alpaca": (19.31, 58.45),
}
D = 64
# The scheduler's admission watermark (its default): a reservation system's
# pool leaves it free on top of the budget, so the watermark never limits
# what the reservation admits.
WATERMARK = 0.01


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
    """(arrival seconds, prompt, output length) per request. The lengths
    depend on ``seed`` alone and the arrivals scale with ``1 / rate``, so
    every rate of a sweep replays the same requests."""
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

    def cache(
        self, num_blocks: int, block_size: int, device: str, swap_blocks: int = 0
    ) -> flashport.KVCache:
        return flashport.KVCache(
            num_blocks, block_size, self.heads, D, layers=self.layers, device=device,
            swap_blocks=swap_blocks,
        )  # fmt: skip

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


class Timed:
    """A model step that adds up the time ``timer`` counts in it."""

    def __init__(self, model, timer: Callable[[], float]) -> None:
        self.model, self.timer = model, timer
        self.seconds = 0.0
        self.last_batch: list[int] = []

    def __call__(self, cache, batch):
        start = self.timer()
        out = self.model(cache, batch)
        self.seconds += self.timer() - start
        self.last_batch = [len(t) for _, t in batch]
        return out


@dataclasses.dataclass(frozen=True)
class System:
    """How a request's KV memory is granted: ``reserve(prompt, output)``,
    the slots reserved at admission, or None for paged blocks."""

    name: str
    reserve: Callable[[int, int], int] | None


def next_power_of_two(n: int) -> int:
    return 1 << (n - 1).bit_length()


def systems(block_size: int, max_len: int) -> list[System]:
    return [
        System(f"paged (block {block_size})", None),
        System(f"max-length reservation ({max_len})", lambda p, o: max_len),
        System("power-of-two reservation", lambda p, o: next_power_of_two(p + o)),
        System("oracle reservation (prompt + output)", lambda p, o: p + o),
    ]


def serve(
    model,
    requests,
    system: System,
    *,
    kv_tokens: int,
    block_size: int,
    max_batch: int,
    device: str = "cpu",
    preemption: str = "auto",
    progress: Callable[[dict], None] | None = None,
    timer: Callable[[], float] = time.perf_counter,
) -> dict:
    """Serves ``requests`` on the trace's clock: requests arrive at their
    trace times, and each step advances the clock by its time as ``timer``
    counts it (the scheduler's work and the model's; wall time by
    default). The figures of one run."""
    if system.reserve is None:
        blocks = kv_tokens // block_size
        cache = model.cache(blocks, block_size, device, swap_blocks=blocks)
    else:
        most = max(system.reserve(len(p), o) for _, p, o in requests)
        if most > kv_tokens:
            raise ValueError(f"kv_tokens={kv_tokens}: {system.name} reserves up to {most}")
        blocks = int(np.ceil((kv_tokens // block_size + max_batch + 1) / (1 - WATERMARK)))
        cache = model.cache(blocks, block_size, device)
        preemption = "recompute"  # never needed: the pool holds every reservation
    timed = Timed(model, timer)
    s = flashport.Scheduler(
        cache, timed, max_batch=max_batch, max_tokens=2048, preemption=preemption,
        watermark=WATERMARK,
    )  # fmt: skip
    clock = 0.0
    pending, gate = deque(requests), deque()
    arrival, finish, outputs, reserved = {}, {}, {}, {}
    in_use = 0
    largest, waste = 0, []
    step_s = model_s = 0.0
    while pending or gate or s.unfinished:
        while pending and pending[0][0] <= clock:
            gate.append(pending.popleft())
        # Admission: the paged system takes every arrival (its scheduler
        # admits by free blocks); a reservation, first come first served,
        # what fits.
        while gate and s.unfinished < max_batch:
            t, prompt, out = gate[0]
            slots = 0 if system.reserve is None else system.reserve(len(prompt), out)
            if in_use + slots > kv_tokens:
                break
            gate.popleft()
            rid = s.add(prompt, out)
            arrival[rid], outputs[rid], reserved[rid] = t, out, slots
            in_use += slots
        if not s.unfinished:
            clock = pending[0][0]
            continue
        start, before = timer(), timed.seconds
        done = s.step()
        took = timer() - start
        clock += took
        step_s += took
        model_s += timed.seconds - before
        for rid in done:
            finish[rid] = clock
            in_use -= reserved.pop(rid)
        running = [q.sid for r in s.running for q in s.requests[r].seqs if q.sid is not None]
        largest = max(largest, len(running))
        held = sum(cache.length(sid) for sid in running)
        granted = in_use if system.reserve is not None else cache.num_used_blocks * block_size
        if granted:
            waste.append(1 - held / granted)
        if progress is not None:
            progress(
                {"clock": clock, "finished": len(finish), "requests": len(requests),
                 "running": len(s.running), "waiting": len(s.waiting) + len(gate) + len(pending),
                 **s.stats}
            )  # fmt: skip
    if system.reserve is not None and s.stats["preemptions"]:
        raise AssertionError(f"{system.name}: the pool beneath the reservations ran short")
    span = max(finish.values()) - min(arrival.values())
    latency = [(finish[r] - arrival[r]) / outputs[r] for r in finish]
    costs = s.costs
    block_bytes = cache.nbytes / cache.num_blocks
    return {
        "system": system.name,
        "requests_per_s": len(finish) / span,
        "tokens_per_s": sum(outputs.values()) / span,
        "normalized_latency_s": float(np.mean(latency)),
        "largest_batch": largest,
        "kv_waste": float(np.mean(waste)) if waste else 0.0,
        "steps": s.stats["steps"],
        "preemptions": s.stats["preemptions"],
        "swaps": s.stats["swaps"],
        "recomputations": s.stats["recomputations"],
        "scheduler_share": (step_s - model_s) / step_s,
        # What preemption="auto" measured (None: not measured).
        "swap_bytes_per_s": (
            2 * block_bytes / costs.swap_s_per_block if costs.swap_s_per_block else None
        ),
        "recompute_tokens_per_s": (
            1 / costs.recompute_s_per_token if costs.recompute_s_per_token else None
        ),
    }


def overhead(
    model,
    batch: int,
    *,
    block_size: int,
    device: str = "cpu",
    steps: int = 20,
    prompt: int = 64,
    timer: Callable[[], float] = time.perf_counter,
) -> dict:
    """The scheduler's own time in a decode step of ``batch`` sequences:
    ``batch`` requests of ``prompt`` tokens are prefilled, then ``steps``
    steps of one token each are timed whole and inside the model; the
    scheduler's share is the rest (its host work: choosing, counting
    blocks, drawing tokens, bookkeeping)."""
    rng = np.random.default_rng(0)
    # Every prompt in one step, so that all the sequences then decode
    # together until after the timed steps.
    new_tokens = steps + 3
    per_seq = -(-(prompt + new_tokens) // block_size)
    cache = model.cache(batch * per_seq + 8, block_size, device)
    timed = Timed(model, timer)
    s = flashport.Scheduler(cache, timed, max_batch=batch, max_tokens=batch * prompt, watermark=0)
    for _ in range(batch):
        s.add(rng.integers(0, 256, prompt).tolist(), new_tokens)
    # The prompts, and one decode step to warm up.
    while timed.last_batch != [1] * batch:
        s.step()
    totals, models = [], []
    for _ in range(steps):
        start, before = timer(), timed.seconds
        s.step()
        totals.append(timer() - start)
        models.append(timed.seconds - before)
        if timed.last_batch != [1] * batch:
            raise AssertionError(f"a timed step was not one decode batch: {timed.last_batch}")
    own = [t - m for t, m in zip(totals, models, strict=True)]
    step = statistics.median(totals)
    return {
        "batch": batch,
        "step_s": step,
        "model_s": statistics.median(models),
        "scheduler_s": statistics.median(own),
        "scheduler_share": statistics.median(own) / step,
        "tokens_per_s": batch / step,
    }
