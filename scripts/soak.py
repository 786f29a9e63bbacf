"""Soak test (opt-in, not part of `make test`): thousands of mixed flashport
calls in one process, valid and invalid, on the chosen devices, while the
process's resident memory, threads and open file descriptors are sampled.
After a warm-up (pools, pipelines and caches reach their sizes) they must
stay flat: RSS within --rss-slack MiB of its level after the warm-up,
threads and descriptors unchanged.

Usage: .venv/bin/python scripts/soak.py [--calls 5000] [--device cpu,gpu]
Prints the samples and exits non-zero when something grew."""

from __future__ import annotations

import argparse
import os
import sys
import time

import flashport
import numpy as np


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def one_call(rng: np.random.Generator, device: str, cache: flashport.KVCache, live: list) -> str:
    """One random call; returns its kind. Errors must be FlashportErrors."""
    kind = rng.choice(["forward", "backward", "varlen", "merge", "kvcache", "device", "error"])
    b, hkv, g = rng.integers(1, 3), rng.integers(1, 3), rng.integers(1, 3)
    sq, sk, d = rng.integers(1, 70), rng.integers(1, 70), int(rng.choice([8, 32, 64]))
    q = rng.standard_normal((b, hkv * g, sq, d), dtype=np.float32)
    k = rng.standard_normal((b, hkv, sk, d), dtype=np.float32)
    v = rng.standard_normal((b, hkv, sk, d), dtype=np.float32)
    causal = bool(rng.integers(2))
    if kind == "forward":
        flashport.attention(q, k, v, causal=causal, softcap=30.0, device=device)
    elif kind == "backward":
        o, lse = flashport.attention(q, k, v, causal=causal, return_lse=True, device=device)
        flashport.attention_backward(np.cos(o), q, k, v, o, lse, causal=causal, device=device)
    elif kind == "varlen":
        lens = rng.integers(1, 40, size=3)
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        x = rng.standard_normal((int(cu[-1]), 2, 16), dtype=np.float32)
        flashport.attention_varlen(x, x, x, cu, cu, causal=True, device=device)
    elif kind == "merge":
        o1, l1 = flashport.attention(q, k, v, return_lse=True, device=device)
        o2, l2 = flashport.attention(q, v, k, return_lse=True, device=device)
        flashport.merge_states([o1, o2], [l1, l2], device=device)
    elif kind == "kvcache":
        if live and rng.random() < 0.3:
            cache.free(live.pop(int(rng.integers(len(live)))))
        elif live and rng.random() < 0.3:
            try:
                live.append(cache.fork(live[int(rng.integers(len(live)))]))
            except flashport.CacheFullError:
                pass
        else:
            if not live or rng.random() < 0.2:
                live.append(cache.new_sequence())
            sid = live[int(rng.integers(len(live)))]
            n = int(rng.integers(1, 6))
            kv = rng.standard_normal((2, n, 32), dtype=np.float32)
            try:
                cache.append(sid, kv, kv)
            except flashport.CacheFullError:
                cache.free(live.pop(live.index(sid)))
                return kind
            qc = rng.standard_normal((1, 4, 1, 32), dtype=np.float32)
            cache.attention(qc, [sid])
    elif kind == "device":
        if device == "gpu":
            t = flashport.to_device(q)
            flashport.attention(t, flashport.to_device(k), flashport.to_device(v)).numpy()
    else:
        bad = [
            lambda: flashport.attention(q, k[..., :-1], v, device=device),
            lambda: flashport.attention(q, k, v, scale="x", device=device),
            lambda: flashport.attention(q.astype(np.int32), k, v, device=device),
            lambda: cache.append(10**6, k[0], v[0]),
        ]
        try:
            bad[int(rng.integers(len(bad)))]()
        except flashport.FlashportError:
            pass
        else:
            raise AssertionError("a bad call was accepted")
    return kind


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=5000, help="calls per device")
    parser.add_argument("--device", default="cpu,gpu", help="comma-separated devices")
    parser.add_argument("--rss-slack", type=float, default=32.0, help="MiB allowed after warm-up")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    failed = False
    for device in args.device.split(","):
        rng = np.random.default_rng(args.seed)
        cache = flashport.KVCache(64, 8, 2, 32, device=device)
        live: list = []
        warm = args.calls // 5
        samples = []
        started = time.perf_counter()
        for i in range(args.calls):
            one_call(rng, device, cache, live)
            if i + 1 == warm or (i + 1) % max(1, args.calls // 10) == 0:
                samples.append((i + 1, rss_mib(), threads(), descriptors()))
        elapsed = time.perf_counter() - started
        base = next(s for s in samples if s[0] >= warm)
        later = [s for s in samples if s[0] > base[0]]
        rss_growth = max(s[1] for s in later) - base[1] if later else 0.0
        grew_threads = any(s[2] != base[2] for s in later)
        grew_fds = any(s[3] != base[3] for s in later)
        print(f"{device}: {args.calls} calls in {elapsed:.0f} s")
        print(f"  {'calls':>7} {'RSS MiB':>9} {'threads':>8} {'fds':>5}")
        for n, rss, th, fd in samples:
            print(f"  {n:7d} {rss:9.1f} {th:8d} {fd:5d}")
        ok = rss_growth <= args.rss_slack and not grew_threads and not grew_fds
        print(
            f"  after the warm-up ({base[0]} calls): RSS {rss_growth:+.1f} MiB "
            f"(allowed {args.rss_slack:g}), threads {'changed' if grew_threads else 'flat'}, "
            f"descriptors {'changed' if grew_fds else 'flat'}: {'PASS' if ok else 'FAIL'}",
            flush=True,
        )
        failed |= not ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
