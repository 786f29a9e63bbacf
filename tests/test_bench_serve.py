"""The serving benchmark's own arithmetic (timings are never asserted): its
trace has the lengths and arrivals it states, its decoder gives every
request the same outputs however the cache is cut, each system grants
memory as it says (reservations within the budget, never preempted; waste
in the order of what they reserve), the sustained rate is what its
definition says, the overhead section times decode batches, and the
command runs end to end with its table, JSON, plot and progress lines."""

from __future__ import annotations

import json

import numpy as np
import pytest
from flashport import Scheduler
from flashport import __main__ as cli
from flashport._bench.serve import sustained
from flashport._bench.serve_replay import (
    Decoder,
    next_power_of_two,
    overhead,
    serve,
    systems,
    trace,
)


def test_the_trace_has_the_stated_lengths_and_arrivals():
    requests = trace("sharegpt", 4000, rate=8.0, max_len=1024, seed=1)
    arrivals = [t for t, _, _ in requests]
    prompts = np.array([len(p) for _, p, _ in requests])
    outputs = np.array([o for _, _, o in requests])
    assert np.all(np.diff(arrivals) > 0)
    assert abs(len(requests) / arrivals[-1] - 8.0) < 0.5
    assert prompts.min() >= 1 and prompts.max() <= 512 and outputs.max() <= 512
    # Means as the paper's, after the clipping.
    assert abs(prompts.mean() / 161.31 - 1) < 0.05
    assert abs(outputs.mean() / 337.99 - 1) < 0.05
    assert requests[:3] == trace("sharegpt", 4000, 8.0, 1024, 1)[:3]
    # Another rate: the same requests, arrivals scaled.
    faster = trace("sharegpt", 4000, 16.0, 1024, 1)
    assert [r[1:] for r in faster] == [r[1:] for r in requests]
    assert np.allclose([t for t, _, _ in faster], np.array(arrivals) / 2)


def test_the_decoder_gives_every_request_the_same_outputs_however_the_cache_is_cut(backend):
    model = Decoder(layers=2, heads=2)
    requests = trace("alpaca", 6, rate=100.0, max_len=64, seed=2)
    outs = []
    for block in (4, 64):
        s = Scheduler(model.cache(256 // block, block, backend), model)
        ids = [s.add(p, o) for _, p, o in requests]
        got = s.run()
        outs.append([got[i] for i in ids])
    assert outs[0] == outs[1]
    assert [len(o[0]) for o in outs[0]] == [o for _, _, o in requests]


def test_reservations_are_the_papers():
    assert [next_power_of_two(n) for n in (1, 2, 3, 64, 65, 1000)] == [1, 2, 4, 64, 128, 1024]
    paged, most, pow2, oracle = systems(16, 1024)
    assert paged.reserve is None
    assert (most.reserve(30, 40), pow2.reserve(30, 40), oracle.reserve(30, 40)) == (1024, 128, 70)


def ticks(seconds=1e-3):
    """A clock for serve() that moves ``seconds`` a reading: runs that do
    not depend on how fast the machine is."""
    now = [0.0]

    def read():
        now[0] += seconds
        return now[0]

    return read


def test_each_system_serves_every_request_within_its_budget():
    model = Decoder(layers=1, heads=2)
    kv, max_len = 256, 64
    requests = trace("alpaca", 24, rate=400.0, max_len=max_len, seed=3)
    rows = {}
    for system in systems(4, max_len):
        seen = []
        rows[system.name] = row = serve(
            model, requests, system, kv_tokens=kv, block_size=4, max_batch=256,
            progress=seen.append, timer=ticks(),
        )  # fmt: skip
        assert seen[-1]["finished"] == len(requests) == seen[-1]["requests"]
        assert row["requests_per_s"] > 0 and 0 <= row["kv_waste"] < 1
        assert 0 < row["scheduler_share"] < 1
        if system.reserve is not None:
            assert row["preemptions"] == 0
            # Never more admitted at once than their reservations allow.
            least = min(system.reserve(len(p), o) for _, p, o in requests)
            assert 1 <= row["largest_batch"] <= kv // least
    paged, most = rows[systems(4, max_len)[0].name], rows[systems(4, max_len)[1].name]
    # The maximum length: the budget holds exactly kv // max_len, and a
    # burst of 24 requests fills it.
    assert most["largest_batch"] == kv // max_len
    assert paged["largest_batch"] > most["largest_batch"]


def test_waste_follows_what_each_system_reserves():
    """Requests one at a time (each done before the next arrives): every
    system runs the same steps, so only the grant differs."""
    model = Decoder(layers=1, heads=2)
    requests = trace("alpaca", 5, rate=0.01, max_len=256, seed=4)
    assert any(len(p) + o not in (64, 128, 256) for _, p, o in requests)
    waste = [
        serve(model, requests, s, kv_tokens=512, block_size=4, max_batch=8, timer=ticks())[
            "kv_waste"
        ]
        for s in systems(4, 256)
    ]
    paged, most, pow2, oracle = waste
    assert paged < oracle < pow2 < most
    # A block of 4 wastes at most 3 slots of a sequence's last block.
    assert paged < 0.5


def test_the_sustained_rate_is_the_last_under_the_bound_from_the_bottom():
    def rows(name, latencies):
        return [
            {"system": name, "rate": rate, "normalized_latency_s": lat}
            for rate, lat in zip([1, 2, 4, 8], latencies, strict=True)
        ]

    table = [
        *rows("a", [0.1, 0.2, 0.3, 0.9]),
        # Over the bound at 4: 8 is not sustained even though it dips back.
        *rows("b", [0.1, 0.3, 0.6, 0.4]),
        *rows("c", [0.6, 0.1, 0.1, 0.1]),
        *rows("d", [0.1, 0.1, 0.1, 0.5]),
    ]
    assert sustained(table, bound=0.5) == {"a": 4, "b": 2, "c": None, "d": 8}


def test_the_overhead_section_times_decode_batches():
    model = Decoder(layers=1, heads=2)
    # More prompt tokens than one step of the serving runs takes (2048):
    # the timed steps are still whole decode batches (it raises otherwise).
    o = overhead(model, 8, block_size=4, steps=3, prompt=300)
    assert o["batch"] == 8
    assert 0 < o["model_s"] < o["step_s"] and o["scheduler_s"] > 0
    assert o["scheduler_share"] == pytest.approx(o["scheduler_s"] / o["step_s"])


def test_cli_prints_the_tables_writes_json_and_reports_progress(tmp_path, capsys):
    out = tmp_path / "serve.json"
    argv = [
        "bench", "serve", "--trace", "alpaca", "--requests", "8", "--rates", "20,400",
        "--kv-tokens", "256", "--max-len", "64", "--block-size", "4", "--layers", "1",
        "--heads", "2", "--overhead-batches", "1,2", "--progress", "0", "--json", str(out),
    ]  # fmt: skip
    assert cli.main(argv) == 0
    printed = capsys.readouterr()
    assert "| batch | step ms |" in printed.out
    assert "| 400 | power-of-two reservation |" in printed.out
    assert "Sustained rate" in printed.out and "against the max-length" in printed.out
    assert "trace clock" in printed.err  # --progress 0: a line every step
    result = json.loads(out.read_text())
    assert len(result["rows"]) == 2 * 4 and len(result["overhead"]) == 2
    assert set(result["sustained"]) == {s.name for s in systems(4, 64)}
    assert result["latency_bound_s"] > 0


def test_cli_draws_the_plot_after_a_run_and_from_its_json(tmp_path):
    pytest.importorskip("matplotlib")
    png, again, raw = tmp_path / "serve.png", tmp_path / "again.png", tmp_path / "serve.json"
    argv = [
        "bench", "serve", "--trace", "alpaca", "--requests", "4", "--rates", "50,100",
        "--kv-tokens", "128", "--max-len", "32", "--block-size", "4", "--layers", "1",
        "--heads", "2", "--overhead-batches", "", "--plot", str(png), "--json", str(raw),
    ]  # fmt: skip
    assert cli.main(argv) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert cli.main(["bench", "serve", "--from-json", str(raw), "--plot", str(again)]) == 0
    assert again.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_refuses_a_plot_without_matplotlib_before_running(capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name)
    )
    with pytest.raises(SystemExit):
        cli.main(["bench", "serve", "--plot", "x.png", "--requests", "100000"])
    assert "--plot needs matplotlib" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--rates", "4,2"], "increasing rates"),
        (["--rates", "0,1"], "increasing rates above 0"),
        (["--overhead-batches", "0"], "at least 1"),
        (["--max-len", "512", "--kv-tokens", "256"], "--max-len 512 is more than --kv-tokens"),
        (["--clock", "process"], "--clock process"),
        (["--from-json", "x.json"], "give --plot PATH"),
    ],
)
def test_cli_refuses_bad_arguments(extra, message, capsys, monkeypatch):
    monkeypatch.delenv("FLASHPORT_NUM_THREADS", raising=False)
    with pytest.raises(SystemExit):
        cli.main(["bench", "serve", *extra])
    assert message in capsys.readouterr().err
