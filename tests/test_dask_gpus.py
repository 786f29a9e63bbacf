"""flashport.dask across GPUs: ``gpu_cluster()`` makes one worker process per
GPU (``FLASHPORT_DEVICE=gpu:N`` in each one's environment), each worker's
blocks run on its own GPU, and the results are the single-GPU run's bits.

Here the two GPUs are two logical devices of lavapipe (the development
build's ``FLASHPORT_TEST_GPU_COPIES=2``, inherited by the workers), as in
tests/test_gpus.py."""

from __future__ import annotations

import os

import numpy as np
import pytest

da = pytest.importorskip("dask.array")
distributed = pytest.importorskip("distributed")

import dask  # noqa: E402
import flashport  # noqa: E402
import flashport.dask as fpd  # noqa: E402
from conftest import gpu_adapters  # noqa: E402
from flashport import InvalidArgumentError, _core  # noqa: E402
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
