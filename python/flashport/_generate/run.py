"""One generation run: prefill a shared prompt once, then beam search and
parallel sampling from it side by side, one batched forward per step over
every live sequence, with the memory tallied and every step's logits
checked against the no-cache recompute."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .memory import Tally, check_pool, snapshot
from .model import Model
from .search import BeamSearch, Sampling

BEAM_WIDTH = 4
SAMPLES = 8
# The cached float32 forward against the float64 recompute, relative to the
# step's largest |logit|. float32 rounds each operation by 2**-24 ≈ 6e-8
# relative; the longest reduction (the MLP's 512-wide hidden layer, the
# LM head's 256-wide rows) accumulates at most a few hundred such errors
# even when they all point the same way, through two residual layers:
# ~1e-5 at worst. A cached step that read a wrong or missing key, a stale
# copy-on-write block or a key rotated to the wrong position is off by a
# sizeable fraction of the logits (>1e-2 here).
TOLERANCE = 1e-4


@dataclass(frozen=True)
class Workload:
    prompt_len: int
    new_tokens: int
    block_size: int
    seed: int

    @property
    def max_len(self) -> int:
        return self.prompt_len + self.new_tokens

    @property
    def requests(self) -> int:
        return BEAM_WIDTH + SAMPLES

    @property
    def num_blocks(self) -> int:
        """The pool: as many blocks as contiguous per-request caches would
        reserve (each request ``max_len`` positions), so the paged cache has
        the same capacity and what it leaves unused shows."""
        return self.requests * -(-self.max_len // self.block_size)


class Check:
    """Each cached step's logits against :meth:`Model.forward_full` on the
    sequence's whole token list."""

    def __init__(self, model: Model) -> None:
        self.model = model
        self.max_abs = 0.0
        self.max_rel = 0.0
        self.checked = 0

    def __call__(self, cached: np.ndarray, tokens: np.ndarray) -> None:
        """``cached (B, n, vocab)``: the logits of the last ``n`` positions of
        the sequences ``tokens (B, T)``, all of one length."""
        n = cached.shape[1]
        want = self.model.forward_full(tokens)[:, -n:]
        dev = np.abs(cached.astype(np.float64) - want).max(axis=(1, 2))
        rel = dev / np.abs(want).max(axis=(1, 2))
        self.max_abs = max(self.max_abs, float(dev.max()))
        self.max_rel = max(self.max_rel, float(rel.max()))
        self.checked += cached.shape[0] * n

    @property
    def ok(self) -> bool:
        return self.max_rel <= TOLERANCE


def generate(
    model: Model,
    device: str,
    work: Workload,
    progress: Callable[[int, int], None] | None = None,
) -> dict:
    """Runs the workload on ``device`` (a KVCache that refuses the device
    raises before anything runs) and returns what the report prints."""
    cache = model.new_cache(work.num_blocks, work.block_size, device)
    prompt = np.random.default_rng(work.seed).integers(0, model.config.vocab, work.prompt_len)
    check = Check(model)
    everyone, beams_tally, samples_tally = Tally(), Tally(), Tally()

    started = time.perf_counter()
    prompt_sid = cache.new_sequence()
    logits = model.forward_cached(cache, [prompt_sid], prompt[None])[0]
    prefill_s = time.perf_counter() - started
    check(logits[None], prompt[None])

    decode_s = 0.0
    started = time.perf_counter()
    beams = BeamSearch(cache, prompt_sid, BEAM_WIDTH)
    samples = Sampling(cache, prompt_sid, SAMPLES, work.seed)
    cache.free(prompt_sid)
    feed = beams.choose(logits[-1:]) + samples.choose(np.repeat(logits[-1:], SAMPLES, axis=0))
    decode_s += time.perf_counter() - started

    for step in range(work.new_tokens):
        started = time.perf_counter()
        seq_ids = [sid for sid, _ in feed]
        step_logits = model.forward_cached(cache, seq_ids, np.array([[t] for _, t in feed]))[:, 0]
        decode_s += time.perf_counter() - started

        every = snapshot(cache, seq_ids)
        check_pool(cache, every)
        everyone.add(every, work.max_len)
        beams_tally.add(snapshot(cache, beams.seq_ids), work.max_len)
        samples_tally.add(snapshot(cache, samples.seq_ids), work.max_len)
        generated = {**beams.generated_of(), **samples.generated_of()}
        check(
            step_logits[:, None],
            np.array([prompt.tolist() + generated[sid] for sid in seq_ids]),
        )
        if progress is not None:
            progress(step + 1, work.new_tokens)

        if step + 1 < work.new_tokens:
            started = time.perf_counter()
            feed = beams.choose(step_logits[:BEAM_WIDTH]) + samples.choose(step_logits[BEAM_WIDTH:])
            decode_s += time.perf_counter() - started

    best, best_score = beams.best()
    beams.finish()
    samples.finish()
    if cache.num_used_blocks != 0:
        raise AssertionError(f"{cache.num_used_blocks} blocks still used after every free")
    decoded = work.requests * work.new_tokens
    bs = work.block_size
    return {
        "device": cache.device,
        "prompt_len": work.prompt_len,
        "new_tokens": work.new_tokens,
        "block_size": bs,
        "layers": model.config.layers,
        "sequences": work.requests,
        "steps": work.new_tokens,
        "num_blocks": work.num_blocks,
        "prefill_seconds": prefill_s,
        "decode_seconds": decode_s,
        "tokens_decoded": decoded,
        "tokens_per_s": decoded / decode_s,
        "memory": {
            "all": everyone.summary(bs),
            "beam_search": beams_tally.summary(bs),
            "parallel_sampling": samples_tally.summary(bs),
        },
        "positions_checked": check.checked,
        "max_abs_deviation": check.max_abs,
        "max_rel_deviation": check.max_rel,
        "tolerance": TOLERANCE,
        "ok": check.ok,
        "best_beam": {"tokens": best, "score": best_score},
    }
