"""``python -m flashport bench kvcache``: a decode step through
:class:`flashport.KVCache` against :func:`flashport.attention_with_kvcache`
on a contiguous cache holding the same keys and values, on the CPU or the
GPU (``--device``).

Two rows per shape, each the median of ``--repeat`` interleaved rounds after
a warm-up:

* **attention**: ``cache.attention(q, seq_ids)`` (the sequences' block table
  built from the cache's bookkeeping, the paged kernel on the pool) against
  ``attention_with_kvcache(q, k, v, lens)`` on the contiguous cache, and
  against ``attention_with_kvcache`` on copies of the cache's pool and block
  table (NumPy arrays): the paged kernel alone, without the cache object;
* **step**: what a decode step does per layer: append one position to
  every sequence (``cache.append_batch``, one call for the batch, or with
  ``--per-sequence`` one ``cache.append`` per sequence; a NumPy store into
  the contiguous cache), then the attention above. Its last column is the
  step over the cache's attention alone, timed in the same rounds: what the
  append adds (issue #34's target: at most 1.15 at batch 8).

The attention rows are timed first; each round of the step rows then
appends one position per sequence to both caches, so their lengths stay
equal. On the GPU the contiguous cache is a pair of DeviceArrays uploaded
once with room for every step's position already written (DeviceArrays are
immutable), so its "append" is free: the step ratio there is the cache's
whole step (a scatter on the device, then attention) against contiguous
attention alone. Outputs come back to NumPy on both sides. 32 query heads
over 8 key/value heads, d = 128, float32, as ``bench decode``. The issue's
targets are a ratio (cache over contiguous) of at most 1.2, and a step of
at most 1.15 times the cache's attention. Speed is measured here, never
asserted in tests.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

import flashport

from .decode import HEADS_KV, HEADS_Q, D, make_arrays
from .timing import interleaved_medians

BATCHES = (1, 8)
CONTEXTS = (1024, 4096)


class Pair:
    """The same sequences in a KVCache and in contiguous arrays, grown
    together one position per sequence per step."""

    def __init__(
        self,
        batch: int,
        context: int,
        block_size: int,
        rounds: int,
        device: str,
        per_sequence: bool = False,
    ) -> None:
        q, k, v = make_arrays(batch, context, np.float32)
        self.q, self.device, self.per_sequence = q, device, per_sequence
        capacity = context + rounds
        blocks_per_seq = -(-capacity // block_size)
        self.cache = flashport.KVCache(
            batch * blocks_per_seq, block_size, HEADS_KV, D, dtype=np.float32, device=device
        )
        self.seq_ids = [self.cache.new_sequence() for _ in range(batch)]
        for b, sid in enumerate(self.seq_ids):
            self.cache.append(sid, k[b], v[b])
        self.k = np.zeros((batch, HEADS_KV, capacity, D), np.float32)
        self.v = np.zeros_like(self.k)
        self.k[:, :, :context], self.v[:, :, :context] = k, v
        self.lens = np.full(batch, context, np.int32)
        rng = np.random.default_rng(2)
        self.new_k = rng.standard_normal((batch, HEADS_KV, 1, D), dtype=np.float32)
        self.new_v = rng.standard_normal((batch, HEADS_KV, 1, D), dtype=np.float32)
        if device == "gpu":
            self.k[:, :, context:] = self.new_k
            self.v[:, :, context:] = self.new_v
            self.k_dev, self.v_dev = flashport.to_device(self.k), flashport.to_device(self.v)

    def paged_arrays(self):
        """The paged kernel on copies of the cache's pool and table, now."""
        k_pool, v_pool = self.cache.read_layer(0)
        table = self.cache.block_table(self.seq_ids)
        lens = self.lens.copy()
        return lambda: flashport.attention_with_kvcache(
            self.q, k_pool, v_pool, lens, block_table=table, device=self.device
        )

    def cache_attention(self):
        return self.cache.attention(self.q, self.seq_ids)

    def contiguous_attention(self):
        if self.device == "gpu":
            out = flashport.attention_with_kvcache(
                self.q, self.k_dev, self.v_dev, self.lens, device="gpu"
            )
            return out.numpy()
        return flashport.attention_with_kvcache(self.q, self.k, self.v, self.lens, device="cpu")

    def cache_step(self):
        if self.per_sequence:
            for b, sid in enumerate(self.seq_ids):
                self.cache.append(sid, self.new_k[b], self.new_v[b])
        else:
            self.cache.append_batch(self.seq_ids, self.new_k, self.new_v)
        return self.cache_attention()

    def contiguous_step(self):
        if self.device == "gpu":
            self.lens += 1
            return self.contiguous_attention()
        rows = np.arange(len(self.lens))
        self.k[rows, :, self.lens] = self.new_k[:, :, 0]
        self.v[rows, :, self.lens] = self.new_v[:, :, 0]
        self.lens += 1
        return self.contiguous_attention()

    def agree(self) -> float:
        """Max |difference| of the two attentions (same keys, same lengths)."""
        if [self.cache.length(s) for s in self.seq_ids] != self.lens.tolist():
            raise AssertionError("the two caches' lengths drifted apart")
        return float(np.abs(self.cache_attention() - self.contiguous_attention()).max())


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashport bench kvcache", description=__doc__)
    parser.add_argument("--repeat", type=int, default=11, help="timed rounds per case (median)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--batch", type=int, action="append", help="default: 1 and 8")
    parser.add_argument("--context", type=int, action="append", help="default: 1024 and 4096")
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument(
        "--per-sequence",
        action="store_true",
        help="the step appends with one cache.append per sequence instead of append_batch",
    )
    parser.add_argument("--json", help="write the raw numbers to this file")
    args = parser.parse_args(argv)
    batches, contexts = args.batch or BATCHES, args.context or CONTEXTS
    threads = flashport.devices()[0]["threads"]
    gpus = [d for d in flashport.devices() if d["device"].startswith("gpu")]
    if args.device == "gpu" and not gpus:
        print("no GPU adapter")
        return 1
    where = (
        f"the GPU ({gpus[0]['name']})"
        if args.device == "gpu"
        else f"the CPU, {os.cpu_count()} cores, {threads} threads"
    )
    print(
        f"flashport {flashport.__version__} bench kvcache on {where}: "
        f"{HEADS_Q} query heads over {HEADS_KV} key/value heads, d = {D}, "
        f"float32, block size {args.block_size}; median of {args.repeat} rounds; the step "
        f"appends with {'cache.append per sequence' if args.per_sequence else 'append_batch'}",
        flush=True,
    )
    print(
        f"{'batch':>5} {'context':>7} {'row':>9} {'KVCache ms':>11} {'contiguous ms':>14} "
        f"{'ratio':>7} {'paged arrays ms':>16} {'ratio':>7} {'max |diff|':>10} "
        f"{'step/attention':>14}"
    )
    started = time.perf_counter()
    rows = []
    for batch in batches:
        for context in contexts:
            # Warm-ups and rounds of both step cases each append a position.
            pair = Pair(
                batch, context, args.block_size, args.repeat + 1, args.device, args.per_sequence
            )
            t = interleaved_medians(
                {
                    "cache_attention": pair.cache_attention,
                    "contiguous_attention": pair.contiguous_attention,
                    "paged_attention": pair.paged_arrays(),
                },
                args.repeat,
            )
            # The cache's attention again in the step's rounds: the step over
            # it is what the append adds, at the same lengths and moment.
            t |= interleaved_medians(
                {
                    "cache_step": pair.cache_step,
                    "contiguous_step": pair.contiguous_step,
                    "step_attention": pair.cache_attention,
                },
                args.repeat,
            )
            diff = pair.agree()
            for row in ("attention", "step"):
                cache_s, contiguous_s = t[f"cache_{row}"], t[f"contiguous_{row}"]
                paged_s = t.get(f"paged_{row}")
                rows.append(
                    {
                        "batch": batch,
                        "context": context,
                        "row": row,
                        "kvcache_seconds": cache_s,
                        "contiguous_seconds": contiguous_s,
                        "paged_arrays_seconds": paged_s,
                        "ratio": cache_s / contiguous_s,
                        "max_abs_diff": diff,
                    }
                )
                over_attention = (
                    f"{cache_s / t['step_attention']:13.2f}x" if row == "step" else f"{'-':>14}"
                )
                if row == "step":
                    rows[-1]["step_attention_seconds"] = t["step_attention"]
                paged = (
                    f"{1e3 * paged_s:16.3f} {cache_s / paged_s:6.2f}x"
                    if paged_s
                    else f"{'-':>16} {'-':>7}"
                )
                print(
                    f"{batch:5d} {context:7d} {row:>9} {1e3 * cache_s:11.3f} "
                    f"{1e3 * contiguous_s:14.3f} {cache_s / contiguous_s:6.2f}x {paged} "
                    f"{diff:10.1e} {over_attention}",
                    flush=True,
                )
            del pair
    print(f"\n{time.perf_counter() - started:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": args.device,
                    "block_size": args.block_size,
                    "per_sequence": args.per_sequence,
                    "rows": rows,
                },
                f,
                indent=2,
            )
    return 0
