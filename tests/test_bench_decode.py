"""The decode benchmark's own arithmetic (the timings are never asserted):
its paged caches hold the contiguous cache they are compared with, the
bytes it divides by are the K and V a decode reads, its copy references are
named and ordered (the vendor's first), its decode step computes what
torch's does and stays at the context, and its output has the structure the
tables are read from."""

from __future__ import annotations

import json
import math
import types

import numpy as np
import pytest
from flashport import reference
from flashport._bench import decode as _bench_decode


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("block_size", [1, 16, 256])
def test_paged_cache_gathers_back_to_the_contiguous_cache(block_size, batch):
    rng = np.random.default_rng(3)
    k = rng.standard_normal((batch, 2, 512, 4)).astype(np.float32)
    pool, table = _bench_decode.paged_cache(k, block_size)
    assert pool.shape == (batch * 512 // block_size, 2, block_size, 4)
    # As a cache manager allocates it (a strided pool is copied on each call).
    assert pool.flags.c_contiguous
    assert table.shape == (batch, 512 // block_size)
    # A permutation of the blocks, not the identity.
    assert sorted(table.ravel()) == list(range(pool.shape[0]))
    assert block_size == 256 or not np.array_equal(table.ravel(), np.arange(table.size))
    lens = np.full(batch, 512)
    for b in range(batch):
        keys, _ = reference.cached_sequence(pool, pool, lens, b, table)
        assert np.array_equal(keys, k[b])


def test_bytes_read_are_the_whole_caches():
    q, k, v = _bench_decode.make_arrays(2, 64, np.float16)
    assert q.shape == (2, 32, 1, 128) and k.shape == v.shape == (2, 8, 64, 128)
    assert q.dtype == k.dtype == np.float16
    assert _bench_decode.cache_bytes(2, 64, np.float16) == k.nbytes + v.nbytes


# The benchmark end to end on tiny shapes: the structure of what it prints
# and writes, every number finite and positive (never how fast).
TINY = ["--shape", "1x64", "--dtype", "float32", "--repeat", "1", "--copy-mib", "1"]
TINY_STEP = ["--layers", "2", "--step-shape", "2x32"]


def _run(tmp_path, capsys, *argv):
    out = tmp_path / "decode.json"
    assert _bench_decode.main([*argv, "--warm", "0", "--json", str(out)]) == 0
    return json.loads(out.read_text()), capsys.readouterr().out


def _positive(x) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x > 0


def _torch_here(device: str) -> bool:
    return _bench_decode._torch(device) is not None


def test_table_and_step_on_tiny_shapes(backend, tmp_path, capsys):
    result, printed = _run(
        tmp_path,
        capsys,
        *TINY,
        *TINY_STEP,
        "--device",
        backend,
        "--paged",
        "16",
        "--section",
        "table",
        "--section",
        "step",
    )
    torch_here = _torch_here(backend)
    # The copy "of copy" is against is named, in the output and the JSON.
    names = [c["name"] for c in result["copies"]]
    if backend == "cpu":
        assert names == [_bench_decode.NUMPY_COPY]
    else:
        # The vendor's copy first where torch has CUDA, wgpu's in any case.
        assert names[-1] == _bench_decode.WGPU_COPY
        assert names[0] == (_bench_decode.TORCH_COPY if torch_here else _bench_decode.WGPU_COPY)
    assert result["copy_reference"] == names[0]
    assert f'"of copy" against {names[0]}' in printed
    assert all(_positive(c["bandwidth"]) and c["nbytes"] == 1 << 20 for c in result["copies"])

    rows = result["shapes"]
    assert [(r["layout"], r["block_size"]) for r in rows] == [
        ("paged 16", 16),
        ("contiguous", None),
    ]
    for r in rows:
        assert (r["dtype"], r["batch"], r["context"]) == ("float32", 1, 64)
        assert r["copy_reference"] == names[0]
        assert _positive(r["seconds"]) and _positive(r["bandwidth"])
        assert r["fraction_of_copy"] == pytest.approx(r["bandwidth"] / result["copy_bandwidth"])
        assert _positive(r["torch_seconds"]) == torch_here
    # The NumPy round trip (GPU) is timed on the contiguous cache only.
    assert rows[0]["numpy_seconds"] is None
    assert _positive(rows[1]["numpy_seconds"]) == (backend == "gpu")
    assert "paged 16" in printed and "contiguous" in printed

    (step,) = result["step"]
    assert (step["batch"], step["context"], step["layers"]) == (2, 32, 2)
    assert _positive(step["seconds"]) and _positive(step["fraction_of_copy"])
    assert step["kv_bytes"] == 2 * _bench_decode.cache_bytes(2, 32, np.float32)
    if torch_here:
        assert _positive(step["torch_seconds"])
        assert step["flashport_over_torch"] == pytest.approx(
            step["seconds"] / step["torch_seconds"]
        )
    else:
        assert step["torch_seconds"] is None and step["flashport_over_torch"] is None
    assert "flashport/torch" in printed


def test_a_vendor_copy_reference_keeps_wgpu_as_a_second_column(tmp_path, capsys, monkeypatch):
    """What an H100 run with torch on CUDA prints, on the CPU: "of copy"
    against the vendor's copy, "of wgpu" beside it."""
    refs = [
        _bench_decode.CopyReference(_bench_decode.TORCH_COPY, 1 << 20, 3.0e12),
        _bench_decode.CopyReference(_bench_decode.WGPU_COPY, 1 << 20, 0.8e12),
    ]
    monkeypatch.setattr(_bench_decode, "copy_references", lambda *a, **k: refs)
    result, printed = _run(tmp_path, capsys, *TINY, "--section", "table")
    assert result["copy_reference"] == _bench_decode.TORCH_COPY
    assert "of wgpu" in printed and _bench_decode.WGPU_COPY in printed
    (row,) = result["shapes"]  # the CPU's default: contiguous only
    assert row["layout"] == "contiguous"
    assert row["fraction_of_copy"] == pytest.approx(row["bandwidth"] / 3.0e12)
    assert row["fraction_of_wgpu_copy"] == pytest.approx(row["bandwidth"] / 0.8e12)


def test_copy_references_put_the_vendor_copy_first(monkeypatch):
    monkeypatch.setattr(_bench_decode, "torch_copy_bandwidth", lambda *a: 3.0e12)
    monkeypatch.setattr(_bench_decode, "copy_bandwidth", lambda device, *a: 1e9 * len(device))
    monkeypatch.setattr(_bench_decode, "_max_buffer_size", lambda: (1 << 30) + 5)
    gpu = _bench_decode.copy_references("gpu", 2 << 30, 1, 0.0, (object(), "cuda"))
    assert [(c.name, c.nbytes) for c in gpu] == [
        (_bench_decode.TORCH_COPY, 2 << 30),
        # One DeviceArray: at most one buffer, in whole MiB.
        (_bench_decode.WGPU_COPY, 1 << 30),
    ]
    assert [c.bandwidth for c in gpu] == [3.0e12, 3e9]
    for no_cuda in (None, (object(), "cpu")):
        (only,) = _bench_decode.copy_references("gpu", 1 << 20, 1, 0.0, no_cuda)
        assert only.name == _bench_decode.WGPU_COPY
    (cpu,) = _bench_decode.copy_references("cpu", 1 << 20, 1, 0.0, (object(), "cpu"))
    assert cpu.name == _bench_decode.NUMPY_COPY


class _FakeCuda:
    """Just enough of torch for torch_copy_bandwidth: every copy_ is logged,
    every event pair measures 2 ms."""

    float32 = "float32"

    def __init__(self):
        self.log: list[str] = []
        fake = self

        class Tensor:
            def copy_(self, other):
                fake.log.append("copy")

        class Event:
            def __init__(self, enable_timing=False):
                assert enable_timing

            def record(self):
                fake.log.append("record")

            def synchronize(self):
                fake.log.append("wait")

            def elapsed_time(self, end):
                return 2.0

        self.cuda = types.SimpleNamespace(
            Event=Event,
            synchronize=lambda: fake.log.append("sync"),
            empty_cache=lambda: fake.log.append("empty_cache"),
        )
        self._tensor = Tensor

    def ones(self, n, dtype, device):
        assert device == "cuda" and dtype == "float32"
        return self._tensor()

    def empty_like(self, x):
        return self._tensor()


def test_the_cuda_copy_is_timed_by_events_around_each_copy():
    torch = _FakeCuda()
    bw = _bench_decode.torch_copy_bandwidth(torch, 1 << 30, repeat=3, warm=0.0)
    # Read + written, over the events' 2 ms.
    assert bw == pytest.approx(2 * (1 << 30) / 2e-3)
    timed = torch.log[torch.log.index("record") :]
    assert timed == ["record", "copy", "record", "wait"] * 3 + ["empty_cache"]
    # An untimed warm-up copy first, waited for.
    assert torch.log[:2] == ["copy", "sync"]


@pytest.mark.parametrize("context", [32, 48])
def test_the_two_steps_compute_the_same_attention(backend, context):
    """flashport's step and torch's append the same row to the same keys and
    attend with the same query on every layer; both match the oracle."""
    layers, batch = 2, 2
    fp = _bench_decode.FlashportStep(batch, context, layers, np.float32, backend)
    fp.reset()
    got = fp.step()
    got = got.numpy() if backend == "gpu" else got
    q, k, v = _bench_decode.make_arrays(batch, context, np.float32)
    new_k, new_v = _bench_decode._new_rows(batch, np.float32)
    keys, values = np.concatenate([k, new_k], 2), np.concatenate([v, new_v], 2)
    want = reference.attention(q, keys, values)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)
    for layer in range(layers):
        assert all(fp.cache.length(s, layer=layer) == context + 1 for s in fp.seq_ids)
    torch = pytest.importorskip("torch")
    ts = _bench_decode.TorchStep((torch, "cpu"), batch, context, layers, np.float32)
    np.testing.assert_allclose(ts.step().numpy(), want, atol=2e-5, rtol=0)
    assert ts.length == context + 1


def test_steps_go_back_to_the_context_without_filling_the_cache(backend):
    fp = _bench_decode.FlashportStep(1, 16, 1, np.float16, backend)
    parents_blocks = fp.cache.num_used_blocks
    steps = []

    def step():
        fp.step()
        steps.append(fp.cache.length(fp.seq_ids[0]))

    # Three resets' worth: the cache holds the parents' blocks and one
    # fork's STEP_RESET positions, no more.
    seconds = _bench_decode.time_steps(step, fp.reset, repeat=3 * _bench_decode.STEP_RESET)
    assert _positive(seconds)
    assert min(steps) == 17 and max(steps) == 16 + _bench_decode.STEP_RESET
    fp.reset()
    assert fp.cache.length(fp.seq_ids[0]) == 16
    assert fp.cache.num_used_blocks == parents_blocks


def test_arguments():
    parse = _bench_decode.parse_args
    assert parse(["--device", "gpu"]).paged == _bench_decode.GPU_PAGED_BLOCK
    assert parse([]).paged == 0
    assert parse(["--device", "gpu", "--paged", "0"]).paged == 0
    assert parse(["--queued-only"]).section == ["queued"]
    assert "queued" not in parse([]).section and "step" in parse([]).section
    assert parse(["--device", "gpu"]).section == list(_bench_decode.SECTIONS)
    assert parse(["--shape", "8x32768"]).shape == [(8, 32768)]
    assert parse(["--quick"]).copy_mib == (_bench_decode.COPY_BYTES >> 20) // 4
    with pytest.raises(SystemExit):
        parse(["--step-shape", "1x100"])
    with pytest.raises(SystemExit):
        parse(["--shape", "8by4096"])


def test_the_paged_layout_needs_a_block_that_divides_the_context():
    assert _bench_decode._layouts(16, 64) == [16, 0]
    assert _bench_decode._layouts(16, 40) == [0]
    assert _bench_decode._layouts(0, 64) == [0]
