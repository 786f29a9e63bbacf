"""Calls that do not wait: a call whose arrays are all DeviceArrays returns
once its work is queued on the GPU. Queue order must keep every result
exact (the same bits as calls that wait), a GPU failure under queued work
must surface as GpuError and never as stale values, inputs may be dropped
while their calls are queued, and the queue is bounded. Decoding's calls,
held back in the host and submitted together, keep every one of those."""

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


def in_two_threads(work):
    """``work()``'s results from two threads started together; an exception
    in either fails the test."""
    got: list = [None, None]
    failures: list = []

    def run(i):
        try:
            got[i] = work()
        except BaseException as e:  # surfaced by the assertion below
            failures.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not failures, failures
    return got


def test_queued_calls_from_two_threads_give_the_bits_of_calls_that_wait(gpu):
    """Two threads queue dependent chains at once: the context's submitter
    takes both threads' calls as they come, and each chain still runs in
    its own order, with the bits of calls that wait."""
    arrays = chain_inputs()
    want = run_chain(arrays, device=False)
    for chain in in_two_threads(lambda: run_chain(arrays, device=True)):
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
    depths, held = [], []
    for _ in range(2 * MAX_PENDING):
        cache.append_batch([sid], rows, rows)
        depths.append(_core._testing_queued_submissions())
        held.append(_core._testing_held_calls())
    # Nothing goes to the queue until MAX_PENDING calls are held, then all
    # of them in one submission.
    steps = [*range(1, MAX_PENDING), 0]
    assert held == 2 * steps, (
        "a debug build poisons every output whatever FLASHPORT_GPU_POISON says, "
        "and each poisoning hands the held calls over: build with --release"
    )
    assert depths == [0] * (MAX_PENDING - 1) + [1] * MAX_PENDING + [2]
    # A call that is not held takes the held ones with it.
    cache.append_batch([sid], rows, rows)
    assert _core._testing_queued_submissions() == 2
    x.copy()
    assert _core._testing_queued_submissions() == 3
    assert _core._testing_held_calls() == 0
    # So does synchronize().
    cache.append_batch([sid], rows, rows)
    assert _core._testing_held_calls() == 1
    flashport.synchronize()
    assert _core._testing_queued_submissions() == 0
    assert _core._testing_held_calls() == 0
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


# Cache lengths of buffer sizes no other test uses, one each.
@pytest.mark.parametrize(("poison", "n"), [("0", 77), ("1", 93)])
def test_del_of_inputs_while_their_call_is_held_is_safe(gpu, monkeypatch, poison, n):
    """As test_del_of_inputs_while_their_call_is_queued_is_safe, with the
    call's commands still held when its caches go back to the pool: the
    calls that take them go to the queue in the same submission, after
    it. Poisoned, the next attention's output (the size of a cache, so
    one of them) is first filled with NaN by a queue write, which must
    hand the held call over before it."""
    monkeypatch.setenv("FLASHPORT_GPU_POISON", poison)
    rng = np.random.default_rng(6)
    q = rng.standard_normal((1, 4, 1, 24), dtype=np.float32)
    k, v = (rng.standard_normal((1, 2, n, 24), dtype=np.float32) for _ in range(2))
    lens = np.array([n], np.int32)
    want = flashport.attention_with_kvcache(q, k, v, lens, device="gpu")
    filled = np.full_like(k, 7.0)
    want_filled = flashport.attention(filled, filled, filled, device="gpu")
    # Every free buffer of the caches' size taken (by arrays of that size
    # kept to the end), so that the caches' are the only ones once freed.
    fills = [to_device(filled) for _ in range(64)]
    tq, tk, tv = (to_device(x) for x in (q, k, v))
    flashport.synchronize()
    out = flashport.attention_with_kvcache(tq, tk, tv, lens)
    assert _core._testing_held_calls() == 1, "the call is held"
    del tk, tv
    gc.collect()
    attended = [flashport.attention(f, f, f) for f in fills[:2]]
    copies = [f.copy() for f in fills[:4]]
    assert out.numpy().tobytes() == want.tobytes()
    for a in attended:
        assert a.numpy().tobytes() == want_filled.tobytes()
    for c in copies:
        assert np.array_equal(c.numpy(), filled)


def test_held_calls_from_two_threads_give_the_bits_of_calls_that_wait(gpu, unpoisoned):
    """Two threads' held calls share the context's held list: each thread's
    chain still runs in its own order, whichever thread's call hands the
    other's over."""
    arrays = chain_inputs()
    want = run_decode_chain(arrays, device=False)
    for chain in in_two_threads(lambda: run_decode_chain(arrays, device=True)):
        assert chain is not None and len(chain) == STEPS
        for step, (g, w) in enumerate(zip(chain, want, strict=True)):
            assert g.tobytes() == w.tobytes(), f"step {step}"


def held_appends(cache, sid, rows):
    """Appends each of ``rows`` to ``sid`` as a key and a value; checks that
    the calls were held (nothing submitted since the last synchronize)."""
    for r in rows:
        cache.append_batch([sid], r, r)
    assert _core._testing_held_calls() == len(rows), "the appends are held"


def test_a_numpy_call_after_held_calls_sees_their_work(gpu, unpoisoned):
    """A call with a NumPy argument waits for its own work, so for the held
    calls before it: they go to the GPU first, in one submission with it."""
    rng = np.random.default_rng(11)
    rows = [to_device(rng.standard_normal((1, HEADS, 1, D), dtype=np.float32)) for _ in range(5)]
    q = rng.standard_normal((1, 2 * HEADS, 1, D), dtype=np.float32)

    def decoded(hold: bool):
        cache = flashport.KVCache(8, 4, HEADS, D, device="gpu")
        sid = cache.new_sequence()
        flashport.synchronize()
        if hold:
            held_appends(cache, sid, rows)
        else:
            for r in rows:
                cache.append_batch([sid], r, r)
                flashport.synchronize()
        out = cache.attention(q, [sid])
        assert isinstance(out, np.ndarray) and waited()
        assert _core._testing_queued_submissions() == 0
        return out

    want = decoded(hold=False)
    assert np.isfinite(want).all()
    assert decoded(hold=True).tobytes() == want.tobytes()
    # A NumPy key and value of an append are uploaded and the append held;
    # a read of the pools (a wait) hands it over.
    cache = flashport.KVCache(8, 4, HEADS, D, device="gpu")
    sid = cache.new_sequence()
    flashport.synchronize()
    held_appends(cache, sid, rows[:2])
    host = rng.standard_normal((HEADS, 1, D), dtype=np.float32)
    cache.append(sid, host, host)
    assert _core._testing_held_calls() == 3, "the NumPy append is held too"
    keys, values = cache.read_layer(0)
    block = cache.block_table([sid])[0, 0]
    for pool in (keys, values):
        assert np.array_equal(pool[block][:, 2], host[:, 0])
        assert np.array_equal(
            pool[block][:, :2], np.concatenate([r.numpy()[0] for r in rows[:2]], 1)
        )


def cache_story(device: str, rows, host_rows, *, sync_each: bool = False):
    """Writes into a cache's pools by every path while appends may be held
    on the GPU: appends of DeviceArrays or NumPy rows, a fork's
    copy-on-write copy, a swap-out (a read) and a swap-in (a write that is
    not held); with ``sync_each`` a synchronize after each (nothing held).
    Returns the pools, the block tables, the lengths and a decode."""
    cache = flashport.KVCache(16, 4, HEADS, D, device=device, swap_blocks=8)
    a = cache.new_sequence()
    flashport.synchronize()
    on = (lambda r: r) if device == "gpu" else (lambda r: r.numpy())
    steps = [lambda r=r: cache.append_batch([a], on(r), on(r)) for r in rows[:6]]
    b = []
    steps += [
        lambda: b.append(cache.fork(a)),
        # Sequence b's last block is shared: the append copies it first.
        lambda: cache.append_batch([b[0]], on(rows[6]), on(rows[6])),
        lambda: cache.append(a, host_rows[0], host_rows[0]),
        lambda: cache.swap_out(b[0]),
        lambda: cache.append_batch([a], on(rows[7]), on(rows[7])),
        lambda: cache.swap_in(b[0]),
        lambda: cache.append_batch([b[0]], on(rows[8]), on(rows[8])),
        lambda: cache.append(b[0], host_rows[1], host_rows[1]),
    ]
    for step in steps:
        step()
        if sync_each:
            flashport.synchronize()
    ids = [a, b[0]]
    out = cache.attention(np.ones((2, 2 * HEADS, 1, D), np.float32), ids)
    return cache.read_layer(0), cache.block_table(ids), [cache.length(s) for s in ids], out


def test_writes_into_a_cache_by_other_paths_while_appends_are_held(gpu, unpoisoned):
    """Copy-on-write copies, swaps and NumPy appends between held appends:
    each sees the writes of the held calls before it and none after, as on
    the CPU and as with nothing held."""
    rng = np.random.default_rng(12)
    rows = [to_device(rng.standard_normal((1, HEADS, 1, D), dtype=np.float32)) for _ in range(9)]
    host_rows = [rng.standard_normal((HEADS, 1, D), dtype=np.float32) for _ in range(2)]
    (gk, gv), tables, lengths, held = cache_story("gpu", rows, host_rows)
    (ck, cv), cpu_tables, cpu_lengths, _ = cache_story("cpu", rows, host_rows)
    synced = cache_story("gpu", rows, host_rows, sync_each=True)
    assert lengths == cpu_lengths == [8, 9]
    assert np.array_equal(tables, cpu_tables)
    for b, length in enumerate(lengths):
        table = tables[b][: -(-length // 4)]
        for got, want in ((gk, ck), (gv, cv)):
            g = got[table].transpose(1, 0, 2, 3).reshape(HEADS, -1, D)[:, :length]
            w = want[table].transpose(1, 0, 2, 3).reshape(HEADS, -1, D)[:, :length]
            assert g.tobytes() == w.tobytes(), b
    for g, w in zip((gk, gv), synced[0], strict=True):
        assert g.tobytes() == w.tobytes()
    assert np.isfinite(held).all() and held.tobytes() == synced[3].tobytes()


def test_a_held_call_that_fails_raises_and_drops_the_calls_held_with_it(gpu, unpoisoned):
    """A held call whose commands wgpu refuses raises GpuError itself, as a
    call that is submitted at once does; its device is dropped, so the
    calls held before it never run and their results raise when read
    (never stale values). The next call opens a fresh device."""
    arrays = chain_inputs()
    lens = np.array([KV_LEN], np.int32)
    want = flashport.attention_with_kvcache(
        arrays["x"], arrays["kc"], arrays["vc"], lens, device="gpu"
    )
    a = {name: to_device(x) for name, x in arrays.items()}
    cache = flashport.KVCache(8, 4, HEADS, D, device="gpu")
    sid = cache.new_sequence()
    flashport.synchronize()
    cache.append_batch([sid], a["k4"], a["v4"])
    out = flashport.attention_with_kvcache(a["x"], a["kc"], a["vc"], lens)
    assert _core._testing_held_calls() == 2, "the calls are held"
    with pytest.raises(GpuError, match="held call that fails"):
        _core._testing_held_call_that_fails()
    with pytest.raises(GpuError, match="lost"):
        out.numpy()
    with pytest.raises(GpuError, match="gone"):
        cache.attention(arrays["x"], [sid])
    flashport.synchronize()
    again = flashport.attention_with_kvcache(
        arrays["x"], arrays["kc"], arrays["vc"], lens, device="gpu"
    )
    assert again.tobytes() == want.tobytes()
    flashport.synchronize()


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


def test_a_device_lost_under_held_calls_raises(gpu, unpoisoned):
    """Held calls whose device is lost before they are handed over: the
    hand-over at synchronize() fails quietly and synchronize raises, and
    their results and cache raise when used."""
    arrays = chain_inputs()
    a = {name: to_device(x) for name, x in arrays.items()}
    cache = flashport.KVCache(8, 4, HEADS, D, device="gpu")
    sid = cache.new_sequence()
    lens = np.array([KV_LEN], np.int32)
    flashport.synchronize()
    cache.append_batch([sid], a["k4"], a["v4"])
    x = cache.attention(a["x"], [sid])
    out = flashport.attention_with_kvcache(x, a["kc"], a["vc"], lens)
    assert _core._testing_held_calls() == 3, "the calls are held"
    _core._testing_lose_device()
    with pytest.raises(GpuError, match="lost"):
        flashport.synchronize()
    assert_lost_everywhere(a, cache, sid, [x, out])
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
