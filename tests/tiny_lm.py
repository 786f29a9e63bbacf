"""A small real attention model for the scheduler's tests: its logits of a
token depend on its sequence alone, through a float64 KVCache, so a
request's outputs can be compared with running it alone."""

from __future__ import annotations

import numpy as np
from flashport import KVCache


class TinyLM:
    """A two-layer attention model with causal attention over the cache:
    embeddings with a position term, per layer q, k, v projections, the
    attention's output added back, logits of the last token. Decode
    entries (one token each) go through one append_batch and one attention
    per layer; prompt chunks one append and one attention each."""

    def __init__(self, vocab=24, layers=2, heads_kv=2, group=2, d=8, seed=0):
        rng = np.random.default_rng(seed)
        self.vocab, self.layers, self.d = vocab, layers, d
        self.hkv, self.hq = heads_kv, heads_kv * group
        self.width = self.hq * d
        self.emb = rng.standard_normal((vocab, self.width))
        self.pos = rng.standard_normal((512, self.width)) * 0.3
        shape = (layers, self.width)
        self.wq = rng.standard_normal((*shape, self.hq * d)) / np.sqrt(self.width)
        self.wk = rng.standard_normal((*shape, heads_kv * d)) / np.sqrt(self.width)
        self.wv = rng.standard_normal((*shape, heads_kv * d)) / np.sqrt(self.width)
        self.out = rng.standard_normal((self.width, vocab)) * 3.0
        self.calls: list[list[int]] = []

    def cache(self, num_blocks, block_size=4, swap_blocks=0):
        return KVCache(
            num_blocks, block_size, self.hkv, self.d, layers=self.layers,
            dtype=np.float64, device="cpu", swap_blocks=swap_blocks,
        )  # fmt: skip

    def _heads(self, x, w, heads):
        return (x @ w).reshape(len(x), heads, self.d).transpose(1, 0, 2)

    def __call__(self, cache, batch):
        self.calls.append([len(t) for _, t in batch])
        logits = np.zeros((len(batch), self.vocab))
        decode = [i for i, (_, t) in enumerate(batch) if len(t) == 1]
        if decode:
            ids = [batch[i][0] for i in decode]
            tokens = np.array([batch[i][1][0] for i in decode])
            pos = np.array([cache.length(s) for s in ids])
            x = self.emb[tokens] + self.pos[pos]
            rows = [x[j : j + 1] for j in range(len(ids))]
            for layer in range(self.layers):
                k = np.stack([self._heads(r, self.wk[layer], self.hkv) for r in rows])
                v = np.stack([self._heads(r, self.wv[layer], self.hkv) for r in rows])
                given = tokens[:, None] if layer == 0 else None
                cache.append_batch(ids, k, v, layer=layer, tokens=given)
                q = np.stack([self._heads(r, self.wq[layer], self.hq) for r in rows])
                o = cache.attention(q, ids, layer=layer, causal=True, num_splits=1)
                x = x + o.transpose(0, 2, 1, 3).reshape(len(ids), self.width)
                rows = [x[j : j + 1] for j in range(len(ids))]
            logits[decode] = x @ self.out
        for i, (sid, tokens) in enumerate(batch):
            if len(tokens) == 1:
                continue
            start = cache.length(sid)
            x = self.emb[tokens] + self.pos[start : start + len(tokens)]
            for layer in range(self.layers):
                k = self._heads(x, self.wk[layer], self.hkv)
                v = self._heads(x, self.wv[layer], self.hkv)
                cache.append(sid, k, v, layer=layer, tokens=tokens if layer == 0 else None)
                q = self._heads(x, self.wq[layer], self.hq)[None]
                o = cache.attention(q, [sid], layer=layer, causal=True, num_splits=1)[0]
                x = x + o.transpose(1, 0, 2).reshape(len(tokens), self.width)
            logits[i] = x[-1] @ self.out
        return logits
