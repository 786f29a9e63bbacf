"""The serving benchmark's own arithmetic (timings are never asserted): its
trace has the lengths and arrivals it states, its decoder gives every
request the same outputs through the paged cache and the max-length
reservation, and a run serves every request and counts the waste."""

from __future__ import annotations

import numpy as np
from flashport import Scheduler, _bench_serve


def test_the_trace_has_the_stated_lengths_and_arrivals():
    requests = _bench_serve.trace("sharegpt", 4000, rate=8.0, max_len=1024, seed=1)
    arrivals = [t for t, _, _ in requests]
    prompts = np.array([len(p) for _, p, _ in requests])
    outputs = np.array([o for _, _, o in requests])
    assert np.all(np.diff(arrivals) > 0)
    assert abs(len(requests) / arrivals[-1] - 8.0) < 0.5
    assert prompts.min() >= 1 and prompts.max() <= 512 and outputs.max() <= 512
    # Means as the paper's, after the clipping.
    assert abs(prompts.mean() / 161.31 - 1) < 0.05
    assert abs(outputs.mean() / 337.99 - 1) < 0.05
    assert requests[:3] == _bench_serve.trace("sharegpt", 4000, 8.0, 1024, 1)[:3]


def test_both_systems_give_every_request_the_same_outputs(backend):
    model = _bench_serve.Decoder(layers=2, heads=2)
    requests = _bench_serve.trace("alpaca", 6, rate=100.0, max_len=64, seed=2)
    outs = []
    for block in (4, 64):
        s = Scheduler(model.cache(256 // block, block, backend), model)
        ids = [s.add(p, o) for _, p, o in requests]
        got = s.run()
        outs.append([got[i] for i in ids])
    assert outs[0] == outs[1]
    assert [len(o[0]) for o in outs[0]] == [o for _, _, o in requests]


def test_a_run_serves_every_request_and_counts_the_waste():
    model = _bench_serve.Decoder(layers=1, heads=2)
    requests = _bench_serve.trace("alpaca", 12, rate=200.0, max_len=64, seed=3)
    paged = _bench_serve.serve(model, requests, model.cache(64, 4, "cpu"), max_batch=256)
    reserved = _bench_serve.serve(model, requests, model.cache(4, 64, "cpu"), max_batch=256)
    for row in (paged, reserved):
        assert row["requests_per_s"] > 0 and 0 <= row["kv_waste"] < 1
        assert row["largest_batch"] >= 1
    # A reservation of the maximum length wastes more than blocks of 4.
    assert reserved["kv_waste"] > paged["kv_waste"]
    assert reserved["largest_batch"] <= 4
