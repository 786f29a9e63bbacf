"""Decoding policies over a shared KV cache: beam search (fork + free as
beams are selected) and parallel sampling (``n`` forks of the prompt).

A policy owns its live sequences. Each step the driver runs one batched
forward over every policy's sequences, hands each policy the logits of its
sequences' last positions (:meth:`choose`), and the policy answers with the
sequences to feed next and their tokens, having forked and freed in the
cache as its choice requires."""

from __future__ import annotations

import numpy as np

import flashport

from .._beam import log_softmax, select

__all__ = ["BeamSearch", "Sampling", "log_softmax"]


class BeamSearch:
    """Beam search of ``width`` beams scored by the sum of their tokens'
    log-probabilities (every beam has the same length: no length penalty).

    Ties between candidates break towards the lower (beam, token) pair, so
    the search is deterministic. A parent chosen ``m`` times keeps its
    sequence for the first child and forks for the others; a parent not
    chosen is freed: the beams share their common prefix's blocks, and a
    beam's partly filled last block is copied only when a child writes into
    it."""

    name = "beam search"

    def __init__(self, cache: flashport.KVCache, prompt_sid: int, width: int) -> None:
        self.cache = cache
        self.width = width
        # (sequence, score, generated tokens); one beam until the first choice.
        self.beams: list[tuple[int, float, list[int]]] = [(cache.fork(prompt_sid), 0.0, [])]

    @property
    def seq_ids(self) -> list[int]:
        return [sid for sid, _, _ in self.beams]

    def choose(self, logits: np.ndarray) -> list[tuple[int, int]]:
        """``logits (len(seq_ids), vocab)``: the next beams, returned as
        (sequence, token) to append."""
        scores = np.array([score for _, score, _ in self.beams])
        taken: set[int] = set()
        forks: list[tuple[int, float, list[int]]] = []
        for parent, token, score in select(scores, logits, self.width):
            sid, _, generated = self.beams[parent]
            child = sid if parent not in taken else self.cache.fork(sid)
            taken.add(parent)
            forks.append((child, score, [*generated, token]))
        for parent, (sid, _, _) in enumerate(self.beams):
            if parent not in taken:
                self.cache.free(sid)
        self.beams = forks
        return [(sid, generated[-1]) for sid, _, generated in self.beams]

    def generated_of(self) -> dict[int, list[int]]:
        """Each live beam's generated tokens, by sequence."""
        return {sid: generated for sid, _, generated in self.beams}

    def best(self) -> tuple[list[int], float]:
        """The highest-scoring beam's generated tokens and score (the first
        beam on a tie, which the selection order makes the lowest)."""
        _, score, generated = max(self.beams, key=lambda b: b[1])
        return generated, score

    def finish(self) -> None:
        for sid in self.seq_ids:
            self.cache.free(sid)
        self.beams = []


class Sampling:
    """``n`` independent samples of the same prompt at temperature 1, from a
    seeded generator: ``n`` forks of the prompt share its blocks (a partly
    filled last block until each sample writes into it)."""

    name = "parallel sampling"

    def __init__(self, cache: flashport.KVCache, prompt_sid: int, n: int, seed: int) -> None:
        self.cache = cache
        self.rng = np.random.default_rng(seed)
        self._seq_ids = [cache.fork(prompt_sid) for _ in range(n)]
        self.generated: list[list[int]] = [[] for _ in range(n)]

    @property
    def seq_ids(self) -> list[int]:
        return list(self._seq_ids)

    def generated_of(self) -> dict[int, list[int]]:
        """Each sample's generated tokens, by sequence."""
        return dict(zip(self._seq_ids, self.generated, strict=True))

    def choose(self, logits: np.ndarray) -> list[tuple[int, int]]:
        probs = np.exp(log_softmax(logits))
        out = []
        for i, (sid, p) in enumerate(zip(self._seq_ids, probs, strict=True)):
            token = int(self.rng.choice(p.shape[0], p=p / p.sum()))
            self.generated[i].append(token)
            out.append((sid, token))
        return out

    def finish(self) -> None:
        for sid in self._seq_ids:
            self.cache.free(sid)
        self._seq_ids = []
