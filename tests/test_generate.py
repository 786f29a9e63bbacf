"""``python -m flashport generate``: the NumPy transformer's cached forward
against its no-cache recompute, RoPE against its formula, beam search
against brute force, the memory accounting against the cache's own counts,
and the CLI end to end."""

from __future__ import annotations

import io
import itertools
import json

import numpy as np
import pytest
from flashport import __main__ as cli
from flashport._generate import model as model_module
from flashport._generate.memory import Tally, check_pool, snapshot
from flashport._generate.model import Config, Model, rope
from flashport._generate.report import Progress
from flashport._generate.run import TOLERANCE, Workload, generate
from flashport._generate.search import BeamSearch, Sampling, log_softmax
from flashport._generate.serve import serve

SMALL = Config(vocab=64, d_model=64, heads_q=4, heads_kv=2, head_dim=16, hidden=96, layers=2)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_cached_logits_match_recompute(backend, block_size):
    model = Model(SMALL, seed=3)
    work = Workload(prompt_len=9, new_tokens=6, block_size=block_size, seed=1)
    r = generate(model, backend, work)
    assert r["ok"], r
    assert 0 < r["max_rel_deviation"] <= TOLERANCE
    # The prompt's positions once, then every sequence's every step.
    assert r["positions_checked"] == 9 + 12 * 6
    assert r["tokens_decoded"] == 12 * 6 and r["device"].split(":")[0] == backend


def test_the_check_catches_keys_at_the_wrong_position(monkeypatch):
    """Keys rotated one position too far in the cached (float32) path only:
    every score shifts, the oracle does not, and the check must say FAIL.
    (Shifting q and k alike would pass: RoPE sees only relative positions.)"""
    right = model_module.rope

    def keys_off_by_one(x, positions, base=10000.0):
        shift = x.dtype == np.float32 and x.shape[1] == SMALL.heads_kv
        return right(x, positions + 1 if shift else positions, base)

    monkeypatch.setattr(model_module, "rope", keys_off_by_one)
    r = generate(Model(SMALL, seed=3), "cpu", Workload(9, 4, 4, 1))
    assert not r["ok"] and r["max_rel_deviation"] > 100 * TOLERANCE


def test_rope_matches_the_formula_and_is_relative():
    rng = np.random.default_rng(0)
    d, base = 8, 10000.0
    x = rng.standard_normal((2, 5, d))
    positions = np.array([0, 1, 7, 30, 1000])
    got = rope(x, positions, base)
    want = np.empty_like(x)
    for h, t, i in itertools.product(range(2), range(5), range(d // 2)):
        theta = positions[t] * base ** (-2 * i / d)
        a, b = x[h, t, i], x[h, t, i + d // 2]
        want[h, t, i] = a * np.cos(theta) - b * np.sin(theta)
        want[h, t, i + d // 2] = a * np.sin(theta) + b * np.cos(theta)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    # A rotation: norms kept; scores depend on the offset only.
    np.testing.assert_allclose(np.linalg.norm(got, axis=-1), np.linalg.norm(x, axis=-1))
    q, k = rng.standard_normal(d), rng.standard_normal(d)

    def score(m, n):
        return rope(q[None], np.array([m]), base)[0] @ rope(k[None], np.array([n]), base)[0]

    assert score(13, 4) == pytest.approx(score(109, 100), abs=1e-12)
    assert abs(score(13, 4) - score(13, 5)) > 1e-3


def _beam_search(model: Model, prompt: np.ndarray, new_tokens: int, width: int):
    cache = model.new_cache(64, 3, "cpu")
    sid = cache.new_sequence()
    logits = model.forward_cached(cache, [sid], prompt[None])[0, -1:]
    beams = BeamSearch(cache, sid, width)
    cache.free(sid)
    for step in range(new_tokens):
        feed = beams.choose(logits)
        if step + 1 < new_tokens:
            ids = [s for s, _ in feed]
            logits = model.forward_cached(cache, ids, np.array([[t] for _, t in feed]))[:, 0]
    best = beams.best()
    beams.finish()
    assert cache.num_used_blocks == 0
    return best


@pytest.mark.parametrize("vocab,new_tokens", [(4, 2), (2, 3)])
def test_beam_search_finds_the_brute_force_best(vocab, new_tokens):
    """Width 4 keeps every candidate when vocab**(new_tokens - 1) <= 4, so
    the search is exhaustive and must find the most likely continuation."""
    model = Model(Config(vocab=vocab, d_model=32, heads_q=4, heads_kv=2, head_dim=8, hidden=48))
    prompt = np.array([1, 0, 1, 1, 0]) % vocab
    seqs = np.array(list(itertools.product(range(vocab), repeat=new_tokens)))
    full = np.concatenate([np.repeat(prompt[None], len(seqs), 0), seqs], axis=1)
    logp = log_softmax(model.forward_full(full))
    n = len(prompt)
    scores = sum(logp[np.arange(len(seqs)), n - 1 + i, seqs[:, i]] for i in range(new_tokens))
    assert np.unique(np.round(scores, 6)).size == len(seqs), "a tie would make best ambiguous"
    best, score = _beam_search(model, prompt, new_tokens, width=4)
    assert best == seqs[np.argmax(scores)].tolist()
    assert score == pytest.approx(scores.max(), abs=1e-4)


def test_sharing_is_counted_once_and_matches_the_pool():
    model = Model(SMALL, seed=5)
    cache = model.new_cache(12, 4, "cpu")
    prompt = cache.new_sequence()
    model.forward_cached(cache, [prompt], np.arange(1, 9)[None])  # two full blocks
    samples = Sampling(cache, prompt, 3, seed=0)
    cache.free(prompt)
    forks = samples.seq_ids
    s = snapshot(cache, forks)
    assert (s.blocks_held, s.table_entries, s.live_slots, s.tokens) == (2, 6, 8, 24)
    check_pool(cache, s)
    model.forward_cached(cache, forks, np.array([[3], [4], [5]]))
    s = snapshot(cache, forks)
    # The prompt's 2 blocks once, a new block each holding 1 position.
    assert (s.blocks_held, s.table_entries, s.live_slots, s.tokens) == (5, 9, 11, 27)
    check_pool(cache, s)
    assert cache.num_used_blocks + cache.num_free_blocks == cache.num_blocks == 12
    assert cache.num_used_blocks == 5
    # A snapshot of some sequences only disagrees with the pool, and says so.
    with pytest.raises(AssertionError, match="blocks used"):
        check_pool(cache, snapshot(cache, forks[:1]))
    tally = Tally()
    tally.add(s, max_len=12)
    m = tally.summary(block_size=4)
    assert m["peak_blocks"] == 5 and m["peak_contiguous_slots"] == 36
    assert m["paged_live_fraction"] == pytest.approx(11 / 20)
    assert m["contiguous_live_fraction"] == pytest.approx(27 / 36)
    assert m["sharing_saved"] == pytest.approx(1 - 5 / 9)
    samples.finish()
    assert cache.num_used_blocks == 0


def test_cli_prints_the_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "generate.json"
    argv = ["generate", "--device", "cpu", "--prompt-len", "5", "--new-tokens", "3"]
    argv += ["--block-size", "2", "--layers", "1", "--seed", "7", "--json", str(out)]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    for expected in (
        "beam search 4 + parallel sampling 8",
        "tokens/s",
        "all sequences",
        "saved by sharing",
        "peak blocks used",
        ": PASS",
    ):
        assert expected in text, text
    (run,) = json.loads(out.read_text())
    assert run["device"] == "cpu" and run["ok"] and run["steps"] == 3
    assert run["memory"]["all"]["peak_blocks"] <= run["num_blocks"]


def test_cli_refuses_bad_sizes(capsys):
    with pytest.raises(SystemExit):
        cli.main(["generate", "--block-size", "0"])
    assert "expected an integer >= 1" in capsys.readouterr().err


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_only_on_a_terminal():
    log = io.StringIO()
    p = Progress("cpu", log)
    p(1, 4)
    p.close()
    assert log.getvalue() == ""
    tty = _Terminal()
    p = Progress("cpu", tty)
    p(3, 4)
    assert tty.getvalue() == "\r  cpu: step 3/4"
    p.close()
    assert tty.getvalue().endswith("\r\033[K")


@pytest.mark.parametrize("preemption", ["swap", "recompute"])
def test_serving_through_the_scheduler_keeps_every_logit(backend, preemption):
    """--serve: requests in a cache a third of their size, preempted and
    resumed, every step's logits against the no-cache recompute."""
    r = serve(Model(SMALL, seed=4), backend, 8, 12, 10, 4, preemption, seed=2)
    assert r["ok"] and r["preemptions"] > 0, r
    kind = "swaps" if preemption == "swap" else "recomputations"
    assert r[kind] == r["preemptions"]
    assert r["checked_positions"] >= r["tokens_generated"]
