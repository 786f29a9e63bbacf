"""Plain float64 NumPy attention: the oracle flashport is tested against.

It materialises the full ``seq_q × seq_k`` score matrix, so use it on small
problems. Same signatures and semantics as :func:`flashport.attention` and
:func:`flashport.attention_backward` (without ``device``); every result is
float64.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = ["attention", "attention_backward"]


def _as_4d(x: npt.ArrayLike, dtype: npt.DTypeLike) -> tuple[np.ndarray, tuple[int, ...]]:
    array = np.asarray(x, dtype=dtype)
    if array.ndim not in (2, 3, 4):
        raise ValueError(f"expected 2, 3 or 4 dimensions, got shape {array.shape}")
    return array.reshape((1,) * (4 - array.ndim) + array.shape), array.shape


def _scores(q4, k4, causal, scale):
    """Scaled scores with the key/value heads repeated over their query group,
    and the visibility mask (True = the query sees the key)."""
    heads_q, heads_kv = q4.shape[1], k4.shape[1]
    if heads_q % heads_kv:
        raise ValueError(f"heads_kv={heads_kv} does not divide heads_q={heads_q}")
    group = heads_q // heads_kv
    k_rep = np.repeat(k4, group, axis=1)
    d = q4.shape[-1]
    scale = 1.0 / np.sqrt(d) if scale is None else float(scale)
    s = (q4 @ k_rep.swapaxes(-1, -2)) * q4.dtype.type(scale)
    seq_q, seq_k = q4.shape[2], k4.shape[2]
    if causal:
        i = np.arange(seq_q)[:, None]
        j = np.arange(seq_k)[None, :]
        visible = j <= i + (seq_k - seq_q)
    else:
        visible = np.ones((seq_q, seq_k), dtype=bool)
    return s, np.broadcast_to(visible, s.shape), group, scale


def _probabilities(s, visible):
    """Row softmax over visible keys; rows with no visible key are all 0,
    with log-sum-exp -inf."""
    masked = np.where(visible, s, -np.inf)
    row_max = masked.max(axis=-1, keepdims=True) if masked.shape[-1] else None
    if row_max is None:
        shape = masked.shape[:-1]
        return np.zeros(masked.shape, s.dtype), np.full(shape, -np.inf, s.dtype)
    safe_max = np.where(np.isfinite(row_max), row_max, s.dtype.type(0))
    e = np.where(visible, np.exp(masked - safe_max), s.dtype.type(0))
    total = e.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        lse = np.where(total > 0, np.log(total) + safe_max, s.dtype.type(-np.inf))[..., 0]
        p = np.where(total > 0, e / np.where(total > 0, total, s.dtype.type(1)), s.dtype.type(0))
    return p, lse


def attention(q, k, v, *, causal=False, scale=None, return_lse=False):
    """``softmax(scale · q kᵀ) v`` in float64; see :func:`flashport.attention`."""
    return _attention(q, k, v, causal, scale, return_lse, np.float64)


def _attention(q, k, v, causal, scale, return_lse, dtype):
    """The reference computed in ``dtype``: in float64 the oracle, in float32
    the naive same-precision implementation that test tolerances are
    measured against."""
    q4, q_shape = _as_4d(q, dtype)
    k4, _ = _as_4d(k, dtype)
    v4, _ = _as_4d(v, dtype)
    s, visible, group, _ = _scores(q4, k4, causal, scale)
    p, lse = _probabilities(s, visible)
    out = p @ np.repeat(v4, group, axis=1)
    out = out.reshape((*q_shape[:-1], v4.shape[-1]))
    lse = lse.reshape(q_shape[:-1])
    return (out, lse) if return_lse else out


def attention_backward(do, q, k, v, o=None, lse=None, *, causal=False, scale=None):
    """Analytic gradients ``(dq, dk, dv)`` of :func:`attention` in float64.

    ``o`` and ``lse`` are accepted for signature compatibility with
    :func:`flashport.attention_backward` and ignored: the oracle recomputes
    everything from ``q``, ``k`` and ``v`` in float64.
    """
    del o, lse
    return _attention_backward(do, q, k, v, causal, scale, np.float64)


def _attention_backward(do, q, k, v, causal, scale, dtype):
    q4, q_shape = _as_4d(q, dtype)
    k4, k_shape = _as_4d(k, dtype)
    v4, v_shape = _as_4d(v, dtype)
    do4 = np.asarray(do, dtype=dtype).reshape((*q4.shape[:3], v4.shape[-1]))
    s, visible, group, scale = _scores(q4, k4, causal, scale)
    p, _ = _probabilities(s, visible)
    v_rep = np.repeat(v4, group, axis=1)
    k_rep = np.repeat(k4, group, axis=1)
    dv_rep = p.swapaxes(-1, -2) @ do4
    dp = do4 @ v_rep.swapaxes(-1, -2)
    # D = rowsum(dP ∘ P) = rowsum(dO ∘ O); the second form is the one
    # FlashAttention uses, so the same-precision baselines round alike.
    out = p @ v_rep
    ds = p * (dp - (do4 * out).sum(axis=-1, keepdims=True))
    dq = (ds @ k_rep) * q4.dtype.type(scale)
    dk_rep = (ds.swapaxes(-1, -2) @ q4) * q4.dtype.type(scale)

    def fold(x):
        b, _, n, width = x.shape
        return x.reshape(b, -1, group, n, width).sum(axis=2)

    return (
        dq.reshape(q_shape),
        fold(dk_rep).reshape(k_shape),
        fold(dv_rep).reshape(v_shape),
    )
