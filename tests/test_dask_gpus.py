"""flashport.dask across GPUs: ``gpu_cluster()`` makes one worker process per
GPU (``FLASHPORT_DEVICE=gpu:N`` in each one's environment), each worker's
blocks run on its own GPU, and the results are the single-GPU run's bits.

Here the two GPUs are two logical devices of lavapipe (the development
build's ``FLASHPORT_TEST_GPU_COPIES=2``, inherited by the workers), as in
tests/test_gpus.py."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest

da = pytest.importorskip("dask.array")
distributed = pytest.importorskip("distributed")

import dask  # noqa: E402
import flashport  # noqa: E402
import flashport.dask as fpd  # noqa: E402
from conftest import gpu_adapters  # noqa: E402
from flashport import InvalidArgumentError, _core  # noqa: E402
from flashport.dask import _tasks  # noqa: E402
from flashport.dask._cluster import gpu_names  # noqa: E402

COPIES = "FLASHPORT_TEST_GPU_COPIES"


@pytest.fixture(scope="module")
def two_gpus():
    """Two GPUs for this module (and its workers, which inherit the
    environment): real ones where there are two, else two logical devices."""
    if not gpu_adapters():
        if os.environ.get("FLASHPORT_REQUIRE_GPU") == "1":
            pytest.fail("FLASHPORT_REQUIRE_GPU=1 but flashport.devices() lists no GPU adapter")
        pytest.skip("no GPU adapter (install lavapipe)")
    with pytest.MonkeyPatch.context() as mp:
        if len(gpu_adapters()) < 2:
            if not hasattr(_core, "_testing_open_gpus"):
                pytest.skip("one GPU adapter, and this build has no test hook to list it twice")
            mp.setenv(COPIES, "2")
        yield ["gpu:0", "gpu:1"]


@pytest.fixture(scope="module")
def client(two_gpus):
    cluster = fpd.gpu_cluster(two_gpus, host="127.0.0.1", dashboard_address=None)
    with distributed.Client(cluster, set_as_default=False) as c:
        yield c
    cluster.close()


def _problem(dtype, seq=512, chunk=128, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v, do = (rng.standard_normal((1, 2, seq, 16)).astype(dtype) for _ in range(4))
    return (q, k, v, do), [da.from_array(x, chunks=(1, 2, chunk, 16)) for x in (q, k, v, do)]


def _graph(arrays, device, **kw):
    q, k, v, do = arrays
    o, lse = fpd.attention(q, k, v, return_lse=True, device=device, **kw)
    return [o, lse, *fpd.attention_backward(do, q, k, v, o, lse, device=device, **kw)]


@pytest.mark.parametrize(
    "dtype, options",
    [
        (np.float32, {"causal": True}),
        (np.float16, {"causal": True, "zigzag": True, "schedule": "ring"}),
    ],
    ids=["float32-tree", "float16-zigzag-ring"],
)
def test_each_worker_computes_on_its_gpu_and_gets_one_gpus_bits(client, two_gpus, dtype, options):
    (q, k, v, _), arrays = _problem(dtype)
    if options.get("zigzag"):
        arrays = [fpd.zigzag(x, 4) for x in arrays]
    # The workers know their GPUs, by name.
    assert sorted(client.run(lambda: os.environ["FLASHPORT_DEVICE"]).values()) == two_gpus
    got = client.compute(_graph(arrays, None, **options), sync=True)
    # Each worker opened its own GPU, and only that one: every block ran
    # on the GPU of the worker that ran it (and both workers ran blocks).
    assert _opened_by_worker(client) == {"gpu:0": [0], "gpu:1": [1]}
    # The blocks computed on arrays the workers uploaded (Resident chunks),
    # both workers.
    uploads = client.run(lambda: _tasks.TRANSFERS["upload"])
    assert len(uploads) == 2 and all(n > 0 for n in uploads.values())
    # The single-GPU run of the same graph (one process, threads, gpu:0):
    # the same plan on the same kind of device, so the same bits.
    want = dask.compute(*_graph(arrays, "gpu:0", **options), scheduler="threads")
    for name, g, w in zip(["o", "lse", "dq", "dk", "dv"], got, want, strict=True):
        assert g.dtype == w.dtype and g.tobytes() == w.tobytes(), name
        assert np.isfinite(g).all(), name
    # And exact attention: the float64 oracle on sampled rows.
    o = fpd.unzigzag(da.from_array(got[0]), 4).compute() if options.get("zigzag") else got[0]
    rows = np.array([0, 1, 127, 128, 300, 511])
    ref = flashport.reference.attention(q, k, v, causal=True)
    tol = 2e-3 if dtype == np.float16 else 2e-6
    np.testing.assert_allclose(o[..., rows, :].astype(np.float64), ref[..., rows, :], atol=tol)


def _opened_by_worker(client) -> dict[str, list[int]]:
    """The GPUs each worker (by name) has opened a context on."""
    names = {a: w["name"] for a, w in client.scheduler_info()["workers"].items()}
    return {names[a]: gpus for a, gpus in client.run(_core._testing_open_gpus).items()}


def test_gpu_means_the_workers_own_gpu(client, two_gpus):
    _, arrays = _problem(np.float32, seq=256, chunk=64, seed=1)
    got = client.compute(_graph(arrays, "gpu", causal=True), sync=True)
    want = dask.compute(*_graph(arrays, "gpu:1", causal=True), scheduler="threads")
    assert all(g.tobytes() == w.tobytes() for g, w in zip(got, want, strict=True))
    # "gpu" on worker gpu:1 is gpu:1 ($FLASHPORT_DEVICE), not the best GPU.
    assert _opened_by_worker(client) == {"gpu:0": [0], "gpu:1": [1]}


def test_the_gpus_a_cluster_gets(two_gpus):
    assert gpu_names() == two_gpus
    assert gpu_names(1) == ["gpu:0"]
    assert gpu_names([1, "gpu:0"]) == ["gpu:1", "gpu:0"]
    assert gpu_names("gpu:1") == ["gpu:1"]
    for bad, message in [
        (0, r"^devices=0: expected 1 to 2 GPUs \(this machine has gpu:0, gpu:1"),
        (3, r"^devices=3: expected 1 to 2 GPUs"),
        (["gpu:7"], r"^devices: 'gpu:7' is no GPU of this machine \(it has gpu:0, gpu:1"),
        ([0, "gpu:0"], r"^devices: gpu:0 is named twice"),
        ([], r"^devices: no GPU named"),
        (True, r"^devices=True: expected None"),
    ]:
        with pytest.raises(InvalidArgumentError, match=message):
            gpu_names(bad)


def test_a_cluster_of_threads_is_refused(two_gpus):
    with pytest.raises(InvalidArgumentError, match=r"^processes=False"):
        fpd.gpu_cluster(processes=False)
    with pytest.raises(InvalidArgumentError, match=r"^n_workers: gpu_cluster makes one"):
        fpd.gpu_cluster(n_workers=3)


def test_an_indexed_device_is_checked_for_form_when_the_graph_is_built(two_gpus):
    _, (q, k, v, _) = _problem(np.float32, seq=64, chunk=32)
    assert fpd.attention(q, k, v, device="gpu:5").shape == q.shape  # the workers' to resolve
    for bad in ["gpu:-1", "gpu:x", "cuda:0", 1]:
        with pytest.raises(InvalidArgumentError, match=r'expected "cpu", "gpu", "gpu:N"'):
            fpd.attention(q, k, v, device=bad)


def _counted(arrays, **kw) -> dict[str, int]:
    """The host<->GPU crossings of the graph's tasks on the threaded
    scheduler, device gpu:0."""
    _tasks.TRANSFERS.clear()
    dask.compute(*_graph(arrays, "gpu:0", **kw), scheduler="threads")
    return dict(_tasks.TRANSFERS)


def test_a_gpu_graph_uploads_each_chunk_once(two_gpus):
    """The benchmark's graph (causal, 4 chunks: 10 blocks): each of q, k, v
    and do crosses to the GPU once per chunk, o and lse never (the backward
    reads the forward's states there), and what comes back is the outputs
    and the 30 gradient shares (summed on the host). Before, every block
    uploaded its chunks and read its state back: 80 chunks up, 40 down."""
    seq, chunk, heads, dim = 512, 128, 2, 16
    _, arrays = _problem(np.float16, seq=seq, chunk=chunk)
    got = _counted(arrays, causal=True)
    c = heads * chunk * dim * 2  # one float16 chunk, in bytes
    lse = heads * chunk * 4
    assert got == {
        "upload": 16,
        "upload_bytes": 16 * c,
        "download": 4 + 4 + 30,
        "download_bytes": 4 * c + 4 * lse + 30 * c,
    }
    # With o and lse persisted (the forward's states gone), each of their
    # chunks is uploaded once more.
    qa, ka, va, doa = arrays
    o, lse_ = dask.persist(
        *fpd.attention(qa, ka, va, causal=True, return_lse=True, device="gpu:0"),
        scheduler="threads",
    )
    _tasks.TRANSFERS.clear()
    grads = fpd.attention_backward(doa, qa, ka, va, o, lse_, causal=True, device="gpu:0")
    dask.compute(*grads, scheduler="threads")
    assert _tasks.TRANSFERS["upload"] == 24 and _tasks.TRANSFERS["download"] == 30


@pytest.mark.parametrize(
    "options",
    [
        {"causal": True, "sinks": np.array([0.5, -1.0])},
        {"window": (40, 10), "softcap": 20.0},
        {"causal": True, "zigzag": True},
        {"causal": True, "zigzag": True, "schedule": "ring", "alibi_slopes": [0.5, 0.25]},
    ],
    ids=["sinks", "window-softcap", "zigzag-tree", "zigzag-ring-alibi"],
)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_gpu_graphs_compute_exact_attention(two_gpus, dtype, options):
    """The tasks' GPU path (Resident chunks, merges on the GPU) for the
    variants and the zig-zag pieces: flashport's results to rounding."""
    (q, k, v, do), arrays = _problem(dtype, seed=3)
    if options.get("zigzag"):
        arrays = [fpd.zigzag(x, 4) for x in arrays]
    _tasks.TRANSFERS.clear()
    got = dask.compute(*_graph(arrays, "gpu:0", **options), scheduler="threads")
    if options.get("zigzag"):
        axes = [-2, -1, -2, -2, -2]
        got = [
            fpd.unzigzag(da.from_array(g), 4, axis=a).compute()
            for g, a in zip(got, axes, strict=True)
        ]
    assert _tasks.TRANSFERS["upload"] > 0
    kw = {key: val for key, val in options.items() if key not in ("zigzag", "schedule")}
    o, lse = flashport.attention(q, k, v, return_lse=True, device="cpu", **kw)
    want = [o, lse, *flashport.attention_backward(do, q, k, v, o, lse, device="cpu", **kw)]
    tol = 4e-3 if dtype == np.float16 else 2e-5
    names = ["o", "lse", "dq", "dk", "dv", "dsinks"][: len(want)]
    for name, g, w in zip(names, got, want, strict=True):
        assert g.dtype == w.dtype, name
        scale = max(float(np.abs(w.astype(np.float64)).max()), 1.0)
        assert float(np.abs(g.astype(np.float64) - w).max()) <= tol * scale, name


def test_resident_chunks_cross_processes_as_numpy(two_gpus):
    """A DeviceArray does not pickle; a Resident (what Dask moves between
    workers) pickles as its values, read back, and a task on another GPU
    uploads it there."""
    x = np.arange(24, dtype=np.float16).reshape(1, 2, 3, 4)
    on0 = flashport.to_device(x, "gpu:0")
    with pytest.raises(TypeError, match="pickle"):
        pickle.dumps(on0)
    _tasks.TRANSFERS.clear()
    moved = pickle.loads(pickle.dumps(_tasks.Resident([on0, on0])))
    assert all(type(p) is np.ndarray and p.tobytes() == x.tobytes() for p in moved.parts)
    assert _tasks.TRANSFERS["download"] == 2
    on1 = moved.on("gpu:1")
    assert [p.device for p in on1] == ["gpu:1", "gpu:1"]
    assert on1[0].numpy().tobytes() == x.tobytes()
    assert _tasks.Resident([on0]).on("gpu:0")[0] is on0  # already there: no copy
