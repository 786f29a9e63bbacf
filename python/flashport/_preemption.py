"""How :class:`flashport.Scheduler`'s ``preemption="auto"`` chooses between
swapping a request out and recomputing it: the costs it measures on its
own run (:class:`Costs`) and a pure decision on them (:func:`choose`).

Swapping a request costs its blocks' trip to the swap space and back;
recomputing it costs the model's work on its tokens again. Which is cheaper
depends on the machine (the PagedAttention paper: on the PCIe bandwidth
against the GPU's compute) and on the request (blocks grow with its
length, recomputation with its length too but at another rate, and a
request of several forks recomputes each fork's tokens while its shared
blocks move once), so neither a fixed rule nor one measurement of the
machine alone answers it."""

from __future__ import annotations

from typing import Literal

__all__ = ["Costs", "choose"]

# Model calls weigh less as they age (a factor per call: the last ~100
# count most), so the estimate follows a run whose contexts grow.
_DECAY = 0.99


def choose(
    blocks: int,
    tokens: int,
    swap_free_blocks: int,
    swap_s_per_block: float | None,
    recompute_s_per_token: float | None,
) -> Literal["swap", "recompute"]:
    """The cheaper way to preempt a request holding ``blocks`` distinct
    blocks whose sequences have ``tokens`` tokens in the cache in all.

    ``swap_s_per_block``: seconds to move a block out and back in;
    ``recompute_s_per_token``: seconds of model work per token given; None
    where not measured yet. Recompute when the swap space has fewer than
    ``blocks`` free blocks or there is nothing to recompute; swap while
    swapping is unmeasured (swapping is how it gets measured) or the model
    is; otherwise whichever costs less (recompute on a tie)."""
    if blocks > swap_free_blocks or tokens == 0:
        return "recompute"
    if swap_s_per_block is None or recompute_s_per_token is None:
        return "swap"
    return "swap" if blocks * swap_s_per_block < tokens * recompute_s_per_token else "recompute"


class Costs:
    """What the scheduler has measured so far: the model's seconds per
    token given, and the swap space's seconds per block each way.

    The first model call and the first swap each way are not counted: they
    carry one-time costs (on the GPU, pipelines built on first use) that
    would make one kind of preemption look many times dearer than it is,
    and "auto" would then never try it again."""

    def __init__(self) -> None:
        # Decayed sums over model calls for a least-squares fit of
        # seconds = a + b · tokens: weight, Σx, Σy, Σx², Σxy.
        self._fit = [0.0] * 5
        self._calls = 0
        # Per direction: (swaps seen, blocks counted, seconds counted).
        self._swaps = {"out": [0, 0, 0.0], "in": [0, 0, 0.0]}

    def model_call(self, tokens: int, seconds: float) -> None:
        self._calls += 1
        if self._calls == 1:
            return
        f = self._fit
        for i in range(5):
            f[i] *= _DECAY
        x = float(tokens)
        f[0] += 1.0
        f[1] += x
        f[2] += seconds
        f[3] += x * x
        f[4] += x * seconds

    def swap(self, direction: Literal["out", "in"], blocks: int, seconds: float) -> None:
        seen = self._swaps[direction]
        seen[0] += 1
        if seen[0] > 1:
            seen[1] += blocks
            seen[2] += seconds

    @property
    def recompute_s_per_token(self) -> float | None:
        """The fit's slope (the marginal seconds of a token given, which is
        what a recomputation adds to the steps that carry it), or the mean
        seconds per token where the calls have not varied enough in size
        to fit one or the fit is not positive (noise)."""
        w, sx, sy, sxx, sxy = self._fit
        if w == 0 or sx == 0:
            return None
        var = sxx / w - (sx / w) ** 2
        if var > 1e-9 * (sx / w) ** 2:
            slope = (sxy / w - (sx / w) * (sy / w)) / var
            if slope > 0:
                return slope
        return sy / sx

    @property
    def swap_s_per_block(self) -> float | None:
        """Seconds per block out plus back in; a direction not measured
        yet is taken to cost what the other does."""
        rates = [s / b for _, b, s in self._swaps.values() if b > 0]
        if not rates:
            return None
        return rates[0] + rates[-1] if len(rates) == 2 else 2 * rates[0]
