"""Beam search's choice of the next beams, as a pure function: shared by
:class:`flashport.Scheduler` (beam requests) and the generation demo's
beam search outside it (``flashport._generate.search``), so both choose
the same beams from the same logits."""

from __future__ import annotations

import numpy as np

__all__ = ["log_softmax", "select"]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """In float64, along the last axis."""
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def select(scores: np.ndarray, logits: np.ndarray, width: int) -> list[tuple[int, int, float]]:
    """The next beams: of every (beam, token) continuation of the beams
    scored ``scores (beams,)`` (sums of their tokens' log-probabilities)
    with next-token ``logits (beams, vocab)``, the ``width`` best by score,
    as (parent beam, token, new score), best first.

    Ties break towards the lower (beam, token) pair (a stable sort of the
    flattened grid), so the choice is deterministic."""
    logp = log_softmax(logits)
    total = np.asarray(scores, dtype=np.float64)[:, None] + logp
    best = np.argsort(-total.ravel(), kind="stable")[:width]
    parents, tokens = np.divmod(best, logp.shape[1])
    return [
        (p, t, float(total[p, t])) for p, t in zip(parents.tolist(), tokens.tolist(), strict=True)
    ]
