"""FLASHPORT_NUM_THREADS: every value is checked and bounded, and the CPU's
helper threads stay bounded whatever sequence of values a program sets."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import flashport
import numpy as np
import pytest
from flashport import InvalidArgumentError

Q = np.random.default_rng(5).standard_normal((1, 4, 96, 16), dtype=np.float32)


def run_python(code: str, env: dict, timeout: float = 60) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter, so that a hang fails the test
    (the timeout) instead of hanging the suite."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize("value", ["1025", "0", "-3", "", "eight", "2.5"])
def test_bad_thread_counts_are_rejected_naming_the_variable_and_value(monkeypatch, value):
    # (A huge count is tried in a subprocess below: before the bound, it
    # hung the process.)
    monkeypatch.setenv("FLASHPORT_NUM_THREADS", value)
    for call in (
        lambda: flashport.attention(Q, Q, Q, device="cpu"),
        lambda: flashport.attention(Q, Q, Q, device="auto"),
        flashport.devices,
    ):
        with pytest.raises(InvalidArgumentError) as info:
            call()
        message = str(info.value)
        assert f'FLASHPORT_NUM_THREADS="{value}"' in message, message
        assert "from 1 to 1024" in message, message
    monkeypatch.setenv("FLASHPORT_NUM_THREADS", "3")
    flashport.attention(Q, Q, Q, device="cpu")


def test_a_huge_thread_count_fails_at_once_instead_of_spawning_threads():
    # Before the bound, this spawned threads until the machine gave out.
    result = run_python(
        """
        import numpy as np, flashport
        q = np.ones((1, 1, 8, 8), np.float32)
        try:
            flashport.attention(q, q, q, device="cpu")
        except flashport.InvalidArgumentError as e:
            print("rejected:", e)
        """,
        {"FLASHPORT_NUM_THREADS": "4294967297"},
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    assert 'rejected: FLASHPORT_NUM_THREADS="4294967297"' in result.stdout, result.stdout


@pytest.mark.skipif(sys.platform == "win32", reason="environment values are text on Windows")
def test_a_thread_count_that_is_not_text_is_rejected_not_ignored():
    env = {k.encode(): v.encode() for k, v in os.environ.items()}
    env[b"FLASHPORT_NUM_THREADS"] = b"4\xff"
    code = """
        import numpy as np, flashport
        q = np.ones((1, 1, 8, 8), np.float32)
        try:
            flashport.attention(q, q, q, device="cpu")
        except flashport.InvalidArgumentError as e:
            print("rejected:", e)
        """
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    assert "rejected: FLASHPORT_NUM_THREADS=" in result.stdout, result.stdout


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_cycling_thread_counts_keeps_the_thread_count_bounded():
    # One pool per distinct count, never freed, left 2,018 threads here.
    result = run_python(
        """
        import os, time
        import numpy as np, flashport
        # Threads before any call: Python's, and NumPy's BLAS (one per core
        # on some machines).
        before = len(os.listdir("/proc/self/task"))
        # At most 63 helpers, and the pool of the variants' parallel
        # iterators (one thread per core).
        bound = before + 63 + os.cpu_count() + 1
        q = np.random.default_rng(0).standard_normal((1, 4, 128, 16), dtype=np.float32)
        for _ in range(2):
            for n in [*range(1, 65), *range(64, 0, -7)]:
                os.environ["FLASHPORT_NUM_THREADS"] = str(n)
                flashport.attention(q, q, q, device="cpu")
        # Threads of a replaced pool exit on their own, soon after.
        deadline = time.monotonic() + 10
        while True:
            threads = len(os.listdir("/proc/self/task"))
            if threads <= bound or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        print("threads", threads, "bound", bound)
        """,
        {},
    )
    assert result.returncode == 0, result.stderr
    threads, bound = int(result.stdout.split()[-3]), int(result.stdout.split()[-1])
    # 2,018 before one shared pool (on a 2-core machine, bound 70 there).
    assert threads <= bound, result.stdout


def test_fewer_threads_than_the_pool_has_give_the_same_bits(monkeypatch):
    monkeypatch.setenv("FLASHPORT_NUM_THREADS", "1")
    expected = flashport.attention(Q, Q, Q, device="cpu")
    for n in ["5", "2", "3", "1"]:
        monkeypatch.setenv("FLASHPORT_NUM_THREADS", n)
        np.testing.assert_array_equal(flashport.attention(Q, Q, Q, device="cpu"), expected)
