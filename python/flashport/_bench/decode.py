"""``python -m flashport bench decode``: attention_with_kvcache (one query row
per sequence against a KV cache), and a model's decode step through
``flashport.KVCache``, timed as their user waits for them.

Decode bandwidth is the bytes of K and V the call must read (each sequence's
cached keys and values, once) over the median wall time of the public call,
shown as a fraction ("of copy") of a copy bandwidth measured in the same
run. On the GPU that is the vendor's device-to-device copy where one is
available: a PyTorch CUDA ``copy_`` of 2 GiB (``--copy-mib``) timed with
CUDA events, the median after a second of copies, when torch with CUDA
imports; otherwise wgpu's, a copy from one DeviceArray to a new one
(``DeviceArray.copy``). The wgpu copy is measured and printed in every GPU
run, and beside the vendor's it gets a column of its own ("of wgpu"): on
an H100 wgpu's copy moves about a quarter of what the HBM delivers, so a
fraction of it flatters. On the CPU the reference is a NumPy copy of a
large array (NumPy copies on one thread). The header line names the copy
"of copy" is against. A copy's bandwidth counts the bytes read and the
bytes written (STREAM's and FlashInfer's convention), so both figures are
memory traffic.

On the CPU the call takes and returns NumPy arrays. On the GPU the queries
and the caches are DeviceArrays, as a serving loop keeps them, and the
outputs stay there; the "numpy ms" column times the call on the contiguous
cache with NumPy arrays in and out, which uploads the cache on every call.

Main table: 32 query heads over 8 key/value heads, d = 128, batch 1, 8 and
32, contexts 4k, 32k and 128k (those whose cache fits ``--max-cache-gib``;
``--shape`` picks others), float32 and float16. Each shape has a row per
cache layout, timed alternating in one block: with ``--paged B`` (16 by
default on the GPU; off by default on the CPU) a pool of blocks of ``B``
positions in a shuffled order read through its block table, as a cache
manager leaves them, and the contiguous cache ``(batch, heads, context,
d)``. Both are set against PyTorch's ``scaled_dot_product_attention`` with
``enable_gqa=True`` on the same keys in a contiguous cache, when torch
imports (CUDA tensors on the GPU); "vs torch" is torch's time over the
row's. Then split-KV (Flash-Decoding) at batch 1 against ``num_splits=1``,
and paged caches of block sizes 1, 16, 32, 128 and 256 against the
contiguous cache.

Decode step (``--section step``): the attention part of a model's decode
step of ``--layers`` layers (32), batch 8 and 1 at context 4096
(``--step-shape``): per layer, ``KVCache.append_batch`` of one new position
per sequence and ``KVCache.attention`` over the layer, on DeviceArrays
through one ``KVCache(..., layers=32, device="gpu")`` (block 16), then one
``flashport.synchronize()``. Beside it PyTorch does the same on CUDA: per
layer the new key and value written into a preallocated contiguous cache
tensor at the current length (an index), then SDPA with ``enable_gqa=True``
on the cache up to that length, then one ``torch.cuda.synchronize()``. On
the CPU both run on the CPU (NumPy arrays; torch when it imports). Every
``STEP_RESET`` steps both caches go back to the context (flashport's steps
run on forks of the prefilled sequences, freed and forked again; torch's
length goes back), so every step reads between context + 1 and context +
``STEP_RESET`` positions. "flashport/torch" is flashport's step over
torch's.

Timing: each time is a median of ``--repeat`` rounds after a warm-up; on
the GPU the calls run back to back after a second of them (``--warm``), the
DeviceArray calls of a row alternating in one block, torch's and the NumPy
round trip each in a block of their own (so are the two decode steps). A
call on DeviceArrays returns once its work is queued: each timed GPU call
(and step) ends with ``flashport.synchronize()``, so that its time is until
the results are there, as for torch's (``torch.cuda.synchronize()``).

Host time per queued call (GPU only): the host seconds of a float16 decode
call on DeviceArrays that does not wait (batch 1, context 4096, the
contiguous cache and a ``KVCache``), over 1,000 calls back to back and then
one ``synchronize``; "submit" is the part spent finishing the call's
commands and handing them to the driver (the context holds decoding's
calls back and submits several at once, so this is their mean; lavapipe
runs the previous submission there, so on a software adapter this is
the GPU's time), "waiting" the part spent waiting for the
oldest queued call once the queue is full (the GPU's pace, not host work),
and "own" the rest: flashport's and Python's host work. ``--section
queued`` (or ``--queued-only``) measures just this. Speed is measured here,
never asserted in tests.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

import flashport

from .timing import interleaved_medians

HEADS_Q, HEADS_KV, D = 32, 8, 128
BATCHES = (1, 8, 32)
CONTEXTS = (4096, 32768, 131072)
QUICK = {"batches": (1, 8), "contexts": (4096, 16384), "step_shapes": ((1, 4096),)}
BLOCK_SIZES = (1, 16, 32, 128, 256)
# Bytes copied for the copy bandwidths (the quick run copies a quarter).
COPY_BYTES = 2 << 30
# The main table's paged layout on the GPU by default (the issue's
# reference rows: block 16, a shuffled block table).
GPU_PAGED_BLOCK = 16
# The decode step: layers, (batch, context) shapes, the KVCache's block
# size, and the steps between two returns of the caches to the context.
STEP_LAYERS = 32
STEP_SHAPES = ((8, 4096), (1, 4096))
STEP_BLOCK = 16
STEP_RESET = 16
# Caches the run may hold at once by default: on the GPU the main table is
# held to its buffers (2 × the largest buffer) anyway, and a decode step of
# 32 layers at 8 × 4096 in float32 holds 8.5 GiB in flashport's pools and
# as much in torch's tensors; the CPU keeps to a developer VM's memory.
MAX_CACHE_GIB = {"gpu": 24.0, "cpu": 8.0}
SECTIONS = ("table", "splits", "blocks", "step", "queued")


def cache_bytes(batch: int, context: int, dtype) -> int:
    """Bytes of K and V a decode over full caches reads."""
    return 2 * batch * HEADS_KV * context * D * np.dtype(dtype).itemsize


def make_arrays(batch: int, context: int, dtype, seed: int = 0):
    """q (batch, 32, 1, 128) and contiguous caches (batch, 8, context, 128),
    standard normal."""
    rng = np.random.default_rng(seed)

    def normal(shape):
        return rng.standard_normal(shape, dtype=np.float32).astype(dtype, copy=False)

    q = normal((batch, HEADS_Q, 1, D))
    k = normal((batch, HEADS_KV, context, D))
    v = normal((batch, HEADS_KV, context, D))
    return q, k, v


def paged_cache(k, block_size: int, seed: int = 1):
    """The contiguous cache ``k`` as a pool of blocks in a random order and
    the block table that gathers it back."""
    batch, heads, context, d = k.shape
    blocks = context // block_size
    rows = k.reshape(batch, heads, blocks, block_size, d).transpose(0, 2, 1, 3, 4)
    rows = rows.reshape(batch * blocks, heads, block_size, d)
    order = np.random.default_rng(seed).permutation(batch * blocks)
    # C-contiguous, as a cache manager allocates its pool (empty_like would
    # keep the strides of the transposed view at batch 1, and the call
    # would copy that pool into a contiguous one first).
    pool = np.empty(rows.shape, rows.dtype)
    pool[order] = rows
    return pool, order.reshape(batch, blocks).astype(np.int32)


@dataclass(frozen=True)
class CopyReference:
    """A copy bandwidth measured in this run: bytes read and written per
    second by a copy of ``nbytes``."""

    name: str
    nbytes: int
    bandwidth: float


# The names the output gives the copies.
TORCH_COPY = "torch CUDA copy_"
WGPU_COPY = "DeviceArray.copy (wgpu)"
NUMPY_COPY = "NumPy copy"


def copy_bandwidth(device: str, nbytes: int, repeat: int, warm: float = 1.0) -> float:
    """Bytes read and written per second by flashport's copy of ``nbytes``
    on the GPU (``DeviceArray.copy``), or NumPy's on the CPU."""
    src = np.ones(nbytes // 4, np.float32)
    if device == "gpu":
        x = flashport.to_device(src)
        del src

        def copy():
            y = x.copy()
            # The copy returns once it is queued: the time is until it is done.
            flashport.synchronize()
            return y

        seconds = interleaved_medians(
            {"copy": copy}, max(repeat, GPU_CALLS), **_timing("gpu", warm)
        )["copy"]
    else:
        dst = np.empty_like(src)
        seconds = interleaved_medians({"copy": lambda: np.copyto(dst, src)}, max(repeat, 5))["copy"]
    return 2 * nbytes / seconds


def torch_copy_bandwidth(torch, nbytes: int, repeat: int, warm: float = 1.0) -> float:
    """Bytes read and written per second by a CUDA ``copy_`` of ``nbytes``
    from one device tensor into another: the median of ``repeat`` copies,
    each timed by CUDA events around it alone, after ``warm`` seconds of
    copies (the GPU's clocks climb after idle)."""
    x = torch.ones(nbytes // 4, dtype=torch.float32, device="cuda")
    y = torch.empty_like(x)
    y.copy_(x)
    torch.cuda.synchronize()
    until = time.perf_counter() + warm
    while time.perf_counter() < until:
        y.copy_(x)
        torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    seconds = []
    for _ in range(repeat):
        start.record()
        y.copy_(x)
        end.record()
        end.synchronize()
        seconds.append(start.elapsed_time(end) / 1e3)  # elapsed_time is in ms
    del x, y
    # Give the 2 × nbytes back to the device for flashport's buffers.
    torch.cuda.empty_cache()
    return 2 * nbytes / statistics.median(seconds)


def copy_references(
    device: str, nbytes: int, repeat: int, warm: float, torch_dev
) -> list[CopyReference]:
    """The copies measured in this run, the reference of "of copy" first:
    on the GPU the vendor's (torch's CUDA copy) where torch with CUDA
    imports, then wgpu's; on the CPU NumPy's."""
    if device != "gpu":
        return [CopyReference(NUMPY_COPY, nbytes, copy_bandwidth("cpu", nbytes, repeat))]
    refs = []
    if torch_dev is not None and torch_dev[1] == "cuda":
        bw = torch_copy_bandwidth(torch_dev[0], nbytes, max(repeat, GPU_CALLS), warm)
        refs.append(CopyReference(TORCH_COPY, nbytes, bw))
    # One DeviceArray must fit one buffer.
    wgpu_bytes = min(nbytes, _max_buffer_size() // (1 << 20) << 20)
    refs.append(
        CopyReference(WGPU_COPY, wgpu_bytes, copy_bandwidth("gpu", wgpu_bytes, repeat, warm))
    )
    return refs


def _max_buffer_size() -> int:
    gpus = [d for d in flashport.devices() if d["device"].startswith("gpu")]
    return gpus[0]["limits"]["max_buffer_size"]


def _torch(device: str):
    """PyTorch and its device for the comparison, or None."""
    try:
        import torch
    except ImportError:
        return None
    if device == "gpu":
        return (torch, "cuda") if torch.cuda.is_available() else None
    torch.set_num_threads(flashport.devices()[0]["threads"])
    return torch, "cpu"


def _release_torch_memory(torch_dev) -> None:
    """Hands torch's cached CUDA blocks back, so flashport's buffers have the
    device's memory (torch keeps what it freed for itself otherwise)."""
    if torch_dev is not None and torch_dev[1] == "cuda":
        torch_dev[0].cuda.empty_cache()


def torch_case(torch_dev, q, k, v) -> Callable[[], object] | None:
    """SDPA with enable_gqa on the same contiguous cache. Decoding one row
    against the whole cache sees every key, so it is not causal there."""
    if torch_dev is None:
        return None
    torch, dev = torch_dev
    import torch.nn.functional as F

    tq, tk, tv = (torch.from_numpy(x).to(dev) for x in (q, k, v))

    def run():
        out = F.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)
        if dev == "cuda":
            torch.cuda.synchronize()
        return out

    try:
        run()
    except Exception as e:  # an unsupported dtype on this build, say
        print(f"  (torch: {type(e).__name__}: {e})")
        return None
    return run


def decode_call(device: str, q, k, v, lens, **kw) -> Callable[[], object]:
    """The public call as its user makes it on ``device``."""
    if device == "gpu":
        dq, dk, dv = (flashport.to_device(x) for x in (q, k, v))

        def run():
            out = flashport.attention_with_kvcache(dq, dk, dv, lens, **kw)
            # The call returns once its work is queued; its user has the
            # results when the GPU is done.
            flashport.synchronize()
            return out

        return run
    return lambda: flashport.attention_with_kvcache(q, k, v, lens, device="cpu", **kw)


# On the GPU the calls run back to back after a second of them (``--warm``):
# at the clocks a decoding loop keeps the GPU at (an H100 that idled runs a
# decode call up to 3x slower for a few hundred calls). torch's and the
# NumPy round trip each run in a block of their own: torch's CUDA calls
# between flashport's Vulkan ones switch the GPU between two contexts
# (flashport's float16 1x131072 call took 0.96 ms in a block and 1.37 ms
# interleaved with torch's), and a round trip leaves the GPU idle while it
# copies. The DeviceArray calls of a row (paged and contiguous, auto and one
# split) alternate in one block, so that the GPU's drift over the seconds of
# a block (up to 2x on the H100, 2026-11-24) moves both sides of a ratio.
GPU_TIMING = {"settle": 0.0, "warm": 1.0}
GPU_CALLS = 21
GPU_BLOCKS_OF_THEIR_OWN = ("torch", "numpy")


def _timing(device: str, warm: float = GPU_TIMING["warm"]) -> dict[str, float]:
    """interleaved_medians' pacing on ``device``: back to back after ``warm``
    seconds of calls on the GPU, a pause before each call on the CPU."""
    return {"settle": 0.0, "warm": warm} if device == "gpu" else {}


def _measure(
    cases: dict[str, Callable[[], object]],
    repeat: int,
    device: str = "cpu",
    warm: float = GPU_TIMING["warm"],
) -> dict[str, float | str]:
    """Median seconds of each case, or why it could not run."""
    runnable: dict[str, Callable[[], object]] = {}
    results: dict[str, float | str] = {}
    for name, fn in cases.items():
        try:
            fn()
            runnable[name] = fn
        except (flashport.ProblemTooLargeError, MemoryError) as e:
            results[name] = f"{type(e).__name__}: {e}"
    if device == "gpu":
        together = {n: f for n, f in runnable.items() if n not in GPU_BLOCKS_OF_THEIR_OWN}
        blocks = [together] + [{n: f} for n, f in runnable.items() if n in GPU_BLOCKS_OF_THEIR_OWN]
        for block in filter(None, blocks):
            results |= interleaved_medians(block, max(repeat, GPU_CALLS), **_timing(device, warm))
    elif runnable:
        results |= interleaved_medians(runnable, repeat)
    return results


def _ms(x) -> str:
    return f"{1e3 * x:9.3f}" if isinstance(x, float) else f"{'-':>9}"


def _ratio(a, b) -> str:
    return f"{a / b:6.2f}x" if isinstance(a, float) and isinstance(b, float) else f"{'-':>7}"


def _print_failures(t: dict) -> None:
    for name, why in t.items():
        if isinstance(why, str):
            print(f"  ({name}: {why})")


QUEUED_CALLS = 1000
QUEUED_SHAPE = {"batch": 1, "context": 4096, "dtype": np.float16, "block_size": 16}


def queued_host_time() -> dict[str, dict[str, float]]:
    """Host seconds per decode call on DeviceArrays that returns once its
    work is queued: ``QUEUED_CALLS`` calls back to back, then one
    synchronize. Per call: "host" (the call's own wall time), "submit" and
    "waiting" (its host phases "host:submit" and "host:queue_full": handing
    the work to the driver, and waiting for the oldest call when the queue
    is full) and
    "wall" (the loop and the synchronize, per call)."""
    from .. import _core

    batch, context, dtype = (QUEUED_SHAPE[n] for n in ("batch", "context", "dtype"))
    q, k, v = make_arrays(batch, context, dtype)
    lens = np.full(batch, context, np.int32)
    dq, dk, dv = (flashport.to_device(x) for x in (q, k, v))
    cache = flashport.KVCache(
        batch * -(-context // QUEUED_SHAPE["block_size"]),
        QUEUED_SHAPE["block_size"],
        HEADS_KV,
        D,
        dtype=dtype,
        device="gpu",
    )
    seq_ids = [cache.new_sequence() for _ in range(batch)]
    for b, sid in enumerate(seq_ids):
        cache.append(sid, k[b], v[b])
    calls = {
        "contiguous": lambda: flashport.attention_with_kvcache(dq, dk, dv, lens),
        "KVCache": lambda: cache.attention(dq, seq_ids),
    }
    results = {}
    for name, call in calls.items():
        for _ in range(50):
            call()
        flashport.synchronize()
        host = 0.0
        phases = {"host:submit": 0.0, "host:queue_full": 0.0}
        start = time.perf_counter()
        for _ in range(QUEUED_CALLS):
            t = time.perf_counter()
            call()
            host += time.perf_counter() - t
            for n, s in _core._gpu_kernel_times():
                if n in phases:
                    phases[n] += s
        flashport.synchronize()
        wall = time.perf_counter() - start
        results[name] = {
            "host": host / QUEUED_CALLS,
            "submit": phases["host:submit"] / QUEUED_CALLS,
            "waiting": phases["host:queue_full"] / QUEUED_CALLS,
            "wall": wall / QUEUED_CALLS,
        }
    return results


def print_queued_host_time() -> dict[str, dict[str, float]]:
    shape = QUEUED_SHAPE
    print(
        f"\nhost time per queued call: {np.dtype(shape['dtype']).name} decode, batch "
        f"{shape['batch']}, context {shape['context']}, DeviceArray q, {QUEUED_CALLS} calls "
        f"then one synchronize (us per call)"
    )
    print(f"{'cache':>10} {'host':>8} {'submit':>8} {'waiting':>8} {'own':>8} {'wall':>8}")
    rows = queued_host_time()
    for name, r in rows.items():
        own = r["host"] - r["submit"] - r["waiting"]
        print(
            f"{name:>10} {1e6 * r['host']:8.1f} {1e6 * r['submit']:8.1f} "
            f"{1e6 * r['waiting']:8.1f} {1e6 * own:8.1f} {1e6 * r['wall']:8.1f}",
            flush=True,
        )
    return rows


def _layouts(paged: int, context: int) -> list[int]:
    """The block sizes of a shape's rows, 0 for the contiguous cache: the
    paged layout first where ``paged`` divides the context."""
    return ([paged] if paged and context % paged == 0 else []) + [0]


def bench_shapes(args, shapes, copies: list[CopyReference], torch_dev) -> list[dict]:
    """The main table: each shape's layouts (the paged pool with a shuffled
    block table, the contiguous cache) alternating in one block, torch on
    the contiguous cache and the NumPy round trip (GPU) in blocks of their
    own."""
    ref = copies[0]
    # wgpu's copy as a second reference, where the vendor's is the first.
    wgpu = next((c for c in copies[1:] if c.name == WGPU_COPY), None)
    print(
        f"{'dtype':>8} {'batch':>5} {'context':>7} {'cache':>10} {'K+V MiB':>8} {'ms':>9} "
        f"{'GB/s':>7} {'of copy':>7} "
        + (f"{'of wgpu':>7} " if wgpu else "")
        + f"{'numpy ms':>9} {'torch ms':>9} {'vs torch':>8}"
    )
    rows = []
    for dtype in args.dtypes:
        for batch, context in shapes:
            q, k, v = make_arrays(batch, context, dtype)
            lens = np.full(batch, context, np.int32)
            layouts = _layouts(args.paged, context)
            if args.paged and args.paged not in layouts:
                print(f"  (paged: block {args.paged} does not divide context {context})")
            cases = {}
            for bs in layouts:
                if bs:
                    (pool_k, table), (pool_v, _) = paged_cache(k, bs), paged_cache(v, bs)
                    cases[f"paged {bs}"] = decode_call(
                        args.device, q, pool_k, pool_v, lens, block_table=table
                    )
                    # On the GPU the call holds its own DeviceArrays now.
                    del pool_k, pool_v
                else:
                    cases["contiguous"] = decode_call(args.device, q, k, v, lens)
            torch_run = torch_case(torch_dev, q, k, v)
            if torch_run is not None:
                cases["torch"] = torch_run
            if args.device == "gpu" and not args.no_numpy:
                cases["numpy"] = lambda q=q, k=k, v=v, lens=lens: flashport.attention_with_kvcache(
                    q, k, v, lens, device="gpu"
                )
            t = _measure(cases, args.repeat, args.device, args.warm)
            del cases, torch_run
            _release_torch_memory(torch_dev)
            nbytes = cache_bytes(batch, context, dtype)
            for bs in layouts:
                layout = f"paged {bs}" if bs else "contiguous"
                fp = t.get(layout)
                bw = nbytes / fp if isinstance(fp, float) else None
                row = {
                    "dtype": np.dtype(dtype).name,
                    "batch": batch,
                    "context": context,
                    "layout": layout,
                    "block_size": bs or None,
                    "kv_bytes": nbytes,
                    "seconds": fp if isinstance(fp, float) else None,
                    "numpy_seconds": t.get("numpy") if not bs else None,
                    "torch_seconds": t.get("torch"),
                    "bandwidth": bw,
                    "copy_reference": ref.name,
                    "fraction_of_copy": bw / ref.bandwidth if bw else None,
                    "fraction_of_wgpu_copy": bw / wgpu.bandwidth if bw and wgpu else None,
                    "all_seconds": t,
                }
                rows.append(row)
                fractions = f"{bw / ref.bandwidth:7.1%}" if bw else f"{'-':>7}"
                if wgpu:
                    fractions += f" {bw / wgpu.bandwidth:7.1%}" if bw else f" {'-':>7}"
                print(
                    f"{row['dtype']:>8} {batch:5d} {context:7d} {layout:>10} "
                    f"{nbytes / 2**20:8.0f} {_ms(fp)} "
                    + (f"{bw / 1e9:7.2f} " if bw else f"{'-':>7} ")
                    + fractions
                    + f" {_ms(row['numpy_seconds'])} {_ms(t.get('torch'))} "
                    f"{_ratio(t.get('torch'), fp):>8}",
                    flush=True,
                )
            _print_failures(t)
            del q, k, v
    return rows


def bench_splits(args, contexts) -> list[dict]:
    print(f"{'dtype':>8} {'context':>7} {'auto ms':>9} {'1 split ms':>10} {'speed-up':>8}")
    rows = []
    for dtype in args.dtypes:
        for context in contexts:
            q, k, v = make_arrays(1, context, dtype)
            lens = np.array([context], np.int32)
            t = _measure(
                {
                    "auto": decode_call(args.device, q, k, v, lens),
                    "one": decode_call(args.device, q, k, v, lens, num_splits=1),
                },
                args.repeat,
                args.device,
                args.warm,
            )
            rows.append({"dtype": np.dtype(dtype).name, "context": context, "seconds": t})
            print(
                f"{np.dtype(dtype).name:>8} {context:7d} {_ms(t['auto'])} {_ms(t['one']):>10} "
                f"{_ratio(t['one'], t['auto']):>8}",
                flush=True,
            )
            _print_failures(t)
    return rows


def bench_blocks(args, batch: int, context: int) -> list[dict]:
    """Each block size (that divides the context) against the contiguous
    cache in rounds of their own (one pool in memory at a time)."""
    print(f"{'dtype':>8} {'block':>6} {'paged ms':>9} {'contiguous ms':>13} {'ratio':>7}")
    rows = []
    for dtype in args.dtypes:
        q, k, v = make_arrays(batch, context, dtype)
        lens = np.full(batch, context, np.int32)
        contiguous = decode_call(args.device, q, k, v, lens)
        for bs in (b for b in BLOCK_SIZES if context % b == 0):
            (pool_k, table), (pool_v, _) = paged_cache(k, bs), paged_cache(v, bs)
            paged = decode_call(args.device, q, pool_k, pool_v, lens, block_table=table)
            del pool_k, pool_v
            t = _measure(
                {"paged": paged, "contiguous": contiguous}, args.repeat, args.device, args.warm
            )
            del paged
            rows.append({"dtype": np.dtype(dtype).name, "block_size": bs, "seconds": t})
            print(
                f"{np.dtype(dtype).name:>8} {bs:6d} {_ms(t['paged'])} {_ms(t['contiguous']):>13} "
                f"{_ratio(t['paged'], t['contiguous'])}",
                flush=True,
            )
            _print_failures(t)
    return rows


def _new_rows(batch: int, dtype, seed: int = 0):
    """A decode step's new key and value rows ``(batch, heads_kv, 1, d)``."""
    rng = np.random.default_rng(seed + 1)
    return tuple(
        rng.standard_normal((batch, HEADS_KV, 1, D), dtype=np.float32).astype(dtype)
        for _ in range(2)
    )


class FlashportStep:
    """The attention of a decode step through one ``KVCache`` of ``layers``
    layers: per layer, ``append_batch`` of one new position per sequence and
    ``attention`` over the layer (on the GPU on DeviceArrays, then one
    ``flashport.synchronize()``). The steps append to forks of the
    prefilled sequences; :meth:`reset` frees them and forks again, so the
    sequences go back to ``context`` positions (every layer) without a new
    prefill. ``context`` must be a multiple of ``block_size``: a fork's
    first append then takes a new block of its own, as a sequence's does
    every ``block_size`` steps, and copies none."""

    def __init__(
        self,
        batch: int,
        context: int,
        layers: int,
        dtype,
        device: str,
        block_size: int = STEP_BLOCK,
        reset_every: int = STEP_RESET,
        seed: int = 0,
    ) -> None:
        if context % block_size:
            raise ValueError(f"context {context} is not a multiple of block size {block_size}")
        q, k, v = make_arrays(batch, context, dtype, seed)
        new_k, new_v = _new_rows(batch, dtype, seed)
        # The prefilled blocks, and each fork's blocks for reset_every steps.
        blocks = batch * (context // block_size + -(-reset_every // block_size))
        self.cache = flashport.KVCache(
            blocks, block_size, HEADS_KV, D, layers=layers, dtype=dtype, device=device
        )
        self.gpu, self.layers = device == "gpu", layers
        put = flashport.to_device if self.gpu else np.asarray
        self.parents = [self.cache.new_sequence() for _ in range(batch)]
        k, v = put(k), put(v)
        for layer in range(layers):
            self.cache.append_batch(self.parents, k, v, layer=layer)
        del k, v
        self.q, self.new_k, self.new_v = put(q), put(new_k), put(new_v)
        self.seq_ids: list[int] = []
        self.reset()

    def reset(self) -> None:
        for sid in self.seq_ids:
            self.cache.free(sid)
        self.seq_ids = [self.cache.fork(p) for p in self.parents]

    def step(self):
        """One decode step; returns the last layer's output."""
        for layer in range(self.layers):
            self.cache.append_batch(self.seq_ids, self.new_k, self.new_v, layer=layer)
            out = self.cache.attention(self.q, self.seq_ids, layer=layer)
        if self.gpu:
            flashport.synchronize()
        return out


class TorchStep:
    """PyTorch doing :class:`FlashportStep`'s work as a model with a static
    cache does: per layer, the new key and value row written into a
    preallocated contiguous cache ``(batch, heads_kv, context +
    reset_every, d)`` at the current length (an index), then SDPA with
    ``enable_gqa=True`` on the cache up to that length (a view); on CUDA then
    one ``torch.cuda.synchronize()``. :meth:`reset` sets the length back to
    ``context``. The same keys, values and queries as FlashportStep's (the
    same seeds)."""

    def __init__(
        self,
        torch_dev,
        batch: int,
        context: int,
        layers: int,
        dtype,
        reset_every: int = STEP_RESET,
        seed: int = 0,
    ) -> None:
        torch, dev = torch_dev
        import torch.nn.functional as F

        self.torch, self.cuda, self.sdpa, self.context = torch, dev == "cuda", F, context
        q, k, v = make_arrays(batch, context, dtype, seed)
        new_k, new_v = _new_rows(batch, dtype, seed)
        capacity = context + reset_every

        def preallocated(prefix):
            rows = torch.from_numpy(prefix).to(dev)
            caches = []
            for _ in range(layers):
                c = torch.empty((batch, HEADS_KV, capacity, D), dtype=rows.dtype, device=dev)
                c[:, :, :context] = rows
                caches.append(c)
            return caches

        self.k, self.v = preallocated(k), preallocated(v)
        del k, v
        self.q = torch.from_numpy(q).to(dev)
        # (batch, heads_kv, d): the row a layer's projection gives.
        self.new_k = torch.from_numpy(np.ascontiguousarray(new_k[:, :, 0])).to(dev)
        self.new_v = torch.from_numpy(np.ascontiguousarray(new_v[:, :, 0])).to(dev)
        self.length = context
        if self.cuda:
            torch.cuda.synchronize()

    def reset(self) -> None:
        self.length = self.context

    def step(self):
        """One decode step; returns the last layer's output."""
        n = self.length
        for k, v in zip(self.k, self.v, strict=True):
            k[:, :, n] = self.new_k
            v[:, :, n] = self.new_v
            out = self.sdpa.scaled_dot_product_attention(
                self.q, k[:, :, : n + 1], v[:, :, : n + 1], enable_gqa=True
            )
        self.length = n + 1
        if self.cuda:
            self.torch.cuda.synchronize()
        return out


def time_steps(step, reset, repeat: int, warm: float = 0.0, reset_every: int = STEP_RESET):
    """Median seconds of ``step()`` over ``repeat`` steps, after one step and
    ``warm`` seconds of steps; ``reset()`` (untimed) before the first step
    and after every ``reset_every`` steps."""
    done = 0

    def one() -> float:
        nonlocal done
        if done % reset_every == 0:
            reset()
        start = time.perf_counter()
        step()
        seconds = time.perf_counter() - start
        done += 1
        return seconds

    one()
    until = time.perf_counter() + warm
    while time.perf_counter() < until:
        one()
    return statistics.median(one() for _ in range(repeat))


def step_bytes(batch: int, context: int, layers: int, dtype, with_torch: bool) -> int:
    """Device (or host) memory the two steps' caches hold."""
    per_cache = layers * cache_bytes(batch, context + STEP_RESET, dtype)
    return per_cache * (2 if with_torch else 1)


def bench_step(args, shapes, copies: list[CopyReference], torch_dev, limit: float) -> list[dict]:
    """The attention of a ``--layers``-layer decode step, flashport's and
    torch's, each in a block of its own."""
    ref = copies[0] if copies else None
    gpu = args.device == "gpu"
    repeat = max(args.repeat, GPU_CALLS) if gpu else args.repeat
    warm = args.warm if gpu else 0.0
    fp_how = "DeviceArrays, then one flashport.synchronize()" if gpu else "NumPy arrays on the CPU"
    torch_how = (
        "none"
        if torch_dev is None
        else f"{args.layers} x (new row written into a preallocated contiguous cache at the "
        "current length + SDPA(enable_gqa=True) on the cache up to it)"
        + (", then torch.cuda.synchronize()" if torch_dev[1] == "cuda" else " on the CPU")
    )
    print(
        f"flashport: {args.layers} x (KVCache.append_batch of one position per sequence + "
        f"KVCache.attention), block {STEP_BLOCK}, {fp_how}\ntorch: {torch_how}\n"
        f"median of {repeat} steps"
        + (f" after {warm:g} s of steps" if warm else "")
        + f"; the caches return to the context every {STEP_RESET} steps; "
        "K+V: the context's keys and values over all layers"
    )
    print(
        f"{'dtype':>8} {'batch':>5} {'context':>7} {'layers':>6} {'K+V MiB':>8} {'step ms':>9} "
        f"{'layer ms':>9} {'GB/s':>7} {'of copy':>7} {'torch ms':>9} {'flashport/torch':>15}"
    )
    rows = []
    for dtype in args.dtypes:
        for batch, context in shapes:
            name = np.dtype(dtype).name
            need = step_bytes(batch, context, args.layers, dtype, torch_dev is not None)
            if need > limit:
                print(
                    f"  ({name} {batch}x{context}: skipped, its caches take "
                    f"{need / 2**30:.1f} GiB, over {limit / 2**30:g} GiB: --max-cache-gib)"
                )
                continue
            t: dict[str, float | str] = {}
            try:
                fp = FlashportStep(batch, context, args.layers, dtype, args.device)
                t["flashport"] = time_steps(fp.step, fp.reset, repeat, warm)
                del fp
            except (flashport.ProblemTooLargeError, MemoryError, ValueError) as e:
                t["flashport"] = f"{type(e).__name__}: {e}"
            if torch_dev is not None:
                try:
                    ts = TorchStep(torch_dev, batch, context, args.layers, dtype)
                    t["torch"] = time_steps(ts.step, ts.reset, repeat, warm)
                    del ts
                except Exception as e:  # out of memory, an unsupported dtype
                    t["torch"] = f"{type(e).__name__}: {e}"
                _release_torch_memory(torch_dev)
            fp_s, torch_s = t.get("flashport"), t.get("torch")
            nbytes = args.layers * cache_bytes(batch, context, dtype)
            bw = nbytes / fp_s if isinstance(fp_s, float) else None
            row = {
                "dtype": name,
                "batch": batch,
                "context": context,
                "layers": args.layers,
                "block_size": STEP_BLOCK,
                "kv_bytes": nbytes,
                "seconds": fp_s if isinstance(fp_s, float) else None,
                "torch_seconds": torch_s if isinstance(torch_s, float) else None,
                "flashport_over_torch": fp_s / torch_s
                if isinstance(fp_s, float) and isinstance(torch_s, float)
                else None,
                "bandwidth": bw,
                "copy_reference": ref.name if ref else None,
                "fraction_of_copy": bw / ref.bandwidth if bw and ref else None,
                "all_seconds": t,
            }
            rows.append(row)
            print(
                f"{name:>8} {batch:5d} {context:7d} {args.layers:6d} {nbytes / 2**20:8.0f} "
                f"{_ms(fp_s)} {_ms(fp_s / args.layers if bw else None)} "
                + (f"{bw / 1e9:7.2f} " if bw else f"{'-':>7} ")
                + (f"{row['fraction_of_copy']:7.1%}" if row["fraction_of_copy"] else f"{'-':>7}")
                + f" {_ms(torch_s)} {_ratio(fp_s, torch_s):>15}",
                flush=True,
            )
            _print_failures(t)
    return rows


def _shape(text: str) -> tuple[int, int]:
    """``BxN`` (batch x context) as two positive ints."""
    try:
        batch, context = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected BATCHxCONTEXT, e.g. 8x32768"
        ) from None
    if batch < 1 or context < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: batch and context must be >= 1")
    return batch, context


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m flashport bench decode", description=__doc__)
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--repeat", type=int, default=5, help="timed rounds per case (median)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="batch 1 and 8, contexts 4k and 16k, the step at 1x4096, copies of 512 MiB",
    )
    parser.add_argument(
        "--max-cache-gib",
        type=float,
        help="skip shapes whose caches take more (default: 24 on the GPU, 8 on the CPU; the "
        "main table's K+V, the step's caches of all layers, flashport's and torch's)",
    )
    parser.add_argument("--dtype", action="append", choices=("float32", "float16"))
    parser.add_argument(
        "--shape",
        type=_shape,
        action="append",
        help="BATCHxCONTEXT rows of the main table instead of the default grid (repeatable)",
    )
    parser.add_argument(
        "--paged",
        type=int,
        metavar="BLOCK",
        help="main table: also a paged pool of this block size, shuffled block table "
        f"(default {GPU_PAGED_BLOCK} on the GPU, 0 = contiguous only, the CPU's default)",
    )
    parser.add_argument(
        "--no-numpy", action="store_true", help="GPU: skip the NumPy round-trip column"
    )
    parser.add_argument(
        "--copy-mib",
        type=int,
        help=f"MiB each copy bandwidth copies (default {COPY_BYTES >> 20}; --quick: a quarter)",
    )
    parser.add_argument(
        "--warm",
        type=float,
        default=GPU_TIMING["warm"],
        help="GPU: seconds of back-to-back calls before each block is timed",
    )
    parser.add_argument(
        "--section",
        action="append",
        choices=SECTIONS,
        help="run only these sections (repeatable; default: all, 'queued' on the GPU only)",
    )
    parser.add_argument("--layers", type=int, default=STEP_LAYERS, help="layers of the decode step")
    parser.add_argument(
        "--step-shape",
        type=_shape,
        action="append",
        help="BATCHxCONTEXT of the decode step (repeatable; default 8x4096 and 1x4096); "
        f"the context a multiple of {STEP_BLOCK}",
    )
    parser.add_argument(
        "--queued-only", action="store_true", help="only the host time per queued call (GPU)"
    )
    parser.add_argument("--json", help="write the raw numbers to this file")
    args = parser.parse_args(argv)
    args.dtypes = [np.dtype(x).type for x in (args.dtype or ["float32", "float16"])]
    if args.paged is None:
        args.paged = GPU_PAGED_BLOCK if args.device == "gpu" else 0
    if args.paged < 0 or args.layers < 1:
        parser.error("--paged must be >= 0 and --layers >= 1")
    if args.max_cache_gib is None:
        args.max_cache_gib = MAX_CACHE_GIB[args.device]
    if args.copy_mib is None:
        args.copy_mib = (COPY_BYTES >> 20) // (4 if args.quick else 1)
    if args.queued_only:
        args.section = ["queued"]
    if args.section is None:
        args.section = [s for s in SECTIONS if s != "queued" or args.device == "gpu"]
    for batch, context in args.step_shape or ():
        if context % STEP_BLOCK:
            parser.error(f"--step-shape {batch}x{context}: context not a multiple of {STEP_BLOCK}")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    devices = flashport.devices()
    gpus = [d for d in devices if d["device"].startswith("gpu")]
    if args.device == "gpu" and not gpus:
        print("no GPU adapter: nothing to measure on --device gpu")
        return 1
    if "queued" in args.section and args.device != "gpu":
        print("the queued section measures GPU calls: pass --device gpu")
        return 1
    where = (
        f"GPU {gpus[0]['name']} ({gpus[0].get('driver', '')})"
        if args.device == "gpu"
        else f"CPU, {os.cpu_count()} cores, {devices[0]['threads']} threads"
    )
    torch_dev = _torch(args.device)
    torch_name = f"torch {torch_dev[0].__version__}" if torch_dev else "no torch"
    print(f"flashport {flashport.__version__} bench decode on {where}; {torch_name}", flush=True)
    result: dict = {"device": args.device, "where": where, "torch": torch_name}
    started = time.perf_counter()

    copies: list[CopyReference] = []
    if {"table", "step"} & set(args.section):
        copies = copy_references(
            args.device, args.copy_mib << 20, args.repeat, args.warm, torch_dev
        )
        for i, c in enumerate(copies):
            role = '"of copy" against' if i == 0 else 'also (a second reference, "of wgpu"):'
            print(
                f"copy bandwidth: {role} {c.name} of {c.nbytes >> 20} MiB, read + written: "
                f"{c.bandwidth / 1e9:.2f} GB/s",
                flush=True,
            )
        result |= {
            "copy_reference": copies[0].name,
            "copy_bandwidth": copies[0].bandwidth,
            "copies": [asdict(c) for c in copies],
        }

    batches, contexts = (QUICK["batches"], QUICK["contexts"]) if args.quick else (BATCHES, CONTEXTS)
    limit = args.max_cache_gib * 2**30
    table_limit = limit
    if args.device == "gpu":
        # Each of K and V is one device array, which must fit one buffer.
        table_limit = min(limit, 2 * gpus[0]["limits"]["max_buffer_size"])
    widest = max(args.dtypes, key=lambda t: np.dtype(t).itemsize)
    grid = args.shape or [(b, c) for b in batches for c in contexts]
    fits = [(b, c) for b, c in grid if cache_bytes(b, c, widest) <= table_limit]
    skipped = [s for s in grid if s not in fits]

    if "table" in args.section:
        layout = f"paged (block {args.paged}, shuffled block table) and contiguous caches"
        print(
            f"\ndecode, {HEADS_Q} query heads over {HEADS_KV} key/value heads, d = {D}, one row; "
            + (layout if args.paged else "contiguous caches")
            + ("; DeviceArrays" if args.device == "gpu" else "")
            + f'; "of copy" against {copies[0].name}'
        )
        if skipped:
            print(f"  (skipped, K+V over {table_limit / 2**30:g} GiB: {skipped})")
        result["shapes"] = bench_shapes(args, fits, copies, torch_dev)
    if "splits" in args.section:
        long_contexts = sorted({c for (b, c) in fits if b == 1})
        print("\nsplit-KV at batch 1: the default split count against num_splits=1")
        result["splits"] = bench_splits(args, long_contexts[-2:])
    if "blocks" in args.section and fits:
        default_at = (batches[1], contexts[1])
        paged_at = default_at if default_at in fits else fits[0]
        print(
            f"\npaged caches (permuted block tables) at batch {paged_at[0]}, context {paged_at[1]}"
        )
        result["blocks"] = bench_blocks(args, *paged_at)
    if "step" in args.section:
        step_shapes = args.step_shape or (QUICK["step_shapes"] if args.quick else STEP_SHAPES)
        print(f"\ndecode step of {args.layers} layers (the attention: append and attend)")
        result["step"] = bench_step(args, step_shapes, copies, torch_dev, limit)
    if "queued" in args.section:
        result["queued"] = print_queued_host_time()
    print(f"\n{time.perf_counter() - started:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
