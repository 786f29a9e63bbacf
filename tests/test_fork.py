"""A process forked after flashport computed (multiprocessing's "fork" start
method, PyTorch DataLoader workers) computes correctly instead of waiting
for the parent's threads; device arrays it inherited are refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import flashport
import pytest

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")

CHILD_WORK = """
    import json, multiprocessing, sys, threading, time
    import numpy as np, flashport
    from flashport import reference

    device = sys.argv[1]
    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((2, 4, 96, 16), dtype=np.float32) for _ in range(4))
    mask = rng.random((96, 96)) > 0.3

    def errors(_):
        try:
            o, lse = flashport.attention(q, k, v, mask=mask, return_lse=True, device=device)
        except flashport.BackendUnavailableError as e:
            return str(e)
        grads = flashport.attention_backward(do, q, k, v, o, lse, mask=mask, device=device)
        ref_o = reference.attention(q, k, v, mask=mask)
        ref_grads = reference.attention_backward(do, q, k, v, mask=mask)
        return max(
            float(np.abs(got - want).max())
            for got, want in zip((o, *grads), (ref_o, *ref_grads))
        )

    def read_inherited(_):
        try:
            kept.numpy()
        except flashport.GpuError as e:
            return str(e)
        return "read"

    # The parent computes first: its pools, buffers and GPU device exist.
    errors(None)
    if device == "gpu":
        kept = flashport.to_device(q)
    # And a call is in flight on another thread while the children fork.
    big = rng.standard_normal((1, 4, 1024, 32))
    busy = threading.Thread(target=lambda: flashport.attention(big, big, big, device="cpu"))
    busy.start()
    time.sleep(0.05)

    with multiprocessing.get_context("fork").Pool(2) as pool:
        print("children", json.dumps(pool.map_async(errors, range(4)).get(timeout=60)), flush=True)
        if device == "gpu":
            print("inherited", pool.apply_async(read_inherited, (0,)).get(timeout=60), flush=True)
    busy.join()
    print("parent", errors(None), flush=True)
"""


def software_gpu() -> bool:
    gpus = [d for d in flashport.devices() if d["device"].startswith("gpu")]
    return any(d["type"] == "software" for d in gpus)


def test_forked_children_compute(backend):
    env = {**os.environ, "FLASHPORT_NUM_THREADS": "2"}
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CHILD_WORK), backend],
        env=env,
        capture_output=True,
        text=True,
        # A child that hangs fails the test instead of hanging the suite.
        timeout=150,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    children = json.loads(lines["children"])
    assert len(children) == 4
    refused = [c for c in children if isinstance(c, str)]
    if refused:
        # NVIDIA's driver opens no device in a forked child: the error says
        # so and what to do. Drivers that allow it (lavapipe) must compute.
        assert backend == "gpu" and not software_gpu(), children
        assert all("forked" in c and "spawn" in c for c in refused), refused
    assert all(c < 1e-4 for c in children if not isinstance(c, str)), children
    assert float(lines["parent"]) < 1e-4
    if backend == "gpu":
        # The parent's device is not the child's: its arrays are refused.
        assert "device array" in lines["inherited"], lines["inherited"]


RAW_FORK = """
    import os, sys
    import numpy as np, flashport

    q = np.ones((1, 2, 64, 16), np.float32)
    flashport.attention(q, q, q, device="gpu")
    pid = os.fork()
    if pid == 0:
        try:
            flashport.attention(q, q, q, device="gpu")
            print("child computed", flush=True)
        except flashport.BackendUnavailableError:
            # NVIDIA opens no device in a forked child (the message says so).
            print("child refused", flush=True)
        sys.exit(3)
    _, status = os.waitpid(pid, 0)
    print("child exit status", os.waitstatus_to_exitcode(status), flush=True)
"""


def test_a_raw_forked_child_that_used_the_gpu_exits(gpu):
    """os.fork() then sys.exit() in a child that touched the GPU: the
    driver's exit handlers waited for the parent's threads, and the child
    never exited (multiprocessing's workers end with os._exit and did not
    hang). It exits, with its status."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(RAW_FORK)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] in ("child computed", "child refused"), done.stdout
    assert lines[-1] == "child exit status 3", done.stdout


QUEUED_FORK = """
    import os, sys, threading
    import numpy as np, flashport

    rng = np.random.default_rng(1)
    q = flashport.to_device(rng.standard_normal((1, 2, 64, 16), dtype=np.float32))
    want = flashport.attention(q, q, q).numpy()
    stop = threading.Event()

    def queue_calls():
        # Calls queued without a wait, back to back: this thread is in
        # the driver much of the time.
        while not stop.is_set():
            x = q
            for _ in range(8):
                x = flashport.attention(x, q, q)
            flashport.synchronize()

    busy = threading.Thread(target=queue_calls)
    busy.start()
    statuses = []
    for _ in range(4):
        pid = os.fork()
        if pid == 0:
            a = np.ones((1, 2, 64, 16), np.float32)
            try:
                flashport.attention(a, a, a, device="gpu")
            except flashport.BackendUnavailableError:
                pass  # NVIDIA opens no device in a forked child
            flashport.attention(a, a, a, device="cpu")
            os._exit(3)
        _, status = os.waitpid(pid, 0)
        statuses.append(os.waitstatus_to_exitcode(status))
    stop.set()
    busy.join()
    print("statuses", *statuses, flush=True)
    print("parent", bool(np.array_equal(flashport.attention(q, q, q).numpy(), want)), flush=True)
"""


def test_a_fork_while_another_thread_runs_gpu_calls(gpu):
    """Forks while another thread queues GPU calls back to back: every
    child computes (or, where the driver refuses a forked child a device,
    says so) and exits, and the parent's results are unchanged.

    On NVIDIA's driver (580.159.04, H200) the first child never exited
    (the test's 150 s timeout), with or without a pthread_atfork handler
    that held each fork until no flashport thread was inside a GPU call,
    so it is not a flashport thread's lock the child inherits; the cause
    was not found. Not fixed; docs/design.md says to start workers with
    "spawn" there. Run where the adapter is a software one."""
    if not software_gpu():
        pytest.skip("a child forked during GPU calls hangs on NVIDIA (see the docstring)")
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(QUEUED_FORK)],
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["statuses 3 3 3 3", "parent True"], done.stdout


LIVE_CACHE = """
    import os, sys
    import numpy as np, flashport

    device = sys.argv[1]
    cache = flashport.KVCache(8, 4, 2, 8, device=device)
    sid = cache.new_sequence()
    k = np.random.default_rng(0).standard_normal((2, 3, 8)).astype(np.float32)
    cache.append(sid, k, k)
    q = np.ones((1, 2, 1, 8), np.float32)
    want = np.asarray(cache.attention(q, [sid]))
    pid = os.fork()
    if pid == 0:
        try:
            got = np.asarray(cache.attention(q, [sid]))
            cache.append(sid, k, k)
            print("child", bool(np.array_equal(got, want)), cache.length(sid), flush=True)
        except flashport.GpuError as e:
            print("child refused", "forked" in str(e), cache.length(sid), flush=True)
        os._exit(0)
    os.waitpid(pid, 0)
    same = np.array_equal(np.asarray(cache.attention(q, [sid])), want)
    print("parent", bool(same), cache.length(sid), flush=True)
"""


def test_a_forked_child_with_a_live_cache(backend):
    """A CPU KVCache in a forked child is the child's own copy (its appends
    leave the parent's alone); a GPU one is refused there by a GpuError
    that says why (its pools are the parent's GPU memory), the cache left
    as it was; the parent's keeps working either way."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(LIVE_CACHE), backend],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    child, parent = done.stdout.splitlines()
    assert child == ("child True 6" if backend == "cpu" else "child refused True 3"), child
    assert parent == "parent True 3", parent
