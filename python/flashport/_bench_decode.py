"""``python -m flashport bench decode``: attention_with_kvcache (one query row
per sequence against a KV cache) timed as its user waits for it.

Decode bandwidth is the bytes of K and V the call must read (each sequence's
cached keys and values, once) over the median wall time of the public call,
shown as a fraction of the copy bandwidth measured in the same run: a NumPy
copy of a large array on the CPU (NumPy copies on one thread), a copy from
one DeviceArray to a new one on the GPU (``DeviceArray.copy``). A copy's
bandwidth counts the bytes read and the bytes written (STREAM's convention),
so both figures are memory traffic.

On the CPU the call takes and returns NumPy arrays. On the GPU the queries
and the cache are DeviceArrays, as a serving loop keeps them, and the
outputs stay there; the "numpy" column times the same call with NumPy
arrays in and out, which uploads the cache on every call.

Tables: 32 query heads over 8 key/value heads, d = 128, batch 1, 8 and 32,
contexts 4k, 32k and 128k (those whose cache fits ``--max-cache-gib``),
float32 and float16, against PyTorch's ``scaled_dot_product_attention``
with ``enable_gqa=True`` on the same contiguous cache when torch imports;
split-KV (Flash-Decoding) at batch 1 against ``num_splits=1``; paged caches
of block sizes 1, 16, 32, 128 and 256 through a permuted block table against
the contiguous cache. Each time is a median of ``--repeat`` rounds after a
warm-up; on the GPU the calls run back to back after a second of them
(``GPU_TIMING``), the DeviceArray calls of a row alternating in one block,
torch's and the NumPy round trip each in a block of its own. A call on
DeviceArrays returns once its work is queued: each timed GPU call is
followed by ``flashport.synchronize()``, so that its time is until the
results are there, as for torch's (``torch.cuda.synchronize()``).

Host time per queued call (GPU only): the host seconds of a float16 decode
call on DeviceArrays that does not wait (batch 1, context 4096, the
contiguous cache and a ``KVCache``), over 1,000 calls back to back and then
one ``synchronize``; "submit" is the part spent handing the work to the
driver (lavapipe runs the previous submission there, so on a software
adapter this is the GPU's time), "waiting" the part spent waiting for the
oldest queued call once the queue is full (the GPU's pace, not host work),
and "own" the rest: flashport's and Python's host work. ``--queued-only``
measures just this. Speed is measured here, never asserted in tests.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable

import numpy as np

import flashport

from ._bench import interleaved_medians

HEADS_Q, HEADS_KV, D = 32, 8, 128
BATCHES = (1, 8, 32)
CONTEXTS = (4096, 32768, 131072)
QUICK = {"batches": (1, 8), "contexts": (4096, 16384)}
BLOCK_SIZES = (1, 16, 32, 128, 256)
# Bytes copied for the copy bandwidth (the quick run copies a quarter).
COPY_BYTES = 1 << 30


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


def copy_bandwidth(device: str, nbytes: int, repeat: int) -> float:
    """Bytes read and written per second by a copy of ``nbytes``."""
    src = np.ones(nbytes // 4, np.float32)
    if device == "gpu":
        x = flashport.to_device(src)
        del src

        def copy():
            y = x.copy()
            # The copy returns once it is queued: the time is until it is done.
            flashport.synchronize()
            return y

        seconds = interleaved_medians({"copy": copy}, max(repeat, GPU_CALLS), **GPU_TIMING)["copy"]
    else:
        dst = np.empty_like(src)
        seconds = interleaved_medians({"copy": lambda: np.copyto(dst, src)}, max(repeat, 5))["copy"]
    return 2 * nbytes / seconds


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


# On the GPU the calls run back to back after a second of them: at the
# clocks a decoding loop keeps the GPU at (an H100 that idled runs a decode
# call up to 3x slower for a few hundred calls). torch's and the NumPy
# round trip each run in a block of their own: torch's CUDA calls between
# flashport's Vulkan ones switch the GPU between two contexts (flashport's
# float16 1x131072 call took 0.96 ms in a block and 1.37 ms interleaved with
# torch's), and a round trip leaves the GPU idle while it copies. The
# DeviceArray calls of a row (paged and contiguous, auto and one split)
# alternate in one block, so that the GPU's drift over the seconds of a
# block (up to 2x on the H100, 2026-11-24) moves both sides of a ratio.
GPU_TIMING = {"settle": 0.0, "warm": 1.0}
GPU_CALLS = 21
GPU_BLOCKS_OF_THEIR_OWN = ("torch", "numpy")


def _measure(
    cases: dict[str, Callable[[], object]], repeat: int, device: str = "cpu"
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
            results |= interleaved_medians(block, max(repeat, GPU_CALLS), **GPU_TIMING)
    elif runnable:
        results |= interleaved_medians(runnable, repeat)
    return results


def _ms(x) -> str:
    return f"{1e3 * x:9.3f}" if isinstance(x, float) else f"{'-':>9}"


def _ratio(a, b) -> str:
    return f"{a / b:6.2f}x" if isinstance(a, float) and isinstance(b, float) else f"{'-':>7}"


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
    from . import _core

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


def bench_shapes(args, shapes, copy_bw, torch_dev) -> list[dict]:
    print(
        f"{'dtype':>8} {'batch':>5} {'context':>7} {'K+V MiB':>8} {'ms':>9} {'GB/s':>7} "
        f"{'of copy':>7} {'numpy ms':>9} {'torch ms':>9} {'vs torch':>8}"
    )
    rows = []
    for dtype in args.dtypes:
        for batch, context in shapes:
            q, k, v = make_arrays(batch, context, dtype)
            lens = np.full(batch, context, np.int32)
            cases = {"flashport": decode_call(args.device, q, k, v, lens)}
            torch_run = torch_case(torch_dev, q, k, v)
            if torch_run is not None:
                cases["torch"] = torch_run
            if args.device == "gpu":
                cases["numpy"] = lambda q=q, k=k, v=v, lens=lens: flashport.attention_with_kvcache(
                    q, k, v, lens, device="gpu"
                )
            t = _measure(cases, args.repeat, args.device)
            nbytes = cache_bytes(batch, context, dtype)
            fp = t["flashport"]
            bw = nbytes / fp if isinstance(fp, float) else None
            row = {
                "dtype": np.dtype(dtype).name,
                "batch": batch,
                "context": context,
                "kv_bytes": nbytes,
                "seconds": t,
                "bandwidth": bw,
                "fraction_of_copy": bw / copy_bw if bw else None,
            }
            rows.append(row)
            print(
                f"{row['dtype']:>8} {batch:5d} {context:7d} {nbytes / 2**20:8.0f} {_ms(fp)} "
                + (f"{bw / 1e9:7.2f} {bw / copy_bw:7.1%}" if bw else f"{'-':>7} {'-':>7}")
                + f" {_ms(t.get('numpy'))} {_ms(t.get('torch'))} "
                f"{_ratio(t.get('torch'), fp):>8}",
                flush=True,
            )
            for name, why in t.items():
                if isinstance(why, str):
                    print(f"  ({name}: {why})")
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
            )
            rows.append({"dtype": np.dtype(dtype).name, "context": context, "seconds": t})
            print(
                f"{np.dtype(dtype).name:>8} {context:7d} {_ms(t['auto'])} {_ms(t['one']):>10} "
                f"{_ratio(t['one'], t['auto']):>8}",
                flush=True,
            )
            for name, why in t.items():
                if isinstance(why, str):
                    print(f"  ({name}: {why})")
    return rows


def bench_blocks(args, batch: int, context: int) -> list[dict]:
    """Each block size against the contiguous cache in rounds of their own
    (one pool in memory at a time)."""
    print(f"{'dtype':>8} {'block':>6} {'paged ms':>9} {'contiguous ms':>13} {'ratio':>7}")
    rows = []
    for dtype in args.dtypes:
        q, k, v = make_arrays(batch, context, dtype)
        lens = np.full(batch, context, np.int32)
        contiguous = decode_call(args.device, q, k, v, lens)
        for bs in BLOCK_SIZES:
            (pool_k, table), (pool_v, _) = paged_cache(k, bs), paged_cache(v, bs)
            paged = decode_call(args.device, q, pool_k, pool_v, lens, block_table=table)
            del pool_k, pool_v
            t = _measure({"paged": paged, "contiguous": contiguous}, args.repeat, args.device)
            del paged
            rows.append({"dtype": np.dtype(dtype).name, "block_size": bs, "seconds": t})
            print(
                f"{np.dtype(dtype).name:>8} {bs:6d} {_ms(t['paged'])} {_ms(t['contiguous']):>13} "
                f"{_ratio(t['paged'], t['contiguous'])}",
                flush=True,
            )
            for name, why in t.items():
                if isinstance(why, str):
                    print(f"  ({name}: {why})")
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashport bench decode", description=__doc__)
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--repeat", type=int, default=5, help="timed rounds per case (median)")
    parser.add_argument(
        "--quick", action="store_true", help="batch 1 and 8, contexts 4k and 16k, copies of 256 MiB"
    )
    parser.add_argument(
        "--max-cache-gib", type=float, default=8.0, help="skip shapes whose K+V take more"
    )
    parser.add_argument("--dtype", action="append", choices=("float32", "float16"))
    parser.add_argument(
        "--queued-only", action="store_true", help="only the host time per queued call (GPU)"
    )
    parser.add_argument("--json", help="write the raw numbers to this file")
    args = parser.parse_args(argv)
    args.dtypes = [np.dtype(x).type for x in (args.dtype or ["float32", "float16"])]

    devices = flashport.devices()
    gpus = [d for d in devices if d["device"] == "gpu"]
    if args.device == "gpu" and not gpus:
        print("no GPU adapter: nothing to measure on --device gpu")
        return 1
    where = (
        f"GPU {gpus[0]['name']} ({gpus[0].get('driver', '')})"
        if args.device == "gpu"
        else f"CPU, {os.cpu_count()} cores, {devices[0]['threads']} threads"
    )
    torch_dev = _torch(args.device)
    torch_name = f"torch {torch_dev[0].__version__}" if torch_dev else "no torch"
    print(f"flashport {flashport.__version__} bench decode on {where}; {torch_name}", flush=True)
    if args.queued_only:
        if args.device != "gpu":
            print("--queued-only measures GPU calls: pass --device gpu")
            return 1
        queued = print_queued_host_time()
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": args.device, "where": where, "queued": queued}, f, indent=2)
        return 0

    batches, contexts = (QUICK["batches"], QUICK["contexts"]) if args.quick else (BATCHES, CONTEXTS)
    limit = args.max_cache_gib * 2**30
    if args.device == "gpu":
        # Each of K and V is one device array, which must fit one buffer.
        limit = min(limit, 2 * gpus[0]["limits"]["max_buffer_size"])
    widest = max(args.dtypes, key=lambda t: np.dtype(t).itemsize)
    fits = [(b, c) for b in batches for c in contexts if cache_bytes(b, c, widest) <= limit]
    skipped = [(b, c) for b in batches for c in contexts if (b, c) not in fits]

    started = time.perf_counter()
    copy_size = COPY_BYTES // 4 if args.quick else COPY_BYTES
    copy_bw = copy_bandwidth(args.device, copy_size, args.repeat)
    what = "DeviceArray.copy" if args.device == "gpu" else "NumPy copy"
    print(
        f"copy bandwidth: {what} of {copy_size >> 20} MiB, read + written: "
        f"{copy_bw / 1e9:.2f} GB/s",
        flush=True,
    )
    print(f"\ndecode, {HEADS_Q} query heads over {HEADS_KV} key/value heads, d = {D}, one row:")
    if skipped:
        print(f"  (skipped, K+V over {limit / 2**30:g} GiB: {skipped})")
    shapes = bench_shapes(args, fits, copy_bw, torch_dev)
    long_contexts = [c for (b, c) in fits if b == 1]
    print("\nsplit-KV at batch 1: the default split count against num_splits=1")
    splits = bench_splits(args, long_contexts[-2:])
    paged_at = (batches[1], contexts[1]) if (batches[1], contexts[1]) in fits else (1, contexts[0])
    print(f"\npaged caches (permuted block tables) at batch {paged_at[0]}, context {paged_at[1]}")
    blocks = bench_blocks(args, *paged_at)
    queued = print_queued_host_time() if args.device == "gpu" else None
    print(f"\n{time.perf_counter() - started:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": args.device,
                    "where": where,
                    "copy_bandwidth": copy_bw,
                    "shapes": shapes,
                    "splits": splits,
                    "blocks": blocks,
                    "queued": queued,
                },
                f,
                indent=2,
            )
    return 0
