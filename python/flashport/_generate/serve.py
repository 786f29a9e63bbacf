"""``python -m flashport generate --serve N``: the demo model serving N
requests at once through :class:`flashport.Scheduler`, in a cache too
small for all of them (so that the scheduler preempts), every step's
logits checked against recomputing the sequence without a cache."""

from __future__ import annotations

import time

import numpy as np

import flashport

from .model import Model
from .run import Check


class Step:
    """The demo model as the scheduler's model step: its cached forward,
    the decode entries in one batch, each prompt chunk alone."""

    def __init__(self, model: Model) -> None:
        self.model = model

    def _seen(self, sids, tokens, logits) -> None:
        """What the step gave: ``logits`` of the positions of ``tokens``
        appended to ``sids``."""

    def __call__(self, cache, batch):
        out = np.zeros((len(batch), self.model.config.vocab), np.float32)
        decode = [i for i, (_, t) in enumerate(batch) if len(t) == 1]
        if decode:
            sids = [batch[i][0] for i in decode]
            tokens = np.array([[batch[i][1][0]] for i in decode])
            logits = self.model.forward_cached(cache, sids, tokens)
            self._seen(sids, tokens.tolist(), logits)
            out[decode] = logits[:, -1]
        for i, (sid, t) in enumerate(batch):
            if len(t) > 1:
                logits = self.model.forward_cached(cache, [sid], np.asarray(t)[None])
                self._seen([sid], [t.tolist()], logits)
                out[i] = logits[0, -1]
        return out


class CheckedStep(Step):
    """:class:`Step`, each entry's logits checked against
    :meth:`Model.forward_full` on the sequence's tokens so far. A
    sequence's tokens are those given for its id since it was made (a
    recomputed sequence gets a new id and all its tokens; a fork, whose
    first tokens were given to its parent, is not supported)."""

    def __init__(self, model: Model) -> None:
        super().__init__(model)
        self.check = Check(model)
        self.history: dict[int, list[int]] = {}

    def _seen(self, sids, tokens, logits) -> None:
        for sid, t in zip(sids, tokens, strict=True):
            self.history.setdefault(sid, []).extend(int(x) for x in t)
        for row, sid in enumerate(sids):
            n = len(tokens[row])
            self.check(logits[row : row + 1, -n:], np.array([self.history[sid]]))


def serve(
    model: Model,
    device: str,
    requests: int,
    prompt_len: int,
    new_tokens: int,
    block_size: int,
    preemption: str,
    seed: int,
) -> dict:
    """``requests`` prompts of 1 to ``prompt_len`` tokens, each generating 1
    to ``new_tokens`` greedily, in a cache of a third of the blocks they
    would take at once (and as many swap blocks): what the report prints."""
    rng = np.random.default_rng(seed)
    prompts = [
        rng.integers(0, model.config.vocab, rng.integers(1, prompt_len + 1)).tolist()
        for _ in range(requests)
    ]
    outputs = [int(rng.integers(1, new_tokens + 1)) for _ in range(requests)]
    most = max(-(-(len(p) + o) // block_size) for p, o in zip(prompts, outputs, strict=True))
    wanted = sum(-(-(len(p) + o) // block_size) for p, o in zip(prompts, outputs, strict=True))
    num_blocks = max(most, wanted // 3)
    cache = flashport.KVCache(
        num_blocks,
        block_size,
        model.config.heads_kv,
        model.config.head_dim,
        layers=model.config.layers,
        dtype=np.float32,
        device=device,
        swap_blocks=num_blocks,
    )
    step = CheckedStep(model)
    scheduler = flashport.Scheduler(cache, step, preemption=preemption)
    for p, o in zip(prompts, outputs, strict=True):
        scheduler.add(p, o)
    started = time.perf_counter()
    scheduler.run()
    seconds = time.perf_counter() - started
    if cache.num_used_blocks != 0 or cache.sequences:
        raise AssertionError("the scheduler left blocks or sequences behind")
    return {
        "device": cache.device,
        "requests": requests,
        "num_blocks": num_blocks,
        "blocks_wanted_at_once": wanted,
        "tokens_generated": sum(outputs),
        "seconds": seconds,
        "checked_positions": step.check.checked,
        "max_rel_deviation": step.check.max_rel,
        "ok": step.check.ok,
        **scheduler.stats,
    }
