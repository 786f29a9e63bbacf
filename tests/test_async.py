"""Calls that do not wait: a call whose arrays are all DeviceArrays returns
once its work is queued on the GPU. Queue order must keep every result
exact (the same bits as calls that wait), a GPU failure under queued work
must surface as GpuError and never as stale values, inputs may be dropped
while their calls are queued, and the queue is bounded."""

from __future__ import annotations

import gc
import threading

import flashport
import numpy as np
import pytest
from flashport import DeviceArray, GpuError, InvalidArgumentError, _core, to_device

# The most submissions a context keeps queued without a wait, and the most
# queued calls whose commands it holds back while the GPU is busy
# (rust/flashport-core/src/gpu/context.rs, MAX_QUEUED and MAX_PENDING).
MAX_QUEUED = 32
MAX_PENDING = 8

HEADS, KV_LEN, D = 2, 16, 8
STEPS = 100


def phases() -> list[str]:
    """The host phases the calling thread's last GPU call recorded."""
    return [name for name, _ in _core._gpu_kernel_times() if name.startswith("host:")]


def waited() -> bool:
    """Whether the last GPU call waited for the GPU."""
    return "host:wait" in phases()


def chain_inputs(dtype=np.float32):
    rng = np.random.default_rng(34)

    def normal(*shape):
        return rng.standard_normal(shape, dtype=np.float32).astype(dtype)

    return {
        # The 3-d chain, whose outputs are appended to the cache as keys
        # and values: (heads, 1, d) rows.
        "t": normal(HEADS, 1, D),
        "k3": normal(HEADS, KV_LEN, D),
        "v3": normal(HEADS, KV_LEN, D),
        # The 4-d chain: attention, then decoding over the cache.
        "x": normal(1, HEADS, 1, D),
        "k4": normal(1, HEADS, KV_LEN, D),
        "v4": normal(1, HEADS, KV_LEN, D),
        # A contiguous cache for attention_with_kvcache itself.
        "kc": normal(1, HEADS, KV_LEN, D),
        "vc": normal(1, HEADS, KV_LEN, D),
    }


def run_chain(arrays, *, device: bool, sync_each: bool = False, on_step=None):
    """``STEPS`` rounds of dependent calls, each feeding the next: attention
    of the 3-d row, appended to a GPU KVCache as a key and a value; the 4-d
    query through attention, the cache's decode (which must see the row just
    appended) and attention_with_kvcache over a contiguous cache. With
    ``device`` every argument is a DeviceArray (nothing waits); otherwise
    NumPy (every call waits). Returns every step's outputs as NumPy."""
    a = {name: to_device(x) for name, x in arrays.items()} if device else dict(arrays)
    dtype = arrays["t"].dtype
    cache = flashport.KVCache(STEPS // 4 + 1, 4, HEADS, D, layers=1, dtype=dtype, device="gpu")
    sid = cache.new_sequence()
    lens = np.array([KV_LEN], np.int32)
    t, x = a["t"], a["x"]
    kept = []
    for step in range(STEPS):
        t = flashport.attention(t, a["k3"], a["v3"], device="gpu")
        cache.append(sid, t, t)
        x = flashport.attention(x, a["k4"], a["v4"], device="gpu")
        x = cache.attention(x, [sid], causal=False)
        x = flashport.attention_with_kvcache(x, a["kc"], a["vc"], lens, device="gpu")
        if sync_each:
            flashport.synchronize()
        kept.append((t, x))
        if on_step is not None:
            on_step(step)
    return [tuple(np.asarray(y) for y in pair) for pair in kept]


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_a_chain_of_queued_calls_gives_the_bits_of_calls_that_wait(gpu, dtype):
    arrays = chain_inputs(dtype)
    queued_depths = []

    def depth(step):
        queued_depths.append(_core._testing_queued_submissions())
        # Not one of a chain's calls waited for the GPU.
        assert not waited(), phases()

    flashport.synchronize()
    queued = run_chain(arrays, device=True, on_step=depth)
    synced = run_chain(arrays, device=True, sync_each=True)
    numpy = run_chain(arrays, device=False)
    # The calls were queued (the queue filled to its bound) and no more.
    assert max(queued_depths) == MAX_QUEUED
    for step, (a, b, c) in enumerate(zip(queued, synced, numpy, strict=True)):
        for got_q, got_s, want, name in zip(a, b, c, ("t", "x"), strict=True):
            assert want.dtype == dtype and np.isfinite(want).all(), (step, name)
            assert got_q.tobytes() == want.tobytes(), f"queued chain, step {step}, {name}"
            assert got_s.tobytes() == want.tobytes(), f"synchronized chain, step {step}, {name}"
    # The chain moves: the decode saw rows appended during the chain.
    assert not np.array_equal(numpy[0][1], numpy[-1][1])


def test_queued_calls_from_two_threads_give_the_bits_of_calls_that_wait(gpu):
    """Two threads queue dependent chains at once: the context's submitter
    takes both threads' calls as they come, and each chain still runs in
    its own order, with the bits of calls that wait."""
    arrays = chain_inputs()
    want = run_chain(arrays, device=False)
    got: list = [None, None]
    failures: list = []

    def work(i):
        try:
            got[i] = run_chain(arrays, device=True)
        except BaseException as e:  # surfaced by the assertion below
            failures.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not failures, failures
    for chain in got:
        assert chain is not None and len(chain) == STEPS
        for step, (a, b) in enumerate(zip(chain, want, strict=True)):
            for g, w, name in zip(a, b, ("t", "x"), strict=True):
                assert g.tobytes() == w.tobytes(), f"step {step}, {name}"


def test_calls_on_device_arrays_do_not_wait_and_the_others_do(gpu):
    q, k, v = chain_inputs()["x"], chain_inputs()["k4"], chain_inputs()["v4"]
    tq, tk, tv = (to_device(x) for x in (q, k, v))
    assert waited(), "an upload waits"
    o, lse = flashport.attention(tq, tk, tv, return_lse=True)
    assert not waited() and "host:submit" in phases()
    flashport.attention_backward(o, tq, tk, tv, o, lse)
    assert not waited()
    tq.copy()
    assert not waited()
    # A NumPy argument among DeviceArrays: the call waits, as NumPy calls do.
    assert isinstance(flashport.attention(tq, k, tv), DeviceArray)
    assert waited()
    flashport.attention(q, k, v, device="gpu")
    assert waited()
    # Reading a result waits for it (and everything queued before it).
    o.numpy()
    assert waited()


def test_timed_calls_wait_and_measure_their_kernels(gpu):
    tq, tk, tv = (to_device(chain_inputs()[n]) for n in ("x", "k4", "v4"))
    want = flashport.attention(tq, tk, tv).numpy()
    _core._gpu_kernel_timing(True)
    try:
        got = flashport.attention(tq, tk, tv)
        times = _core._gpu_kernel_times()
    finally:
        _core._gpu_kernel_timing(False)
    assert "host:wait" in [name for name, _ in times]
    # Kernel times, from timestamp queries where the adapter has them
    # (lavapipe does): each measured, none zero.
    kernels = [s for name, s in times if not name.startswith("host:")]
    assert all(s > 0 for s in kernels), times
    assert got.numpy().tobytes() == want.tobytes()


def test_del_of_inputs_while_their_call_is_queued_is_safe(gpu):
    """The freed buffers go back to the pool while the call that reads them
    is queued: queued copies take them at once and overwrite them, and the
    call must still have read the values it was given."""
    rng = np.random.default_rng(5)
    # A size no other test uses, so that the pool's buffers of its size
    # class are this test's.
    q, k, v = (rng.standard_normal((1, 3, 77, 24), dtype=np.float32) for _ in range(3))
    want = flashport.attention(q, k, v, device="gpu")
    fill = to_device(np.full_like(q, 7.0))
    tq, tk, tv = (to_device(x) for x in (q, k, v))
    flashport.synchronize()
    out = flashport.attention(tq, tk, tv)
    assert not waited()
    del tq, tk, tv
    gc.collect()
    copies = [fill.copy() for _ in range(8)]
    assert not waited()
    assert out.numpy().tobytes() == want.tobytes()
    for c in copies:
        assert np.array_equal(c.numpy(), np.full_like(q, 7.0))


def test_the_queue_is_bounded(gpu):
    x = to_device(np.arange(4096, dtype=np.float32))
    flashport.synchronize()
    assert _core._testing_queued_submissions() == 0
    depths = []
    # Enough calls to fill the queue even where every submission carries
    # MAX_PENDING of them (a busy GPU's calls are held back and submitted
    # together).
    for _ in range(2 * MAX_QUEUED * MAX_PENDING):
        x.copy()
        depths.append(_core._testing_queued_submissions())
    assert max(depths) == MAX_QUEUED
    flashport.synchronize()
    assert _core._testing_queued_submissions() == 0


@pytest.fixture
def unpoisoned(monkeypatch):
    """Without the NaN poisoning of outputs (which the suite turns on): its
    host writes hand the held calls to the queue first, so that with it on
    no more than a call or two is ever held."""
    monkeypatch.setenv("FLASHPORT_GPU_POISON", "0")


def test_decode_calls_are_held_and_submitted_together(gpu, unpoisoned):
    rng = np.random.default_rng(8)
    rows = to_device(rng.standard_normal((1, HEADS, 1, D), dtype=np.float32))
    cache = flashport.KVCache(64, 4, HEADS, D, device="gpu")
    sid = cache.new_sequence()
    x = to_device(np.arange(64, dtype=np.float32))
    flashport.synchronize()
    depths = []
    for _ in range(2 * MAX_PENDING):
        cache.append_batch([sid], rows, rows)
        depths.append(_core._testing_queued_submissions())
    # Nothing goes to the queue until MAX_PENDING calls are held, then all
    # of them in one submission.
    assert depths == [0] * (MAX_PENDING - 1) + [1] * MAX_PENDING + [2]
    # A call that is not held takes the held ones with it.
    cache.append_batch([sid], rows, rows)
    assert _core._testing_queued_submissions() == 2
    x.copy()
    assert _core._testing_queued_submissions() == 3
    # So does synchronize().
    cache.append_batch([sid], rows, rows)
    flashport.synchronize()
    assert _core._testing_queued_submissions() == 0
    table = cache.block_table([sid])[0]
    n = 2 * MAX_PENDING + 2
    assert cache.length(sid) == n
    for pool in cache.read_layer():
        written = pool[table].transpose(1, 0, 2, 3).reshape(HEADS, -1, D)[:, :n]
        assert np.array_equal(written, np.repeat(rows.numpy()[0], n, axis=1))


def run_decode_chain(arrays, *, device: bool):
    """``STEPS`` rounds of decoding calls only (which the context may hold
    back), each feeding the next: the cache's decode of the row, the
    result appended to the cache as a key and a value, then decoded over a
    contiguous cache. Returns every step's row as NumPy."""
    a = {name: to_device(x) for name, x in arrays.items()} if device else dict(arrays)
    cache = flashport.KVCache(STEPS // 4 + 8, 4, HEADS, D, dtype=arrays["x"].dtype, device="gpu")
    sid = cache.new_sequence()
    cache.append_batch([sid], a["k4"], a["v4"])
    lens = np.array([KV_LEN], np.int32)
    x, kept = a["x"], []
    for _ in range(STEPS):
        x = cache.attention(x, [sid], causal=False)
        cache.append_batch([sid], x, x)
        x = flashport.attention_with_kvcache(x, a["kc"], a["vc"], lens, device="gpu")
        kept.append(x)
    return [np.asarray(y) for y in kept]


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_a_chain_of_held_calls_gives_the_bits_of_calls_that_wait(gpu, unpoisoned, dtype):
    arrays = chain_inputs(dtype)
    flashport.synchronize()
    want = run_decode_chain(arrays, device=False)
    got = run_decode_chain(arrays, device=True)
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert w.dtype == dtype and np.isfinite(w).all(), step
        assert g.tobytes() == w.tobytes(), f"step {step}"
    assert not np.array_equal(want[0], want[-1])


def test_del_of_inputs_while_their_call_is_held_is_safe(gpu, unpoisoned):
    """As test_del_of_inputs_while_their_call_is_queued_is_safe, with the
    call's commands still held when its caches go back to the pool: the
    copies that take them go to the queue in the same submission, after
    it."""
    rng = np.random.default_rng(6)
    q = rng.standard_normal((1, 4, 1, 24), dtype=np.float32)
    k, v = (rng.standard_normal((1, 2, 93, 24), dtype=np.float32) for _ in range(2))
    lens = np.array([93], np.int32)
    want = flashport.attention_with_kvcache(q, k, v, lens, device="gpu")
    fill = to_device(np.full_like(k, 7.0))
    tq, tk, tv = (to_device(x) for x in (q, k, v))
    flashport.synchronize()
    out = flashport.attention_with_kvcache(tq, tk, tv, lens)
    assert _core._testing_queued_submissions() == 0, "the call is held"
    del tk, tv
    gc.collect()
    copies = [fill.copy() for _ in range(4)]
    assert out.numpy().tobytes() == want.tobytes()
    for c in copies:
        assert np.array_equal(c.numpy(), np.full_like(k, 7.0))


def test_synchronize_is_public_and_takes_a_device_name(gpu):
    assert "synchronize" in flashport.__all__
    assert flashport.synchronize is flashport._device.synchronize
    assert flashport.synchronize.__doc__ and "GpuError" in flashport.synchronize.__doc__
    for device in (None, "gpu", "auto", "cpu", "GPU"):
        assert flashport.synchronize(device) is None
    assert flashport.synchronize(device="gpu") is None
    with pytest.raises(InvalidArgumentError, match="device"):
        flashport.synchronize("tpu")
    with pytest.raises((InvalidArgumentError, TypeError), match="device"):
        flashport.synchronize(3)


def queue_a_chain(steps=12):
    """A KVCache and DeviceArrays made by queued calls, still queued."""
    arrays = chain_inputs()
    a = {name: to_device(x) for name, x in arrays.items()}
    cache = flashport.KVCache(8, 4, HEADS, D, device="gpu")
    sid = cache.new_sequence()
    flashport.synchronize()
    t, x, outputs = a["t"], a["x"], []
    for _ in range(steps):
        t = flashport.attention(t, a["k3"], a["v3"])
        cache.append(sid, t, t)
        x = cache.attention(flashport.attention(x, a["k4"], a["v4"]), [sid])
        outputs += [t, x]
    assert not waited()
    return a, cache, sid, outputs


def assert_lost_everywhere(a, cache, sid, outputs):
    """Every array the lost device held raises when read or used, and so do
    its cache and a call on its arrays; nothing returns values."""
    for out in outputs:
        with pytest.raises(GpuError, match="lost"):
            out.numpy()
    with pytest.raises(GpuError, match="lost"):
        flashport.attention(outputs[-1], a["k4"], a["v4"])
    with pytest.raises(GpuError, match="lost"):
        cache.attention(chain_inputs()["x"], [sid])


def test_a_device_lost_under_queued_calls_raises_at_synchronize(gpu):
    inputs = [chain_inputs()[n] for n in ("x", "k4", "v4")]
    want = flashport.attention(*inputs, device="gpu")
    a, cache, sid, outputs = queue_a_chain()
    _core._testing_lose_device()
    with pytest.raises(GpuError, match="lost"):
        flashport.synchronize()
    assert_lost_everywhere(a, cache, sid, outputs)
    # The next GPU call opens a fresh device.
    again = flashport.attention(*inputs, device="gpu")
    assert again.tobytes() == want.tobytes()
    flashport.synchronize()


def test_a_device_lost_under_queued_calls_raises_when_a_result_is_read(gpu):
    a, cache, sid, outputs = queue_a_chain()
    _core._testing_lose_device()
    # No synchronize first: reading is where the loss surfaces.
    assert_lost_everywhere(a, cache, sid, outputs)
    with pytest.raises(GpuError, match="lost"):
        flashport.synchronize()
    # Once raised, the failed device is gone: nothing is left to wait for.
    flashport.synchronize()


def test_a_refused_call_in_the_middle_of_a_queued_chain(gpu):
    """Bad arguments in the middle of a chain of queued calls raise at once
    (validation runs before anything is queued), and the chain goes on: the
    work queued before and after keeps its bits, and a refused append
    leaves the cache as it was."""
    arrays = chain_inputs()
    want = run_chain(arrays, device=False)
    bad = to_device(np.ones((HEADS, 1, D + 1), np.float32))
    row = to_device(np.ones((HEADS, 1, D), np.float32))

    def spoil(step):
        if step % 10 == 5:
            with pytest.raises(flashport.ShapeError):
                flashport.attention(bad, row, row, device="gpu")

    got = run_chain(arrays, device=True, on_step=spoil)
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        for g, w in zip(a, b, strict=True):
            assert g.tobytes() == w.tobytes(), f"step {step}"

    cache = flashport.KVCache(8, 4, HEADS, D, device="gpu")
    sid = cache.new_sequence()
    rows = [to_device(np.full((HEADS, 1, D), i + 1, np.float32)) for i in range(4)]
    for r in rows[:3]:
        cache.append(sid, r, r)
    with pytest.raises(flashport.ShapeError):
        cache.append(sid, bad, bad)
    with pytest.raises(flashport.UnknownSequenceError):
        cache.append(sid + 1, rows[3], rows[3])
    cache.append(sid, rows[3], rows[3])
    flashport.synchronize()
    assert cache.length(sid) == 4
    keys, _ = cache.read_layer(0)
    block = cache.block_table([sid])[0, 0]
    for j in range(4):
        assert np.array_equal(keys[block][:, j], np.full((HEADS, D), j + 1, np.float32)), j
