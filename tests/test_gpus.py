"""Every GPU in the machine: devices by index (``device="gpu:N"``), each GPU's
own context, DeviceArrays that remember their GPU, copies between GPUs, a KV
cache on any GPU, two GPUs from two threads, and a GPU lost while another
carries on.

Here, with one software adapter, two GPUs are two logical devices of
lavapipe: the development build's ``FLASHPORT_TEST_GPU_COPIES=2`` lists
every adapter twice, and ``gpu:1`` opens a Vulkan device of its own on the
same physical device (its own queue, pools and pipelines). On a machine
with two real GPUs the tests use them as they are. The adapters' order
itself is unit-tested in Rust (``gpu/adapters.rs``) on made-up adapters."""

from __future__ import annotations

import re
import threading

import flashport
import numpy as np
import pytest
from conftest import gpu_adapters
from flashport import (
    BackendUnavailableError,
    GpuError,
    InvalidArgumentError,
    _core,
    to_device,
)

COPIES = "FLASHPORT_TEST_GPU_COPIES"


def _bits(x) -> bytes:
    return np.asarray(x).tobytes()


@pytest.fixture
def two_gpus(gpu, monkeypatch) -> tuple[str, str]:
    """``("gpu:0", "gpu:1")``: real GPUs where there are two, else two
    logical devices of the one adapter (the development build's hook)."""
    if len(gpu_adapters()) < 2:
        if not hasattr(_core, "_testing_open_gpus"):
            pytest.skip("one GPU adapter, and this build has no test hook to list it twice")
        monkeypatch.setenv(COPIES, "2")
    listed = [d["device"] for d in gpu_adapters()]
    assert listed[:2] == ["gpu:0", "gpu:1"], listed
    return "gpu:0", "gpu:1"


def _problem(seed=0, dtype=np.float32, seq=40, heads=2, d=16):
    rng = np.random.default_rng(seed)
    q, k, v, do = (rng.standard_normal((1, heads, seq, d)).astype(dtype) for _ in range(4))
    return q, k, v, do


# ------------------------------------------------------------ naming


def test_devices_are_numbered_in_order(gpu):
    listed = gpu_adapters()
    assert [d["index"] for d in listed] == list(range(len(listed)))
    for d in listed:
        assert d["device"] == f"gpu:{d['index']}"
        assert isinstance(d["pci_bus_id"], str)
    # Hardware before software adapters, as "gpu" has always chosen.
    kinds = [d["type"] == "software" for d in listed]
    assert kinds == sorted(kinds)


def test_the_copies_hook_lists_each_adapter_again(gpu, monkeypatch):
    if not hasattr(_core, "_testing_open_gpus"):
        pytest.skip("a development build's hook")
    real = gpu_adapters()
    monkeypatch.setenv(COPIES, "3")
    copies = gpu_adapters()
    assert [d["device"] for d in copies] == [f"gpu:{i}" for i in range(3 * len(real))]
    assert [d["name"] for d in copies] == [d["name"] for d in real] * 3


@pytest.mark.parametrize("name", ["gpu:7", "gpu:-1", "gpu:x", "gpu:", "gpu:1.0", "GPU: 1"])
def test_an_index_that_names_no_gpu_is_refused_with_the_devices_there_are(gpu, name):
    count = len(gpu_adapters())
    bad = name if name != "gpu:7" else f"gpu:{count + 6}"
    x = _problem()[0]
    calls = {
        "attention": lambda: flashport.attention(x, x, x, device=bad),
        "attention_backward": lambda: flashport.attention_backward(
            x, x, x, x, x, np.zeros(x.shape[:-1], np.float32), device=bad
        ),
        "merge_states": lambda: flashport.merge_states([x], [x[..., 0]], device=bad),
        "to_device": lambda: to_device(x, bad),
        "DeviceArray.to": lambda: to_device(x).to(bad),
        "KVCache": lambda: flashport.KVCache(4, 4, 1, 8, device=bad),
        "synchronize": lambda: flashport.synchronize(bad),
    }
    for what, call in calls.items():
        with pytest.raises(InvalidArgumentError) as info:
            call()
        message = str(info.value)
        assert message.startswith(f"device={bad!r}".replace("'", '"')), (what, message)
        assert "gpu:0 (" in message and "cpu" in message, (what, message)


def test_an_invalid_flashport_device_is_named(gpu, monkeypatch):
    x = _problem()[0]
    monkeypatch.setenv("FLASHPORT_DEVICE", "gpu:99")
    for call in (
        lambda: flashport.attention(x, x, x),
        # "gpu" means the GPU FLASHPORT_DEVICE names: it is read there too.
        lambda: flashport.attention(x, x, x, device="gpu"),
        lambda: to_device(x),
    ):
        with pytest.raises(InvalidArgumentError, match=r'^FLASHPORT_DEVICE="gpu:99": no such GPU'):
            call()
    # An explicit index or the CPU does not read it.
    assert flashport.attention(x, x, x, device="cpu").shape == x.shape
    assert to_device(x, "gpu:0").device == "gpu:0"


def test_to_device_on_the_cpu_is_refused(gpu):
    with pytest.raises(InvalidArgumentError, match=r'^device="cpu": a DeviceArray lives on a GPU'):
        to_device(_problem()[0], "cpu")


def test_no_adapter_makes_an_index_a_backend_error(tmp_path):
    """Where the Vulkan loader finds no driver, "gpu:0" is as unavailable
    as "gpu" (in a subprocess: the adapters are listed once per process)."""
    import os
    import subprocess
    import sys

    code = (
        "import flashport, numpy as np\n"
        "x = np.ones((4, 8), np.float32)\n"
        "try:\n"
        "    flashport.attention(x, x, x, device='gpu:0')\n"
        "except flashport.BackendUnavailableError as e:\n"
        "    print('refused:', e)\n"
    )
    env = dict(os.environ, VK_ICD_FILENAMES=str(tmp_path / "none.json"))
    env["VK_DRIVER_FILES"] = env["VK_ICD_FILENAMES"]
    env.pop("FLASHPORT_TEST_GPU_COPIES", None)
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert 'refused: device="gpu:0": no GPU adapter found' in out.stdout, out.stdout + out.stderr
    assert issubclass(BackendUnavailableError, RuntimeError)


# ------------------------------------------------------- two GPUs


def _forward_backward(device, q, k, v, do, **kw):
    o, lse = flashport.attention(q, k, v, return_lse=True, device=device, **kw)
    grads = flashport.attention_backward(do, q, k, v, o, lse, device=device, **kw)
    return [o, lse, *grads]


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_every_call_on_gpu_1_gives_gpu_0s_bits(two_gpus, dtype):
    q, k, v, do = _problem(seed=1, dtype=dtype)
    kw = {"causal": True, "window": (9, None), "softcap": 5.0}
    on0, on1 = (_forward_backward(g, q, k, v, do, **kw) for g in two_gpus)
    for a, b in zip(on0, on1, strict=True):
        assert _bits(a) == _bits(b)
        assert np.isfinite(np.asarray(a, np.float32)).all()
    # Against the CPU and the float64 oracle: gpu:1 computed, not copied.
    ref = flashport.reference.attention(q, k, v, **kw)
    atol = 2e-3 if dtype == np.float16 else 2e-6
    np.testing.assert_allclose(on1[0].astype(np.float64), ref, atol=atol)
    # The other entry points.
    lens = np.array([40], np.int32)
    kv0, kv1 = (
        flashport.attention_with_kvcache(q[:, :, -1:], k, v, lens, device=g) for g in two_gpus
    )
    assert _bits(kv0) == _bits(kv1)
    cu = np.array([0, 15, 40], np.int32)
    packed = [np.ascontiguousarray(x[0].transpose(1, 0, 2)) for x in (q, k, v)]
    vl0, vl1 = (
        flashport.attention_varlen(*packed, cu, cu, causal=True, device=g) for g in two_gpus
    )
    assert _bits(vl0) == _bits(vl1)
    parts = [on0[0], on0[0]], [on0[1], on0[1] - 1]
    m0, m1 = (flashport.merge_states(*parts, device=g) for g in two_gpus)
    assert all(_bits(a) == _bits(b) for a, b in zip(m0, m1, strict=True))


def test_device_arrays_remember_their_gpu_and_results_stay_there(two_gpus):
    g1 = two_gpus[1]
    q, k, v, do = _problem(seed=2)
    arrays = {g: [to_device(x, g) for x in (q, k, v, do)] for g in two_gpus}
    for g, (tq, tk, tv, tdo) in arrays.items():
        assert tq.device == g and g in repr(tq)
        assert tq.adapter == gpu_adapters()[int(g[4:])]["name"]
        results = _forward_backward(None, tq, tk, tv, tdo, causal=True)
        assert [r.device for r in results] == [g] * 5
        # "gpu" and "auto" mean the arrays' GPU, whatever the default is.
        for device in ("gpu", "auto", g):
            again = flashport.attention(tq, tk, tv, causal=True, device=device)
            assert again.device == g and _bits(again) == _bits(results[0])
        assert tq.copy().device == g
    want = _forward_backward("gpu:0", q, k, v, do, causal=True)
    for g in two_gpus:
        got = _forward_backward(None, *arrays[g], causal=True)
        assert all(_bits(a) == _bits(b) for a, b in zip(got, want, strict=True)), g
    flashport.synchronize(g1)
    flashport.synchronize()


def test_mixing_two_gpus_names_both_arguments_and_devices(two_gpus):
    g0, g1 = two_gpus
    q, k, v, do = _problem(seed=3)
    q0, k0, v0 = (to_device(x, g0) for x in (q, k, v))
    k1 = to_device(k, g1)
    with pytest.raises(InvalidArgumentError) as info:
        flashport.attention(q0, k1, v0)
    assert str(info.value).startswith("k=a device array on gpu:1: q is on gpu:0 and k on gpu:1")
    assert 'k.to("gpu:0")' in str(info.value)
    with pytest.raises(InvalidArgumentError, match=r"^v=a device array on gpu:0: q is on gpu:1"):
        flashport.attention(to_device(q, g1), k1, v0)
    wrong = r'^device="gpu:1": q is a device array on gpu:0'
    with pytest.raises(InvalidArgumentError, match=wrong):
        flashport.attention(q0, k0, v0, device=g1)
    o, lse = flashport.attention(q0, k0, v0, return_lse=True)
    mixed = r"^q=a device array on gpu:0: do is on gpu:1 and q on gpu:0"
    with pytest.raises(InvalidArgumentError, match=mixed):
        flashport.attention_backward(to_device(do, g1), q0, k0, v0, o, lse)
    with pytest.raises(InvalidArgumentError, match=r"gpu:0.*gpu:1"):
        flashport.merge_states([o, o.to(g1)], [lse, lse])
    on_cpu = r'^device="cpu": q is a device array \(it lives on gpu:0\)'
    with pytest.raises(InvalidArgumentError, match=on_cpu):
        flashport.attention(q0, k0, v0, device="cpu")
    # Nothing was changed by the refusals: the arrays still compute.
    assert _bits(flashport.attention(q0, k0, v0)) == _bits(flashport.attention(q, k, v, device=g0))


def test_copies_between_gpus(two_gpus):
    g0, g1 = two_gpus
    x = _problem(seed=4, dtype=np.float16)[0]
    a = to_device(x, g0)
    b = a.to(g1)
    assert (a.device, b.device) == (g0, g1) and b.dtype == np.float16
    assert _bits(b) == _bits(x) == _bits(a)
    assert to_device(a, g1).device == g1 and _bits(to_device(a, g1)) == _bits(x)
    # Already there: the same array (immutable, so sharing is safe).
    assert a.to(g0) is a and to_device(a) is a and to_device(a, g0) is a
    assert b.to("gpu").device == "gpu:0"
    with pytest.raises(InvalidArgumentError, match="DeviceArray lives on a GPU"):
        a.to("cpu")
    assert a.device == g0 and _bits(a) == _bits(x)


def test_a_kv_cache_on_gpu_1(two_gpus):
    g0, g1 = two_gpus
    rng = np.random.default_rng(5)
    k, v = (rng.standard_normal((2, 20, 8)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((1, 4, 3, 8)).astype(np.float32)
    outs = {}
    for g in (g0, g1):
        cache = flashport.KVCache(12, 4, 2, 8, device=g, swap_blocks=6)
        assert cache.device == g and g in repr(cache)
        sid = cache.new_sequence()
        cache.append(sid, k[:, :12], v[:, :12])
        cache.append(sid, to_device(k[:, 12:], g), to_device(v[:, 12:], g))
        beam = cache.fork(sid)
        cache.swap_out([beam])
        cache.swap_in([beam])
        outs[g] = [cache.attention(q, [s]) for s in (sid, beam)]
        on_device = cache.attention(to_device(q, g), [sid])
        assert on_device.device == g and _bits(on_device) == _bits(outs[g][0])
        other = g1 if g == g0 else g0
        elsewhere = rf"^q=a device array on {other}: this KV cache's pools are on {g}"
        with pytest.raises(InvalidArgumentError, match=elsewhere):
            cache.attention(to_device(q, other), [sid])
        with pytest.raises(InvalidArgumentError, match=rf"^k=a device array on {other}"):
            cache.append(sid, to_device(k[:, :1], other), v[:, :1])
        assert cache.length(sid) == 20
    assert all(_bits(a) == _bits(b) for a, b in zip(outs[g0], outs[g1], strict=True))
    want = flashport.attention(q, k[None], v[None], causal=True, device="cpu")
    np.testing.assert_allclose(outs[g1][0], want, rtol=1e-5, atol=1e-6)


def test_flashport_device_picks_the_default_gpu(two_gpus, monkeypatch):
    g0, g1 = two_gpus
    monkeypatch.setenv("FLASHPORT_DEVICE", g1)
    x = _problem(seed=6)[0]
    assert to_device(x).device == g1
    assert to_device(x, "gpu").device == g1 and to_device(x, "auto").device == g1
    assert to_device(x, g0).device == g0
    assert flashport.KVCache(4, 4, 2, 16).device == g1
    assert flashport.KVCache(4, 4, 2, 16, device="gpu").device == g1
    assert _bits(flashport.attention(x, x, x)) == _bits(flashport.attention(x, x, x, device=g0))
    # Device arrays still compute where they are.
    assert flashport.attention(*(to_device(x, g0),) * 3).device == g0


def test_two_threads_on_two_gpus_give_the_same_bits(two_gpus):
    q, k, v, do = _problem(seed=7, seq=96, heads=4, d=32)
    want = _forward_backward("gpu:0", q, k, v, do, causal=True)
    got: dict[str, list] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def run(device):
        try:
            start.wait()
            got[device] = [_forward_backward(device, q, k, v, do, causal=True) for _ in range(3)]
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(g,)) for g in two_gpus]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for g in two_gpus:
        for results in got[g]:
            assert all(_bits(a) == _bits(b) for a, b in zip(results, want, strict=True)), g


def test_a_gpu_lost_leaves_the_other_working(two_gpus):
    g0, g1 = two_gpus
    q, k, v, _ = _problem(seed=8)
    a0, a1 = (to_device(q, g) for g in two_gpus)
    want = flashport.attention(q, k, v, device=g0)
    flashport.attention(a1, k, v)
    queued = flashport.attention(a1, to_device(k, g1), to_device(v, g1))  # not waited for
    _core._testing_lose_device(1)
    # Waiting on gpu:1 finds it lost and drops its context, and only its.
    with pytest.raises(GpuError, match=r"gpu:1 .* was lost"):
        flashport.synchronize(g1)
    with pytest.raises(GpuError, match="lost"):
        queued.numpy()
    with pytest.raises(GpuError) as info:
        flashport.attention(a1, k, v)
    assert re.match(r"q is a device array on gpu:1 \(.*\), which was lost", str(info.value))
    with pytest.raises(GpuError, match="lost"):
        a1.numpy()
    with pytest.raises(GpuError, match="lost"):
        a1.to(g0)
    # gpu:0 and its arrays never noticed.
    assert _bits(flashport.attention(a0, k, v)) == _bits(want)
    assert _bits(a0) == _bits(q)
    flashport.synchronize(g0)
    # The next call on gpu:1 opens it again.
    assert _bits(flashport.attention(q, k, v, device=g1)) == _bits(want)
    assert to_device(q, g1).device == g1
