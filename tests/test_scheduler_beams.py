"""Beam search requests through flashport.Scheduler: the choice of beams
against brute force, the scheduler's beams against the generation demo's
beam search outside it (the same model and prompt, the CPU and the GPU),
beams under preemption against each request alone, and the blocks beams
share and give back."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from flashport import InvalidArgumentError, Scheduler, _beam
from flashport._generate.model import Config, Model
from flashport._generate.run import Workload, generate
from flashport._generate.search import BeamSearch
from flashport._generate.serve import Step
from hypothesis import given
from hypothesis import strategies as st
from tiny_lm import TinyLM


@given(
    beams=st.integers(1, 4),
    vocab=st.integers(1, 5),
    width=st.integers(1, 8),
    # Few distinct values, so that ties are common.
    values=st.lists(st.sampled_from([-1.0, 0.0, 0.5, 2.0]), min_size=24, max_size=24),
)
def test_select_keeps_the_best_continuations_ties_to_the_lower_pair(beams, vocab, width, values):
    logits = np.array(values[: beams * vocab]).reshape(beams, vocab)
    scores = np.array(values[-beams:]) * 0.25
    logp = _beam.log_softmax(logits)
    # Brute force: every (beam, token), by score, then beam, then token.
    grid = [
        (-(scores[b] + logp[b, t]), b, t) for b, t in itertools.product(range(beams), range(vocab))
    ]
    want = [(b, t) for _, b, t in sorted(grid)[:width]]
    got = _beam.select(scores, logits, width)
    assert [(b, t) for b, t, _ in got] == want
    for b, t, score in got:
        assert score == scores[b] + logp[b, t]


SMALL = Config(vocab=64, d_model=64, heads_q=4, heads_kv=2, head_dim=16, hidden=96, layers=2)


def test_the_schedulers_beams_are_the_demos(backend):
    """The demo's beam search (width 4, outside the scheduler, beside 8
    samples in one batch) and a beam request of width 4 through the
    scheduler, on the same model and prompt: the same best beam and score;
    and every beam of the demo's BeamSearch alone, in order."""
    model = Model(SMALL, seed=7)
    work = Workload(prompt_len=10, new_tokens=7, block_size=4, seed=3)
    demo = generate(model, backend, work)
    prompt = np.random.default_rng(work.seed).integers(0, SMALL.vocab, work.prompt_len)

    cache = model.new_cache(64, work.block_size, backend)
    sid = cache.new_sequence()
    logits = model.forward_cached(cache, [sid], prompt[None])[0, -1:]
    beams = BeamSearch(cache, sid, 4)
    cache.free(sid)
    for step in range(work.new_tokens):
        feed = beams.choose(logits)
        if step + 1 < work.new_tokens:
            ids = [s for s, _ in feed]
            logits = model.forward_cached(cache, ids, np.array([[t] for _, t in feed]))[:, 0]
    want = [(generated, score) for _, score, generated in beams.beams]
    beams.finish()

    s = Scheduler(model.new_cache(64, work.block_size, backend), Step(model))
    rid = s.add(prompt.tolist(), work.new_tokens, beam_width=4)
    out = s.run()[rid]
    r = s.requests[rid]
    assert out[0] == demo["best_beam"]["tokens"]
    assert r.scores[0] == pytest.approx(demo["best_beam"]["score"], rel=1e-5)
    assert out == [g for g, _ in want]
    assert r.scores == pytest.approx([sc for _, sc in want], rel=1e-5)
    assert s.cache.num_used_blocks == 0 and s.cache.sequences == []


@pytest.mark.parametrize("vocab,new_tokens", [(4, 2), (2, 3)])
def test_an_exhaustive_beam_finds_the_most_likely_continuation(vocab, new_tokens):
    """Width 4 keeps every candidate when vocab**(new_tokens - 1) <= 4."""
    model = TinyLM(vocab=vocab)
    prompt = [1, 0, 1, 1, 0]
    cont = list(itertools.product(range(vocab), repeat=new_tokens))

    def next_logp(seq):
        cache = model.cache(64)
        return _beam.log_softmax(model(cache, [(cache.new_sequence(), np.array(seq))])[0])

    scores = [sum(next_logp(prompt + list(c[:i]))[c[i]] for i in range(new_tokens)) for c in cont]
    assert len(set(np.round(scores, 9))) == len(cont), "a tie would make the best ambiguous"
    s = Scheduler(model.cache(64), model)
    rid = s.add(prompt, new_tokens, beam_width=4)
    out = s.run()[rid]
    assert out[0] == list(cont[int(np.argmax(scores))])
    assert s.requests[rid].scores[0] == pytest.approx(max(scores), abs=1e-9)


def _alone(model, prompt, max_new, width):
    s = Scheduler(model.cache(64), model)
    rid = s.add(prompt, max_new, beam_width=width)
    return s.run()[rid], s.requests[rid].scores


@pytest.mark.parametrize("preemption", ["swap", "recompute", "auto"])
@pytest.mark.parametrize("max_tokens", [12, 64])
def test_beams_under_preemption_are_those_of_each_request_alone(preemption, max_tokens):
    model = TinyLM()
    rng = np.random.default_rng(5)
    requests = [
        (rng.integers(0, 24, rng.integers(2, 9)).tolist(), int(rng.integers(4, 11)), w)
        for w in (2, 3, 1, 4, 2, 3)
    ]
    want = [_alone(model, *r) for r in requests]
    # Up to 4 beams of up to 18 positions in blocks of 4 (20 blocks
    # unshared; fewer alone, where they share): preemption happens; with 12
    # tokens a step, recomputed beams come back in chunks, in step.
    s = Scheduler(
        model.cache(14, swap_blocks=64), model, preemption=preemption, max_tokens=max_tokens
    )
    ids = [s.add(p, m, beam_width=w) for p, m, w in requests]
    got = s.run()
    for rid, (out, scores) in zip(ids, want, strict=True):
        assert got[rid] == out
        # The model's float64 logits round differently in other batches.
        assert s.requests[rid].scores == pytest.approx(scores, rel=1e-12)
    assert s.stats["preemptions"] > 0, s.stats
    assert s.cache.num_used_blocks == 0 and s.cache.sequences == []


def test_beams_share_their_blocks_and_pruned_beams_are_freed():
    model = TinyLM()
    prompt = list(range(12))  # three full blocks of 4
    s = Scheduler(model.cache(64), model)
    rid = s.add(prompt, 9, beam_width=4)
    seen = []
    while s.unfinished:
        s.step()
        r = s.requests[rid]
        live = [q.sid for q in r.seqs if q.sid is not None]
        seen.append((len(live), s.cache.num_used_blocks, sorted(s.cache.sequences)))
        if live and r.state == "running":
            # Exactly the beams are live: a pruned beam is freed at once.
            assert sorted(s.cache.sequences) == sorted(live)
            table = s.cache.block_table(live)
            # Every beam holds the prompt's three blocks, the same three.
            assert (table[:, :3] == table[0, :3]).all()
    assert seen[-1] == (0, 0, [])
    # Four beams of up to 21 positions: 24 blocks unshared; the prompt's
    # three are held once.
    assert max(used for _, used, _ in seen) <= 4 * 6 - 3 * 3
    assert max(n for n, _, _ in seen) == 4


def test_beam_requests_refuse_sampling_arguments():
    model = TinyLM()
    s = Scheduler(model.cache(8), model)
    with pytest.raises(InvalidArgumentError, match="beam_width=0"):
        s.add([1, 2], 3, beam_width=0)
    with pytest.raises(InvalidArgumentError, match=r"beam_width=2.*n=3"):
        s.add([1, 2], 3, beam_width=2, n=3)
    with pytest.raises(InvalidArgumentError, match=r"beam_width=2.*temperature=0.5"):
        s.add([1, 2], 3, beam_width=2, temperature=0.5)
    assert s.requests == {} and s.unfinished == 0
