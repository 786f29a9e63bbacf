"""flashport.Scheduler: continuous batching over a KVCache with a small
real attention model. Every request's outputs are those of running it
alone, with and without preemption, under each preemption policy, with
chunked prefill and parallel sampling; admission is first come first
served and preempted requests resume before new ones; errors are clear."""

from __future__ import annotations

import flashport
import numpy as np
import pytest
from flashport import CacheFullError, InvalidArgumentError, Scheduler
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from tiny_lm import TinyLM


def _requests(seed, count):
    """Prompts of 1 to 8 tokens and 4 to 16 new ones: each fits 6 blocks of
    4 alone, and their outputs outgrow what admission saw."""
    rng = np.random.default_rng(seed)
    return [
        (rng.integers(0, 24, rng.integers(1, 9)).tolist(), int(rng.integers(4, 17)))
        for _ in range(count)
    ]


def _alone(model, prompt, max_new, **kw):
    model.calls = []
    s = Scheduler(model.cache(64), model)
    rid = s.add(prompt, max_new, **kw)
    return s.run()[rid]


@pytest.mark.parametrize("preemption", ["swap", "recompute", "auto"])
@pytest.mark.parametrize("max_tokens", [4, 64])
def test_outputs_are_those_of_each_request_alone(preemption, max_tokens):
    model = TinyLM()
    requests = _requests(1, 10)
    want = [_alone(model, p, m) for p, m in requests]
    model.calls = []
    # 6 blocks of 4 positions, requests of up to 24: preemption happens.
    cache = model.cache(6, swap_blocks=24)
    s = Scheduler(cache, model, preemption=preemption, max_tokens=max_tokens)
    ids = [s.add(p, m) for p, m in requests]
    got = s.run()
    assert [got[i] for i in ids] == want
    assert s.stats["preemptions"] > 0, s.stats
    kind = {"swap": "swaps", "recompute": "recomputations"}.get(preemption)
    if kind:
        assert s.stats[kind] == s.stats["preemptions"], s.stats
    assert s.cache.num_used_blocks == 0 and s.cache.sequences == []
    if max_tokens == 4:
        assert max(sum(c) for c in model.calls) <= 4 + 10


def test_without_pressure_nothing_is_preempted_and_decode_is_one_batch():
    model = TinyLM()
    requests = _requests(2, 6)
    model.calls = []
    s = Scheduler(model.cache(64), model)
    for p, m in requests:
        s.add(p, m)
    s.run()
    assert s.stats["preemptions"] == 0
    # Once every prompt is in, a step is one decode batch of all running.
    assert [1] * 6 in model.calls


def test_parallel_samples_share_the_prompt_and_draw_their_own_tokens():
    model = TinyLM()
    prompt = list(range(9))
    s = Scheduler(model.cache(64), model, seed=3)
    rid = s.add(prompt, 6, n=4, temperature=1.5)
    seen_used = []
    s.run(progress=lambda st: seen_used.append(s.cache.num_used_blocks))
    outs = s.requests[rid].outputs
    assert len(outs) == 4 and all(len(o) == 6 for o in outs)
    assert len({tuple(o) for o in outs}) > 1, "samples are drawn from their own streams"
    # Four sequences of 15 positions in blocks of 4: 16 blocks unshared;
    # the two full prompt blocks are shared.
    assert max(seen_used) <= 16 - 2 * 3
    # Deterministic given the seed; the greedy samples all agree.
    s2 = Scheduler(model.cache(64), model, seed=3)
    s2.add(prompt, 6, n=4, temperature=1.5)
    assert s2.run()[0] == outs
    s3 = Scheduler(model.cache(64), model)
    s3.add(prompt, 6, n=3)
    assert len({tuple(o) for o in s3.run()[0]}) == 1


def test_parallel_samples_survive_preemption():
    model = TinyLM()
    reqs = [(list(range(1, 8)), 6), (list(range(3, 12)), 5), (list(range(8)), 4)]
    want = []
    for k, (p, m) in enumerate(reqs):
        s = Scheduler(model.cache(64), model)
        s.add(p, m, n=3, temperature=1.0, seed=k)
        want.append(s.run()[0])
    for preemption in ("swap", "recompute", "auto"):
        s = Scheduler(model.cache(10, swap_blocks=32), model, preemption=preemption)
        ids = [s.add(p, m, n=3, temperature=1.0, seed=k) for k, (p, m) in enumerate(reqs)]
        got = s.run()
        assert [got[i] for i in ids] == want, preemption
        assert s.stats["preemptions"] > 0, (preemption, s.stats)


def test_preempted_requests_resume_before_new_ones():
    model = TinyLM()
    s = Scheduler(model.cache(8, swap_blocks=16), model, preemption="swap")
    a = s.add(list(range(10)), 8)
    b = s.add(list(range(5, 15)), 8)
    order = []
    while s.unfinished:
        s.step()
        order.append((list(s.running), list(s.swapped), list(s.waiting)))
        if len(order) == 1:
            late = s.add([1, 2, 3], 2)
    assert s.stats["swaps"] > 0
    # After b was swapped out, the late request never ran while b waited
    # in the swap space.
    for running, swapped, _ in order:
        if b in swapped:
            assert late not in running
    assert s.requests[a].state == s.requests[late].state == "finished"


def test_errors_are_clear():
    model = TinyLM()
    cache = model.cache(4)
    with pytest.raises(InvalidArgumentError, match="swap_blocks > 0"):
        Scheduler(cache, model, preemption="swap")
    with pytest.raises(InvalidArgumentError, match="preemption='later'"):
        Scheduler(cache, model, preemption="later")
    s = Scheduler(cache, model)
    with pytest.raises(InvalidArgumentError, match="max_new_tokens"):
        s.add([1, 2], 0)
    with pytest.raises(InvalidArgumentError, match="prompt"):
        s.add([], 3)
    # A request that cannot fit the whole cache alone.
    s.add(list(range(40)), 2)
    with pytest.raises(CacheFullError, match="larger KVCache"):
        s.run()
    assert flashport.Scheduler is Scheduler


class SchedulerMachine(RuleBasedStateMachine):
    """Requests arriving between steps, against two models: the cache's
    bookkeeping (every block used belongs to a running request's sequences;
    swapped ones hold only host blocks; nothing leaks when all finish), and
    each request run alone (its outputs, once finished)."""

    model = TinyLM()

    request = st.tuples(
        st.lists(st.integers(0, 23), min_size=1, max_size=8),
        st.integers(1, 16),
        # n samples, or a beam search of that width.
        st.sampled_from([("n", 1), ("n", 1), ("n", 2), ("beam", 2)]),
    )
    requests = st.lists(request, min_size=1, max_size=4)

    @initialize(
        # A request of 2 sequences (or beams) of up to 24 positions fits 12
        # blocks of 4.
        blocks=st.integers(12, 14),
        swap=st.sampled_from([0, 3, 32]),
        preemption=st.sampled_from(["swap", "recompute", "auto"]),
        max_tokens=st.sampled_from([2, 5, 64]),
        max_batch=st.sampled_from([2, 4, 256]),
        # Enough at once that their outputs outgrow the pool.
        first=st.lists(request, min_size=4, max_size=8),
    )
    def setup(self, blocks, swap, preemption, max_tokens, max_batch, first):
        if preemption == "swap" and swap == 0:
            preemption = "auto"
        self.cache = self.model.cache(blocks, swap_blocks=swap)
        self.s = Scheduler(
            self.cache, self.model, preemption=preemption, max_tokens=max_tokens,
            max_batch=max_batch,
        )  # fmt: skip
        self.want: dict[int, list[list[int]]] = {}
        for request in first:
            self._add(*request)

    def _add(self, prompt, max_new, kind):
        seed = len(self.want)
        how, width = kind
        kw = {"n": width, "temperature": 0.7} if how == "n" else {"beam_width": width}
        rid = self.s.add(prompt, max_new, seed=seed, **kw)
        alone = Scheduler(self.model.cache(64), self.model)
        alone.add(prompt, max_new, seed=seed, **kw)
        self.want[rid] = alone.run()[0]

    @rule(more=requests)
    def add(self, more):
        for request in more:
            self._add(*request)

    @precondition(lambda self: self.s.unfinished)
    @rule()
    def step(self):
        before = {rid for rid, r in self.s.requests.items() if r.state != "finished"}
        done = self.s.step()
        for rid in done:
            assert rid in before and self.s.requests[rid].outputs == self.want[rid]

    @invariant()
    def blocks_belong_to_running_requests(self):
        s, cache = self.s, self.cache
        live = [q.sid for rid in s.running for q in s.requests[rid].seqs if q.sid is not None]
        swapped = [q.sid for rid in s.swapped for q in s.requests[rid].seqs if q.sid is not None]
        assert sorted(cache.swapped) == sorted(swapped)
        assert sorted(cache.sequences) == sorted(live + swapped)
        held = set(cache.block_table(live).ravel().tolist()) - {-1} if live else set()
        assert cache.num_used_blocks == len(held)
        # Queues partition the unfinished requests; running ones in order.
        queued = [*s.waiting, *s.running, *s.swapped]
        assert len(queued) == len(set(queued)) == s.unfinished

    def teardown(self):
        if hasattr(self, "s"):
            self.s.run()
            for rid, r in self.s.requests.items():
                assert r.outputs == self.want[rid]
            assert self.cache.num_used_blocks == 0 and self.cache.sequences == []


def test_scheduler_state_machine():
    run_state_machine_as_test(
        SchedulerMachine,
        settings=settings(stateful_step_count=30, max_examples=25, deadline=None),
    )
