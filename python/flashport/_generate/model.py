"""A small decoder-only transformer in NumPy (Llama's shape: pre-norm
RMSNorm, attention with rotary position embeddings and grouped-query heads,
a SwiGLU MLP, a final norm and an LM head) with random weights, run two
ways:

* :meth:`Model.forward_cached`, in float32 through a :class:`flashport.KVCache`:
  each layer appends the new positions' keys and values of all sequences
  with one ``cache.append_batch`` call and attends over the cache with one
  batched ``cache.attention`` call;
* :meth:`Model.forward_full`, the whole sequence at once without a cache,
  in float64 with plain NumPy attention: the oracle every cached step is
  checked against.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import flashport


@dataclass(frozen=True)
class Config:
    vocab: int = 512
    d_model: int = 256
    heads_q: int = 8
    heads_kv: int = 2
    head_dim: int = 32
    hidden: int = 512
    layers: int = 2
    rope_base: float = 10000.0
    norm_eps: float = 1e-5


def rope(x: np.ndarray, positions: np.ndarray, base: float = 10000.0) -> np.ndarray:
    """Rotary position embedding, the rotate-half convention (GPT-NeoX,
    Llama): dimension ``i < d/2`` pairs with ``i + d/2`` and the pair at
    position ``p`` turns by ``p · base**(-2i/d)``. ``x`` is ``(..., seq, d)``,
    ``positions`` broadcasts against ``(..., seq)``. The angles are computed
    in float64 and rounded once to ``x``'s dtype, so the float32 and float64
    paths rotate by the same angles."""
    half = x.shape[-1] // 2
    inv_freq = base ** (-np.arange(half, dtype=np.float64) * 2.0 / x.shape[-1])
    angles = np.asarray(positions, dtype=np.float64)[..., None] * inv_freq
    cos, sin = np.cos(angles).astype(x.dtype), np.sin(angles).astype(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def _rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    ms = np.mean(np.square(x), axis=-1, keepdims=True)
    return x / np.sqrt(ms + x.dtype.type(eps)) * weight


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1 + np.exp(-x))


class Model:
    """Random weights from ``seed``, scaled by ``1/sqrt(fan_in)`` so the
    activations stay of order one through the layers, and norm gains drawn
    around 1 (not all ones, so a skipped norm weight shows)."""

    def __init__(self, config: Config, seed: int = 0) -> None:
        if config.heads_q % config.heads_kv or config.head_dim % 2:
            raise ValueError(f"{config}: heads_q must be a multiple of heads_kv, head_dim even")
        self.config = c = config
        rng = np.random.default_rng(seed)

        def dense(fan_in: int, fan_out: int) -> np.ndarray:
            return (rng.standard_normal((fan_in, fan_out)) / np.sqrt(fan_in)).astype(np.float32)

        def gain(n: int) -> np.ndarray:
            return (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)

        self.embed = rng.standard_normal((c.vocab, c.d_model)).astype(np.float32)
        self.layers = [
            {
                "attn_norm": gain(c.d_model),
                "wq": dense(c.d_model, c.heads_q * c.head_dim),
                "wk": dense(c.d_model, c.heads_kv * c.head_dim),
                "wv": dense(c.d_model, c.heads_kv * c.head_dim),
                "wo": dense(c.heads_q * c.head_dim, c.d_model),
                "mlp_norm": gain(c.d_model),
                "w_gate": dense(c.d_model, c.hidden),
                "w_up": dense(c.d_model, c.hidden),
                "w_down": dense(c.hidden, c.d_model),
            }
            for _ in range(c.layers)
        ]
        self.final_norm = gain(c.d_model)
        self.lm_head = dense(c.d_model, c.vocab)
        # The oracle's weights: the same values, widened once.
        self._wide_head = {"final_norm": _wide(self.final_norm), "lm_head": _wide(self.lm_head)}
        self._wide_layers = [{k: _wide(a) for k, a in w.items()} for w in self.layers]

    def new_cache(self, num_blocks: int, block_size: int, device: str) -> flashport.KVCache:
        c = self.config
        return flashport.KVCache(
            num_blocks,
            block_size,
            c.heads_kv,
            c.head_dim,
            layers=c.layers,
            dtype=np.float32,
            device=device,
        )

    def _mlp(self, h: np.ndarray, w: dict) -> np.ndarray:
        x = _rms_norm(h, (w["mlp_norm"]), self.config.norm_eps)
        return (_silu(x @ (w["w_gate"])) * (x @ (w["w_up"]))) @ (w["w_down"])

    def _qkv(self, h: np.ndarray, w: dict, positions: np.ndarray):
        """``h (B, n, d_model)`` → q ``(B, heads_q, n, d)`` and k, v ``(B,
        heads_kv, n, d)``, q and k rotated to their positions ``(B, n)``."""
        c = self.config
        b, n, _ = h.shape
        x = _rms_norm(h, (w["attn_norm"]), c.norm_eps)

        def heads(y: np.ndarray, count: int) -> np.ndarray:
            return y.reshape(b, n, count, c.head_dim).transpose(0, 2, 1, 3)

        q = heads(x @ (w["wq"]), c.heads_q)
        k = heads(x @ (w["wk"]), c.heads_kv)
        v = heads(x @ (w["wv"]), c.heads_kv)
        pos = positions[:, None, :]
        return rope(q, pos, c.rope_base), rope(k, pos, c.rope_base), v

    def _out(self, o: np.ndarray, w: dict) -> np.ndarray:
        b, _, n, _ = o.shape
        return o.transpose(0, 2, 1, 3).reshape(b, n, -1) @ (w["wo"])

    def _logits(self, h: np.ndarray, final_norm: np.ndarray, lm_head: np.ndarray) -> np.ndarray:
        return _rms_norm(h, final_norm, self.config.norm_eps) @ lm_head

    def forward_cached(
        self, cache: flashport.KVCache, seq_ids: list[int], tokens: np.ndarray
    ) -> np.ndarray:
        """The next positions of the sequences ``seq_ids``: ``tokens (B, n)``
        (a prompt's prefill, or one token each when decoding), appended to the
        cache at each sequence's length. Returns the float32 logits ``(B, n,
        vocab)``. Token ids go with the first layer's appends, so the cache
        knows every sequence's tokens (prefix reuse)."""
        tokens = np.asarray(tokens, dtype=np.int64)
        n = tokens.shape[1]
        start = np.array([cache.length(s) for s in seq_ids], dtype=np.int64)
        positions = start[:, None] + np.arange(n)
        h = self.embed[tokens]
        for layer, w in enumerate(self.layers):
            q, k, v = self._qkv(h, w, positions)
            # One call for the batch: the same as appending to each sequence
            # in order (distinct sequences, the same n for all).
            cache.append_batch(seq_ids, k, v, layer=layer, tokens=tokens if layer == 0 else None)
            o = cache.attention(q, seq_ids, layer=layer)
            h = h + self._out(o, w)
            h = h + self._mlp(h, w)
        return self._logits(h, self.final_norm, self.lm_head)

    def forward_full(self, tokens: np.ndarray) -> np.ndarray:
        """The no-cache oracle: whole sequences ``tokens (B, T)`` at once,
        causal, in float64 (weights widened), attention written out.
        Returns the logits ``(B, T, vocab)``."""
        c = self.config
        tokens = np.asarray(tokens, dtype=np.int64)
        b, t = tokens.shape
        positions = np.broadcast_to(np.arange(t), (b, t))
        h = _wide(self.embed[tokens])
        group = c.heads_q // c.heads_kv
        mask = np.tril(np.ones((t, t), dtype=bool))
        for w in self._wide_layers:
            q, k, v = self._qkv(h, w, positions)
            k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
            s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(c.head_dim)
            s = np.where(mask, s, -np.inf)
            p = np.exp(s - s.max(axis=-1, keepdims=True))
            o = (p / p.sum(axis=-1, keepdims=True)) @ v
            h = h + self._out(o, w)
            h = h + self._mlp(h, w)
        return self._logits(h, self._wide_head["final_norm"], self._wide_head["lm_head"])


def _wide(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float64)
