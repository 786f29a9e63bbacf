"""Plain float64 NumPy attention: the oracle flashport is tested against.

It materialises the full ``seq_q × seq_k`` score matrix, so use it on small
problems. Same signatures and semantics as :func:`flashport.attention` and
:func:`flashport.attention_backward` (without ``device``), variants
included; every result is float64.

The score of batch ``b``, query head ``h``, row ``i`` and key ``j``, with
``off = q_offset - k_offset`` (by default ``seq_k - seq_q``; see
rust/flashport-core/src/variants.rs)::

    u   = scale · q[b,h,i] · k[b,h/g,j]
    t   = softcap · tanh(u / softcap)             (t = u without softcap)
    s   = t - slope[b,h] · |i + off - j| + mask[b,h,i,j]
    s   = -inf where causal, the window or a boolean mask hides the key
    lse = log(Σ_j exp(s_j) + exp(sink[h]))
    P   = exp(s - lse),  Z = keep / (1 - p),  o = Σ_j P_j Z_j v_j

Non-finite inputs follow docs/design.md#non-finite-inputs: a hidden key
never contributes, whatever its ``k`` and ``v`` hold; a visible NaN score
(or sink) gives ``lse = NaN``, else a visible ``+inf`` one ``lse = +inf``,
and either gives ``o = NaN``; a NaN or infinity in the ``v`` of a visible
key makes the row's ``o`` NaN; ``o = 0`` exactly when ``lse = -inf``.

:func:`dropout_keep` regenerates the dropout mask (Philox4x32-10) exactly
as every backend does.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = [
    "attention",
    "attention_backward",
    "attention_varlen",
    "attention_varlen_backward",
    "attention_with_kvcache",
    "cached_sequence",
    "dropout_keep",
    "philox4x32_10",
]

# Philox4x32 constants (Salmon et al., SC 2011), as in variants.rs.
_PHILOX_M0 = np.uint64(0xD2511F53)
_PHILOX_M1 = np.uint64(0xCD9E8D57)
_PHILOX_W0 = 0x9E3779B9
_PHILOX_W1 = 0xBB67AE85
_LOW32 = np.uint64(0xFFFFFFFF)
_SHIFT32 = np.uint64(32)


def philox4x32_10(counter, key) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Philox4x32 with 10 rounds, vectorised: ``counter`` is four arrays (or
    ints) of 32-bit words that broadcast together, ``key`` two ints. Returns
    the four output words as uint64 arrays holding 32-bit values."""
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) & _LOW32 for c in counter)
    k0, k1 = (int(x) & 0xFFFFFFFF for x in key)
    for round_ in range(10):
        if round_ > 0:
            k0 = (k0 + _PHILOX_W0) & 0xFFFFFFFF
            k1 = (k1 + _PHILOX_W1) & 0xFFFFFFFF
        # Both factors are < 2**32, so the products are exact in uint64.
        p0 = _PHILOX_M0 * c0
        p1 = _PHILOX_M1 * c2
        c0, c1, c2, c3 = (
            (p1 >> _SHIFT32) ^ c1 ^ np.uint64(k0),
            p1 & _LOW32,
            (p0 >> _SHIFT32) ^ c3 ^ np.uint64(k1),
            p0 & _LOW32,
        )
    return c0, c1, c2, c3


def dropout_keep(seed: int, p: float, shape: tuple[int, int, int, int]) -> np.ndarray:
    """The dropout mask of ``attention(..., dropout_p=p, seed=seed)``: a bool
    array of ``shape = (batch, heads_q, seq_q, seq_k)``, True where the
    probability is kept.

    Score ``(b, h, i, j)`` is kept when word ``j % 4`` of
    ``philox4x32_10([j // 4, i, b·heads_q + h, 0], [seed & 0xffffffff,
    seed >> 32])`` is at least ``floor(p · 2**32)``: the kept fraction is
    ``1 - floor(p · 2**32) / 2**32``. ``p = 0`` keeps everything."""
    seed = int(seed)
    if not 0 <= seed < 2**64:
        raise ValueError(f"seed={seed} must be in [0, 2**64)")
    if not 0.0 <= p < 1.0:
        raise ValueError(f"p={p} must be in [0, 1)")
    batch, heads_q, seq_q, seq_k = shape
    threshold = np.uint64(int(np.floor(float(p) * 2.0**32)))
    groups = -(-seq_k // 4)
    bh = np.arange(batch * heads_q, dtype=np.uint64)[:, None, None]
    row = np.arange(seq_q, dtype=np.uint64)[None, :, None]
    group = np.arange(groups, dtype=np.uint64)[None, None, :]
    words = philox4x32_10((group, row, bh, 0), (seed & 0xFFFFFFFF, seed >> 32))
    words = np.broadcast_arrays(*words)
    # (bh, row, group, word) -> key j = 4 · group + word.
    stacked = np.stack(words, axis=-1).reshape(batch * heads_q, seq_q, groups * 4)
    return (stacked[..., :seq_k] >= threshold).reshape(shape)


def _as_4d(x: npt.ArrayLike, dtype: npt.DTypeLike) -> tuple[np.ndarray, tuple[int, ...]]:
    array = np.asarray(x, dtype=dtype)
    if array.ndim not in (2, 3, 4):
        raise ValueError(f"expected 2, 3 or 4 dimensions, got shape {array.shape}")
    return array.reshape((1,) * (4 - array.ndim) + array.shape), array.shape


def _matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a @ b`` in the operands' dtype. NumPy keeps float16/32/64 products in
    their dtype, but ml_dtypes' bfloat16 products come back as float32: a
    naive bfloat16 implementation rounds them (float32 accumulation, one
    rounding per product, as bfloat16 hardware does)."""
    # NaN and infinities in the inputs (docs/design.md#non-finite-inputs)
    # give NaN products without a warning.
    with np.errstate(invalid="ignore"):
        return np.matmul(a, b).astype(np.result_type(a.dtype, b.dtype), copy=False)


def _window_sides(window):
    if window is None:
        return None, None
    left, right = window
    left = None if left is None or left == -1 else int(left)
    right = None if right is None or right == -1 else int(right)
    return left, right


def _diagonal_offset(seq_q, seq_k, q_offset, k_offset) -> int:
    """``off = q_offset - k_offset`` with the defaults (bottom-right)."""
    q_offset = seq_k - seq_q if q_offset is None else int(q_offset)
    k_offset = 0 if k_offset is None else int(k_offset)
    return q_offset - k_offset


def _visible(seq_q, seq_k, causal, window, off) -> np.ndarray:
    """``(seq_q, seq_k)``, True where causal and the window show the key;
    each row's bounds are computed in Python integers, exact for any
    offsets."""
    left, right = _window_sides(window)
    starts, ends = [], []
    for i in range(seq_q):
        diagonal = i + off
        end = seq_k
        if causal:
            end = min(end, diagonal + 1)
        if right is not None:
            end = min(end, diagonal + right + 1)
        start = 0 if left is None else max(0, diagonal - left)
        ends.append(max(0, end))
        starts.append(min(start, seq_k))
    j = np.arange(seq_k)
    start = np.array(starts, dtype=np.int64).reshape(-1, 1)
    end = np.array(ends, dtype=np.int64).reshape(-1, 1)
    return (j >= start) & (j < end)


def _distance(seq_q, seq_k, off, dtype) -> np.ndarray:
    """``|i + off - j|`` as ``dtype``: exact integers, rounded once."""
    if abs(off) + seq_q + seq_k < 2**62:
        i = np.arange(seq_q)[:, None]
        j = np.arange(seq_k)[None, :]
        return np.abs(i + off - j).astype(dtype)
    exact = [[abs(i + off - j) for j in range(seq_k)] for i in range(seq_q)]
    return np.array(exact, dtype=object).reshape(seq_q, seq_k).astype(dtype)


def _scores(
    q4,
    k4,
    causal,
    scale,
    *,
    window=None,
    mask=None,
    alibi_slopes=None,
    softcap=None,
    q_offset=None,
    k_offset=None,
):
    """Scores with the key heads repeated over their query group, and the
    visibility mask (True = the query sees the key), both
    ``(batch, heads_q, seq_q, seq_k)``.

    Returns ``(s, visible, group, scale, extras)``; ``s`` holds the final
    scores ``t + alibi + mask`` (finite values also where hidden, except
    where a float mask is ``-inf``) and ``extras`` the pre-softcap scores
    ``u`` and ``tanh(u / softcap)`` (None without softcap)."""
    dtype = q4.dtype.type
    batch, heads_q, seq_q, _ = q4.shape
    heads_kv, seq_k = k4.shape[1], k4.shape[2]
    if heads_q % heads_kv:
        raise ValueError(f"heads_kv={heads_kv} does not divide heads_q={heads_q}")
    group = heads_q // heads_kv
    k_rep = np.repeat(k4, group, axis=1)
    d = q4.shape[-1]
    scale = 1.0 / np.sqrt(d) if scale is None else float(scale)
    u = _matmul(q4, k_rep.swapaxes(-1, -2)) * dtype(scale)
    tanh = None
    if softcap:
        cap = dtype(softcap)
        tanh = np.tanh(u / cap)
        s = cap * tanh
    else:
        s = u
    off = _diagonal_offset(seq_q, seq_k, q_offset, k_offset)
    visible = _visible(seq_q, seq_k, causal, window, off)
    visible = np.broadcast_to(visible, (batch, heads_q, seq_q, seq_k))
    if alibi_slopes is not None:
        slopes = np.asarray(alibi_slopes, dtype=q4.dtype)
        slopes = np.broadcast_to(slopes.reshape((-1, heads_q))[:, :, None, None], s.shape)
        s = s - slopes * _distance(seq_q, seq_k, off, q4.dtype)
    if mask is not None:
        mask = np.asarray(mask)
        if mask.dtype == np.bool_:
            visible = visible & mask
        else:
            m = mask.astype(q4.dtype)
            with np.errstate(invalid="ignore"):
                s = s + m
            visible = visible & (m != -np.inf)
    visible = np.broadcast_to(visible, s.shape)
    return s, visible, group, scale, (u, tanh)


def _probabilities(s, visible, sinks=None):
    """Row softmax over visible keys (and the sink logit of each head in the
    denominator): probabilities, and the log-sum-exp. Rows with no visible
    key have probabilities 0, lse = sink (or -inf without sinks).

    Non-finite scores follow docs/design.md#non-finite-inputs: a visible
    NaN score (or a NaN sink) makes the row's lse NaN, else a visible
    ``+inf`` score (or sink) makes it ``+inf``; such a row's probabilities
    are NaN at every visible key. A visible ``-inf`` score weighs 0."""
    zero = s.dtype.type(0)
    nan = s.dtype.type(np.nan)
    with np.errstate(invalid="ignore"):
        finite = visible & np.isfinite(s)
        nan_row = (visible & np.isnan(s)).any(axis=-1, keepdims=True)
        inf_row = (visible & (s == np.inf)).any(axis=-1, keepdims=True)
    masked = np.where(finite, s, s.dtype.type(-np.inf))
    if masked.shape[-1]:
        row_max = masked.max(axis=-1, keepdims=True)
    else:
        row_max = np.full((*masked.shape[:-1], 1), -np.inf, s.dtype)
    sink = None
    if sinks is not None:
        sink = np.asarray(sinks, dtype=s.dtype)[None, :, None, None]
        sink = np.broadcast_to(sink, row_max.shape)
        nan_row = nan_row | np.isnan(sink)
        inf_row = inf_row | (sink == np.inf)
        sink = np.where(np.isfinite(sink), sink, s.dtype.type(-np.inf))
        row_max = np.maximum(row_max, sink)
    safe_max = np.where(np.isfinite(row_max), row_max, zero)
    with np.errstate(invalid="ignore"):
        e = np.where(finite, np.exp(masked - safe_max), zero)
    total = e.sum(axis=-1, keepdims=True)
    if sink is not None:
        total = total + np.exp(sink - safe_max)
    with np.errstate(divide="ignore"):
        lse = np.where(total > 0, np.log(total) + safe_max, s.dtype.type(-np.inf))
        p = np.where(total > 0, e / np.where(total > 0, total, s.dtype.type(1)), zero)
    lse = np.where(inf_row, s.dtype.type(np.inf), lse)
    lse = np.where(nan_row, nan, lse)
    p = np.where((nan_row | inf_row) & visible, nan, p)
    return p, lse[..., 0]


def _bad_rows(x: np.ndarray) -> np.ndarray:
    """``x[..., j, :]`` holds a NaN or an infinity: ``x.shape[:-1]``."""
    return ~np.isfinite(x).all(axis=-1)


def _clean(x: np.ndarray) -> np.ndarray:
    """``x`` with every NaN and infinity replaced by 0."""
    return np.where(np.isfinite(x), x, x.dtype.type(0))


def _visible_product(w, visible, x, live=None):
    """``Σ_j w_ij x_j`` over the visible pairs only: a hidden pair adds
    nothing whatever ``x_j`` holds, and a NaN or infinity in an ``x_j``
    that a visible pair reads makes row ``i`` NaN, all of it (rows where
    ``live`` is False excepted). ``w`` is ``(..., n, m)``, ``x`` ``(..., m,
    width)``."""
    out = _matmul(w, _clean(x))
    bad = _bad_rows(x)
    if bad.any():
        poisoned = (visible & bad[..., None, :]).any(axis=-1)
        if live is not None:
            poisoned &= live
        out = np.where(poisoned[..., None], out.dtype.type(np.nan), out)
    return out


def _dropout_factor(shape, dropout_p, seed, dtype, keep=None):
    """Z = keep / (1 - p), or None without dropout; ``keep`` overrides the
    call's own mask (a packed batch's sequences draw theirs from the
    packed positions)."""
    if not dropout_p:
        return None
    if seed is None:
        raise ValueError(f"dropout_p={dropout_p} needs a seed")
    if keep is None:
        keep = dropout_keep(seed, dropout_p, shape)
    return np.where(keep, dtype(1) / (dtype(1) - dtype(dropout_p)), dtype(0))


def attention(
    q,
    k,
    v,
    *,
    causal=False,
    scale=None,
    window=None,
    mask=None,
    alibi_slopes=None,
    softcap=None,
    sinks=None,
    dropout_p=0.0,
    seed=None,
    q_offset=None,
    k_offset=None,
    return_lse=False,
):
    """``softmax(scale · q kᵀ) v`` with the variants, in float64; see
    :func:`flashport.attention`."""
    return _attention(
        q,
        k,
        v,
        causal,
        scale,
        return_lse,
        np.float64,
        window=window,
        mask=mask,
        alibi_slopes=alibi_slopes,
        softcap=softcap,
        sinks=sinks,
        dropout_p=dropout_p,
        seed=seed,
        q_offset=q_offset,
        k_offset=k_offset,
    )


def _attention(
    q,
    k,
    v,
    causal,
    scale,
    return_lse,
    dtype,
    *,
    window=None,
    mask=None,
    alibi_slopes=None,
    softcap=None,
    sinks=None,
    dropout_p=0.0,
    seed=None,
    q_offset=None,
    k_offset=None,
    _keep=None,
):
    """The reference computed in ``dtype``: in float64 the oracle, in float32
    the naive same-precision implementation that test tolerances are
    measured against."""
    q4, q_shape = _as_4d(q, dtype)
    k4, _ = _as_4d(k, dtype)
    v4, _ = _as_4d(v, dtype)
    s, visible, group, _, _ = _scores(
        q4,
        k4,
        causal,
        scale,
        window=window,
        mask=mask,
        alibi_slopes=alibi_slopes,
        softcap=softcap,
        q_offset=q_offset,
        k_offset=k_offset,
    )
    p, lse = _probabilities(s, visible, sinks)
    z = _dropout_factor(p.shape, dropout_p, seed, q4.dtype.type, _keep)
    pz = p if z is None else p * z
    # A row that sees no key has o = 0, whatever its keys' values hold.
    out = _visible_product(pz, visible, np.repeat(v4, group, axis=1), lse != -np.inf)
    out = out.reshape((*q_shape[:-1], v4.shape[-1]))
    lse = lse.reshape(q_shape[:-1])
    return (out, lse) if return_lse else out


def attention_backward(
    do,
    q,
    k,
    v,
    o=None,
    lse=None,
    *,
    causal=False,
    scale=None,
    window=None,
    mask=None,
    alibi_slopes=None,
    softcap=None,
    sinks=None,
    dropout_p=0.0,
    seed=None,
    q_offset=None,
    k_offset=None,
    return_dmask=False,
):
    """Analytic gradients of :func:`attention` in float64: ``(dq, dk, dv)``,
    then ``dsinks`` if ``sinks`` is given, then ``dmask`` (in the float
    mask's shape, summed over the dimensions it broadcasts along) with
    ``return_dmask=True``; like :func:`flashport.attention_backward`.

    ``o`` and ``lse`` are accepted for signature compatibility and ignored:
    the oracle recomputes everything from ``q``, ``k`` and ``v`` in float64.
    """
    del o, lse
    return _attention_backward(
        do,
        q,
        k,
        v,
        causal,
        scale,
        np.float64,
        window=window,
        mask=mask,
        alibi_slopes=alibi_slopes,
        softcap=softcap,
        sinks=sinks,
        dropout_p=dropout_p,
        seed=seed,
        q_offset=q_offset,
        k_offset=k_offset,
        return_dmask=return_dmask,
    )


def _reduce_to_shape(full, shape):
    """Sums a ``(batch, heads_q, seq_q, seq_k)`` array over the dimensions
    an array of ``shape`` broadcasts along, giving ``shape``."""
    padded = (1,) * (4 - len(shape)) + tuple(shape)
    axes = tuple(a for a in range(4) if padded[a] == 1 and full.shape[a] != 1)
    return full.sum(axis=axes, keepdims=True).reshape(shape)


def _attention_backward(
    do,
    q,
    k,
    v,
    causal,
    scale,
    dtype,
    *,
    window=None,
    mask=None,
    alibi_slopes=None,
    softcap=None,
    sinks=None,
    dropout_p=0.0,
    seed=None,
    q_offset=None,
    k_offset=None,
    return_dmask=False,
    _keep=None,
):
    q4, q_shape = _as_4d(q, dtype)
    k4, k_shape = _as_4d(k, dtype)
    v4, v_shape = _as_4d(v, dtype)
    do4 = np.asarray(do, dtype=dtype).reshape((*q4.shape[:3], v4.shape[-1]))
    s, visible, group, scale, (_, tanh) = _scores(
        q4,
        k4,
        causal,
        scale,
        window=window,
        mask=mask,
        alibi_slopes=alibi_slopes,
        softcap=softcap,
        q_offset=q_offset,
        k_offset=k_offset,
    )
    p, lse = _probabilities(s, visible, sinks)
    z = _dropout_factor(p.shape, dropout_p, seed, q4.dtype.type, _keep)
    pz = p if z is None else p * z
    v_rep = np.repeat(v4, group, axis=1)
    k_rep = np.repeat(k4, group, axis=1)
    nan = q4.dtype.type(np.nan)
    zero = q4.dtype.type(0)
    # D = rowsum(dO ∘ O), the form FlashAttention uses, so the same-precision
    # baselines round alike.
    live = lse != -np.inf
    out = _visible_product(pz, visible, v_rep, live)
    with np.errstate(invalid="ignore", over="ignore"):
        delta = (do4 * out).sum(axis=-1, keepdims=True)
        dp = _matmul(do4, v_rep.swapaxes(-1, -2))
    if z is not None:
        dp = dp * z
    # A row that saw no key contributes nothing; one whose lse or D is not
    # finite (a NaN or +inf score, a NaN o or dO) carries NaN through every
    # pair it sees (docs/design.md#non-finite-inputs).
    seen = visible & live[..., None]
    bad_row = live & ~(np.isfinite(lse) & np.isfinite(delta[..., 0]))
    poisoned = bad_row[..., None] & seen
    p = np.where(poisoned, nan, p)
    pz = np.where(poisoned, nan, pz)
    with np.errstate(invalid="ignore"):
        ds = np.where(seen, p * (dp - delta), zero)
        du = ds if tanh is None else np.where(seen, ds * (q4.dtype.type(1) - tanh * tanh), zero)
    dq = _visible_product(du, seen, k_rep) * q4.dtype.type(scale)
    dk_rep = _visible_product(du.swapaxes(-1, -2), seen.swapaxes(-1, -2), q4)
    dk_rep = dk_rep * q4.dtype.type(scale)
    dv_rep = _visible_product(pz.swapaxes(-1, -2), seen.swapaxes(-1, -2), do4)

    def fold(x):
        b, h, n, width = x.shape
        return x.reshape(b, h // group, group, n, width).sum(axis=2)

    grads = [
        dq.reshape(q_shape),
        fold(dk_rep).reshape(k_shape),
        fold(dv_rep).reshape(v_shape),
    ]
    if sinks is not None:
        sink = np.asarray(sinks, dtype=q4.dtype)[None, :, None]
        row_delta = delta[..., 0]
        ok = np.isfinite(lse) & np.isfinite(row_delta)
        with np.errstate(invalid="ignore", over="ignore"):
            weight = np.exp(sink - np.where(ok, lse, zero)) * np.where(ok, row_delta, zero)
        weight = np.where(ok, weight, nan)
        grads.append(-np.where(live, weight, zero).sum(axis=(0, 2)))
    if return_dmask:
        if mask is None or np.asarray(mask).dtype == np.bool_:
            raise ValueError("return_dmask needs a float mask")
        # A pair whose key holds a NaN or an infinity has a NaN score
        # gradient (its score is -inf, NaN or +inf).
        ds = np.where(seen & _bad_rows(k_rep)[..., None, :], nan, ds)
        grads.append(_reduce_to_shape(ds, np.shape(mask)))
    return tuple(grads)


# Packed batches of variable-length sequences (flash-attn's varlen layout),
# each sequence computed on its own by the functions above.


def _sequences(cu_seqlens_q, cu_seqlens_k):
    cu_q = [int(x) for x in np.asarray(cu_seqlens_q).reshape(-1)]
    cu_k = [int(x) for x in np.asarray(cu_seqlens_k).reshape(-1)]
    if len(cu_q) != len(cu_k) or not cu_q or cu_q[0] != 0 or cu_k[0] != 0:
        raise ValueError(f"bad prefix sums {cu_q}, {cu_k}")
    return [
        (slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])) for b in range(len(cu_q) - 1)
    ]


def _packed_keep(seed, p, heads_q, rows, keys):
    """The dropout mask of one sequence of a packed batch, ``(1, heads_q,
    seq_q, seq_k)``: the Philox counter takes the packed row and key
    indices and the head (as :func:`dropout_keep` does for one array)."""
    threshold = np.uint64(int(np.floor(float(p) * 2.0**32)))
    seed = int(seed)
    bh = np.arange(heads_q, dtype=np.uint64)[:, None, None]
    row = np.arange(rows.start, rows.stop, dtype=np.uint64)[None, :, None]
    key = np.arange(keys.start, keys.stop, dtype=np.uint64)[None, None, :]
    words = philox4x32_10((key // np.uint64(4), row, bh, 0), (seed & 0xFFFFFFFF, seed >> 32))
    words = np.broadcast_arrays(*words)
    stacked = np.stack(words, axis=-1)
    word = np.broadcast_to(key % np.uint64(4), stacked.shape[:-1]).astype(np.intp)
    chosen = np.take_along_axis(stacked, word[..., None], axis=-1)[..., 0]
    return (chosen >= threshold)[None]


def _varlen_kwargs(b, heads_q, rows, keys, alibi_slopes, dropout_p, seed, kwargs):
    """One sequence's keywords: its slopes, and its block of the packed
    dropout mask."""
    kw = dict(kwargs)
    if alibi_slopes is not None:
        slopes = np.asarray(alibi_slopes)
        kw["alibi_slopes"] = slopes[b] if slopes.ndim == 2 else slopes
    if dropout_p:
        kw["dropout_p"] = dropout_p
        kw["seed"] = seed
        kw["_keep"] = _packed_keep(seed, dropout_p, heads_q, rows, keys)
    return kw


def _attention_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    causal,
    scale,
    dtype,
    *,
    alibi_slopes=None,
    dropout_p=0.0,
    seed=None,
    **kwargs,
):
    """:func:`attention_varlen` computed in ``dtype``: ``(o, lse)``."""
    q, k, v = (np.asarray(x, dtype=dtype) for x in (q, k, v))
    heads_q = q.shape[1]
    out = np.zeros((q.shape[0], heads_q, v.shape[2]), dtype)
    lse = np.full((heads_q, q.shape[0]), -np.inf, dtype)
    for b, (rows, keys) in enumerate(_sequences(cu_seqlens_q, cu_seqlens_k)):
        if rows.stop == rows.start:
            continue
        kw = _varlen_kwargs(b, heads_q, rows, keys, alibi_slopes, dropout_p, seed, kwargs)
        o_b, lse_b = _attention(
            q[rows].transpose(1, 0, 2),
            k[keys].transpose(1, 0, 2),
            v[keys].transpose(1, 0, 2),
            causal,
            scale,
            True,
            dtype,
            **kw,
        )
        out[rows] = o_b.transpose(1, 0, 2)
        lse[:, rows] = lse_b
    return out, lse


def attention_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    *,
    causal=False,
    scale=None,
    window=None,
    alibi_slopes=None,
    softcap=None,
    sinks=None,
    dropout_p=0.0,
    seed=None,
    return_lse=False,
):
    """:func:`attention` of each sequence of a packed batch, in float64; see
    :func:`flashport.attention_varlen` (``q (total_q, heads_q, d)``, ``o
    (total_q, heads_q, d_v)``, ``lse (heads_q, total_q)``)."""
    out, lse = _attention_varlen(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        causal,
        scale,
        np.float64,
        window=window,
        alibi_slopes=alibi_slopes,
        softcap=softcap,
        sinks=sinks,
        dropout_p=dropout_p,
        seed=seed,
    )
    return (out, lse) if return_lse else out


def _attention_varlen_backward(
    do,
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    causal,
    scale,
    dtype,
    *,
    alibi_slopes=None,
    sinks=None,
    dropout_p=0.0,
    seed=None,
    **kwargs,
):
    """:func:`attention_varlen_backward` computed in ``dtype``."""
    do, q, k, v = (np.asarray(x, dtype=dtype) for x in (do, q, k, v))
    heads_q = q.shape[1]
    grads = [np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)]
    dsinks = None if sinks is None else np.zeros(heads_q, dtype)
    for b, (rows, keys) in enumerate(_sequences(cu_seqlens_q, cu_seqlens_k)):
        # Rows that see no key have no gradient (their o is 0, so their
        # sinks' share is 0 too).
        if rows.stop == rows.start or keys.stop == keys.start:
            continue
        kw = _varlen_kwargs(b, heads_q, rows, keys, alibi_slopes, dropout_p, seed, kwargs)
        g = _attention_backward(
            do[rows].transpose(1, 0, 2),
            q[rows].transpose(1, 0, 2),
            k[keys].transpose(1, 0, 2),
            v[keys].transpose(1, 0, 2),
            causal,
            scale,
            dtype,
            sinks=sinks,
            **kw,
        )
        for whole, part, at in zip(grads, g[:3], (rows, keys, keys), strict=True):
            whole[at] = part.transpose(1, 0, 2)
        if dsinks is not None:
            dsinks += g[3]
    return (*grads, dsinks) if dsinks is not None else tuple(grads)


def attention_varlen_backward(
    do,
    q,
    k,
    v,
    o,
    lse,
    cu_seqlens_q,
    cu_seqlens_k,
    *,
    causal=False,
    scale=None,
    window=None,
    alibi_slopes=None,
    softcap=None,
    sinks=None,
    dropout_p=0.0,
    seed=None,
):
    """Analytic gradients of :func:`attention_varlen` in float64: ``(dq, dk,
    dv)`` in the packed layouts, then ``dsinks`` if ``sinks`` is given; like
    :func:`flashport.attention_varlen_backward`. ``o`` and ``lse`` are
    ignored, as in :func:`attention_backward`."""
    del o, lse
    return _attention_varlen_backward(
        do,
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        causal,
        scale,
        np.float64,
        window=window,
        alibi_slopes=alibi_slopes,
        softcap=softcap,
        sinks=sinks,
        dropout_p=dropout_p,
        seed=seed,
    )


def cached_sequence(k_cache, v_cache, cache_seqlens, b, block_table=None):
    """The valid keys and values of sequence ``b`` of a cache, as
    :func:`flashport.attention_with_kvcache` reads them:
    ``(heads_kv, cache_seqlens[b], d)`` and ``(heads_kv, cache_seqlens[b],
    d_v)``, gathered through ``block_table`` when it is given."""
    k_cache, v_cache = np.asarray(k_cache), np.asarray(v_cache)
    length = int(np.asarray(cache_seqlens)[b])
    if block_table is None:
        return k_cache[b, :, :length], v_cache[b, :, :length]
    block_size = k_cache.shape[2]
    blocks = [int(x) for x in np.asarray(block_table)[b, : -(-length // block_size)]]
    if not blocks:
        return k_cache[0, :, :0], v_cache[0, :, :0]
    keys = np.concatenate([k_cache[x] for x in blocks], axis=1)[:, :length]
    values = np.concatenate([v_cache[x] for x in blocks], axis=1)[:, :length]
    return keys, values


def attention_with_kvcache(
    q,
    k_cache,
    v_cache,
    cache_seqlens,
    *,
    block_table=None,
    causal=True,
    scale=None,
    window=None,
    alibi_slopes=None,
    softcap=None,
    sinks=None,
    num_splits=None,
    return_lse=False,
):
    """:func:`flashport.attention_with_kvcache` in float64, built from whole
    attention: each sequence's valid keys gathered (:func:`cached_sequence`)
    and :func:`attention` called with its queries at positions
    ``cache_seqlens[b] - seq_q + i`` (``q_offset``) and its keys at
    ``0 ..`` (``k_offset = 0``). ``num_splits`` is accepted and ignored."""
    del num_splits
    return _attention_with_kvcache(
        q,
        k_cache,
        v_cache,
        cache_seqlens,
        block_table,
        causal,
        scale,
        return_lse,
        np.float64,
        window=window,
        alibi_slopes=alibi_slopes,
        softcap=softcap,
        sinks=sinks,
    )


def _attention_with_kvcache(
    q,
    k_cache,
    v_cache,
    cache_seqlens,
    block_table,
    causal,
    scale,
    return_lse,
    dtype,
    *,
    window=None,
    alibi_slopes=None,
    softcap=None,
    sinks=None,
):
    """The reference computed in ``dtype`` (float64: the oracle; the
    inputs' dtype: the naive same-precision baseline)."""
    q = np.asarray(q, dtype=dtype)
    batch, heads_q, seq_q, _ = q.shape
    slopes = None if alibi_slopes is None else np.asarray(alibi_slopes)
    if slopes is not None and slopes.ndim == 1:
        slopes = np.broadcast_to(slopes, (batch, heads_q))
    outs, lses = [], []
    for b in range(batch):
        keys, values = cached_sequence(k_cache, v_cache, cache_seqlens, b, block_table)
        length = keys.shape[1]
        o, lse = _attention(
            q[b],
            np.asarray(keys, dtype=dtype),
            np.asarray(values, dtype=dtype),
            causal,
            scale,
            True,
            dtype,
            window=window,
            alibi_slopes=None if slopes is None else slopes[b],
            softcap=softcap,
            sinks=sinks,
            q_offset=length - seq_q,
            k_offset=0,
        )
        outs.append(o)
        lses.append(lse)
    out = np.stack(outs) if outs else np.zeros((0, heads_q, seq_q, np.shape(v_cache)[-1]), dtype)
    lse = np.stack(lses) if lses else np.zeros((0, heads_q, seq_q), dtype)
    return (out, lse) if return_lse else out
