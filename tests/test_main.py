"""The main job and the extension's stubs, as a user would run them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import gpu_adapters


def test_main_job_runs_and_checks_every_device(tmp_path):
    out = tmp_path / "rows.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "flashport",
            "--seq",
            "96",
            "--heads",
            "2",
            "--dim",
            "32",
            "--repeat",
            "1",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())
    devices = {row["device"].split(" ")[0].rstrip(":") for row in rows}
    assert "cpu" in devices
    if gpu_adapters():
        assert "gpu" in devices
    for row in rows:
        assert row["ok"] and row["forward_rel_err"] < 1e-4 and row["backward_rel_err"] < 1e-3
        assert row["forward_gflops"] > 0 and row["naive_matrices_bytes"] == 2 * 2 * 96 * 96 * 4
    assert "GFLOP/s" in proc.stdout


def test_devices_command_lists_the_cpu():
    proc = subprocess.run(
        [sys.executable, "-m", "flashport", "devices"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert '"device": "cpu"' in proc.stdout


def test_varlen_bench_runs_and_compares_equal_results(backend, tmp_path):
    """The benchmark's two calls compute the same rows (its timings are
    printed, never asserted)."""
    out = tmp_path / "varlen.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "flashport",
            "bench",
            "varlen",
            *("--device", backend, "--lengths", "3,17,40", "--heads", "2", "--dim", "8"),
            *("--repeat", "1", "--json", str(out)),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["lengths"] == [3, 17, 40]
    assert [row["causal"] for row in result["rows"]] == [False, True]
    for row in result["rows"]:
        assert row["max_abs_diff_varlen_vs_padded"] < 1e-5
        # Padded: 3 sequences of 40 rows; packed: 3, 17 and 40 rows.
        padded, packed = (3 * 820, 6 + 153 + 820) if row["causal"] else (40 * 60, 9 + 289 + 1600)
        assert row["work"] == pytest.approx(padded / packed)
    assert "padded/varlen" in proc.stdout


def test_stubs_match_the_extension():
    pytest.importorskip("mypy")
    proc = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "flashport._core", "--ignore-missing-stub"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_torch_bench_times_both_implementations(tmp_path):
    """bench torch runs a training step on flashport and on sdpa, with the
    same logits before training (its timings are printed, never asserted)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    out = tmp_path / "torch.json"
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "flashport", "bench", "torch", "--quick", "--seq", "32"),
            *("--repeat", "1", "--json", str(out)),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["sizes"]["seq"] == 32 and result["max_abs_logit_diff"] < 1e-4
    assert set(result["rows"]) == {"flashport", "sdpa"}
    for row in result["rows"].values():
        assert row["attention_forward_s"] > 0 and row["attention_backward_s"] > 0
        assert 0 < row["attention_share"] < 1 and row["step_s"] > 0
    assert "attn share" in proc.stdout
