"""preemption="auto": the decision between swapping and recomputing as a
pure function of measured costs, the measurements (what is counted, the
fit of the model's cost per token), and a scheduler that swaps when its
model is slow and recomputes when its swap space is."""

from __future__ import annotations

import time

import numpy as np
import pytest
from flashport import KVCache, Scheduler
from flashport._preemption import Costs, choose
from tiny_lm import TinyLM


@pytest.mark.parametrize(
    "blocks,tokens,swap_free,swap_s,recompute_s,want",
    [
        # The swap space cannot take it, or there is nothing to recompute.
        (5, 80, 4, 1e-6, 1.0, "recompute"),
        (0, 0, 10, 1.0, 1e-6, "recompute"),
        # Unmeasured: swap (which measures swapping).
        (5, 80, 5, None, 1e-3, "swap"),
        (5, 80, 5, 1.0, None, "swap"),
        # Measured: the cheaper; a tie recomputes.
        (5, 80, 5, 1e-3, 1e-3, "swap"),  # 5 ms against 80 ms
        (5, 80, 5, 0.1, 1e-3, "recompute"),  # 500 ms against 80 ms
        (4, 80, 9, 0.02, 1e-3, "recompute"),  # 80 ms each
        (4, 81, 9, 0.02, 1e-3, "swap"),
    ],
)
def test_choose_takes_the_cheaper_measured_way(
    blocks, tokens, swap_free, swap_s, recompute_s, want
):
    assert choose(blocks, tokens, swap_free, swap_s, recompute_s) == want


def test_costs_skip_the_first_measurements_and_fit_the_cost_per_token():
    c = Costs()
    assert c.recompute_s_per_token is None and c.swap_s_per_block is None
    c.model_call(100, 5.0)  # the first call: pipelines built, not counted
    assert c.recompute_s_per_token is None
    # seconds = 1 ms + 20 µs a token: the slope is the marginal cost.
    for tokens in [1, 32, 7, 200, 64, 3, 500]:
        c.model_call(tokens, 1e-3 + 2e-5 * tokens)
    assert c.recompute_s_per_token == pytest.approx(2e-5, rel=1e-6)

    same = Costs()
    for _ in range(4):
        same.model_call(32, 3.2e-3)  # one size: no slope, the mean per token
    assert same.recompute_s_per_token == pytest.approx(1e-4)

    noisy = Costs()
    for tokens, seconds in [(1, 0), (10, 2e-3), (20, 1e-3)]:
        noisy.model_call(tokens, seconds)  # a falling fit: the mean again
    # (the first call not counted; the older one weighs 0.99)
    assert noisy.recompute_s_per_token == pytest.approx((0.99 * 2e-3 + 1e-3) / (0.99 * 10 + 20))

    # Old calls fade: 300 calls at 1 µs a token after 300 at 1 ms.
    drift = Costs()
    for i in range(600):
        rate = 1e-3 if i < 300 else 1e-6
        drift.model_call(10 + i % 7, rate * (10 + i % 7))
    assert drift.recompute_s_per_token < 1e-4

    c.swap("out", 10, 9.0)  # the first swap out: not counted
    assert c.swap_s_per_block is None
    c.swap("out", 4, 0.004)
    assert c.swap_s_per_block == pytest.approx(2e-3)  # out, and in as dear
    c.swap("in", 8, 1.0)  # the first swap in
    assert c.swap_s_per_block == pytest.approx(2e-3)
    c.swap("in", 5, 0.010)
    assert c.swap_s_per_block == pytest.approx(1e-3 + 2e-3)


class SlowModel(TinyLM):
    """TinyLM that takes 1 ms a token given."""

    def __call__(self, cache, batch):
        time.sleep(1e-3 * sum(len(t) for _, t in batch))
        return super().__call__(cache, batch)


class SlowSwapCache(KVCache):
    """A KVCache whose swaps take 20 ms each way."""

    def swap_out(self, seq_ids):
        time.sleep(0.02)
        super().swap_out(seq_ids)

    def swap_in(self, seq_ids):
        time.sleep(0.02)
        super().swap_in(seq_ids)


def _requests():
    rng = np.random.default_rng(1)
    return [
        (rng.integers(0, 24, rng.integers(1, 9)).tolist(), int(rng.integers(4, 17)))
        for _ in range(10)
    ]


def _outputs(s, requests):
    ids = [s.add(p, m) for p, m in requests]
    got = s.run()
    return [got[i] for i in ids]


def test_auto_swaps_for_a_slow_model_and_recomputes_for_a_slow_swap():
    fast = TinyLM()
    alone = []
    for p, m in _requests():
        s = Scheduler(fast.cache(64), fast)
        rid = s.add(p, m)
        alone.append(s.run()[rid])

    slow = SlowModel()
    s = Scheduler(slow.cache(6, swap_blocks=24), slow, preemption="auto")
    assert _outputs(s, _requests()) == alone
    assert s.stats["preemptions"] >= 3 and s.stats["swaps"] == s.stats["preemptions"], s.stats

    cache = SlowSwapCache(6, 4, fast.hkv, fast.d, layers=fast.layers, dtype=np.float64,
                          device="cpu", swap_blocks=24)  # fmt: skip
    s = Scheduler(cache, fast, preemption="auto")
    assert _outputs(s, _requests()) == alone
    # Two swaps out measure swapping (the first is not counted); then the
    # 20 ms a way loses to recomputing a few tokens.
    assert s.stats["swaps"] == 2 and s.stats["recomputations"] >= 1, s.stats
    assert s.costs.swap_s_per_block > 100 * s.costs.recompute_s_per_token
