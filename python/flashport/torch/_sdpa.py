"""The autograd Function behind :func:`scaled_dot_product_attention` (the
drop-in for PyTorch's) and :func:`attention` (flashport's own keywords)."""

from __future__ import annotations

import math
import re
from typing import Any

import torch

import flashport

from .._errors import (
    BackendUnavailableError,
    DTypeError,
    FlashportError,
    InvalidArgumentError,
    ShapeError,
)
from ._convert import check_tensor, from_numpy, to_numpy

__all__ = ["attention", "scaled_dot_product_attention"]


class _FlashportAttention(torch.autograd.Function):
    """flashport's forward, saving ``o`` and ``lse``; the backward is
    :func:`flashport.attention_backward` with the same keywords. The mask
    and the sinks are inputs too, so a float mask and the sinks get their
    gradients."""

    @staticmethod
    def forward(ctx, q, k, v, mask, sinks, opts):
        out, lse = flashport.attention(
            to_numpy(q),
            to_numpy(k),
            to_numpy(v),
            mask=None if mask is None else to_numpy(mask),
            sinks=None if sinks is None else to_numpy(sinks),
            return_lse=True,
            **opts,
        )
        o_t, lse_t = from_numpy(out), from_numpy(lse)
        ctx.save_for_backward(q, k, v, mask, sinks, o_t, lse_t)
        ctx.opts = opts
        ctx.mark_non_differentiable(lse_t)
        return o_t, lse_t

    @staticmethod
    def backward(ctx, do, _dlse):
        with torch.no_grad():
            grads = _FlashportAttention._gradients(ctx, do)
        if not torch.is_grad_enabled():
            return grads
        # create_graph=True: the gradients depend on q, k, v (and do)
        # through a backward that flashport does not differentiate. Marked
        # so, a second backward through them raises instead of taking that
        # term as 0 (which @once_differentiable did: it looks only at do).
        sources = [t for t in (do, *ctx.saved_tensors) if t is not None and t.requires_grad]
        return tuple(None if g is None else _NoDoubleBackward.apply(g, *sources) for g in grads)

    @staticmethod
    def _gradients(ctx, do):
        q, k, v, mask, sinks, o, lse = ctx.saved_tensors
        want_dmask = mask is not None and ctx.needs_input_grad[3]
        grads = list(
            flashport.attention_backward(
                to_numpy(do),
                to_numpy(q),
                to_numpy(k),
                to_numpy(v),
                to_numpy(o),
                to_numpy(lse),
                mask=None if mask is None else to_numpy(mask),
                sinks=None if sinks is None else to_numpy(sinks),
                return_dmask=want_dmask,
                **ctx.opts,
            )
        )
        dq, dk, dv = (
            from_numpy(g) if needed else None
            for g, needed in zip(grads[:3], ctx.needs_input_grad[:3], strict=True)
        )
        rest = grads[3:]
        dsinks = from_numpy(rest.pop(0)) if sinks is not None else None
        dmask = from_numpy(rest.pop(0)) if want_dmask else None
        if not ctx.needs_input_grad[4]:
            dsinks = None
        return dq, dk, dv, dmask, dsinks, None


class _NoDoubleBackward(torch.autograd.Function):
    """A gradient of flashport's attention, kept in a graph that
    ``create_graph=True`` builds: the same values, tied to the tensors it
    depends on, and a backward that refuses (PyTorch's fused SDPA kernels
    refuse a double backward too)."""

    @staticmethod
    def forward(ctx, grad, *sources):
        return grad.view_as(grad)

    @staticmethod
    def backward(ctx, *grads):
        raise BackendUnavailableError(
            "flashport.torch's attention has no double backward: a gradient computed with "
            "create_graph=True cannot be differentiated again through it (its first "
            "derivatives are exact); use torch.nn.functional.scaled_dot_product_attention "
            "where second derivatives are needed"
        )


def _run(q, k, v, mask, sinks, opts: dict[str, Any], return_lse: bool):
    """Through the autograd Function when a gradient is wanted; otherwise
    one forward call that neither saves anything nor computes lse unasked."""
    differentiable = (q, k, v, mask, sinks)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in differentiable):
        out, lse = _FlashportAttention.apply(q, k, v, mask, sinks, opts)
        return (out, lse) if return_lse else out
    result = flashport.attention(
        to_numpy(q),
        to_numpy(k),
        to_numpy(v),
        mask=None if mask is None else to_numpy(mask),
        sinks=None if sinks is None else to_numpy(sinks),
        return_lse=return_lse,
        **opts,
    )
    if return_lse:
        return from_numpy(result[0]), from_numpy(result[1])
    return from_numpy(result)


def _dropout_seed(dropout_p: float) -> int | None:
    """A seed for flashport's dropout drawn from torch's default generator,
    so that ``torch.manual_seed`` makes runs repeat. The backward reuses the
    forward's seed (it is one of the saved keywords)."""
    if isinstance(dropout_p, (int, float)) and not isinstance(dropout_p, bool) and dropout_p > 0:
        return int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64).item())
    return None


def _float_mask(name: str, mask: torch.Tensor) -> torch.Tensor:
    """flashport takes bool and float16/32/64 masks; a bfloat16 mask becomes
    float32 (exactly, and differentiably: autograd casts the gradient back)."""
    if mask.dtype == torch.bool or mask.dtype in (torch.float16, torch.float32, torch.float64):
        return mask
    if mask.dtype == torch.bfloat16:
        return mask.float()
    raise DTypeError(f"{name} must be bool (True = attend) or floating point, got {mask.dtype}")


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``torch.nn.functional.scaled_dot_product_attention`` computed by
    flashport on the CPU, with PyTorch's semantics and signature.

    - ``query (..., heads_q, L, E)``, ``key (..., heads_kv, S, E)``,
      ``value (..., heads_kv, S, Ev)``: CPU tensors of one dtype, float64,
      float32, float16 or bfloat16, read in place (no copies). Leading
      dimensions beyond ``(batch, heads)`` are flattened into the batch.
    - ``attn_mask``: bool (``True`` = attend) or float (added to the
      scores), broadcastable to ``(..., heads_q, L, S)``. A float mask that
      requires grad gets its gradient.
    - ``is_causal``: PyTorch's top-left alignment, query ``i`` sees keys
      ``j <= i`` also when ``L != S``. Not together with ``attn_mask``
      (PyTorch refuses that too).
    - ``enable_gqa``: ``heads_q`` a multiple of ``heads_kv``; query head
      ``h`` reads key/value head ``h // (heads_q // heads_kv)``, as PyTorch
      does. Without it the head counts must agree (or ``heads_kv == 1``).
    - ``dropout_p > 0``: flashport's dropout (Philox4x32-10, regenerated in
      the backward), seeded from torch's default generator, so
      ``torch.manual_seed`` makes it repeat; the dropped elements are not
      the ones PyTorch would drop.

    Differentiable with respect to query, key, value and a float mask, through
    :func:`flashport.attention_backward`. A row that sees no key (an
    all-``False`` mask row) gives zeros, as PyTorch's CPU kernels do.
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        check_tensor(name, t)
    if attn_mask is not None:
        check_tensor("attn_mask", attn_mask)
        attn_mask = _float_mask("attn_mask", attn_mask)
        if is_causal:
            raise InvalidArgumentError(
                "attn_mask and is_causal=True were both given: like PyTorch's "
                "scaled_dot_product_attention, pass one (fold the causal pattern into the mask, "
                "or use flashport.torch.attention(..., causal=True, mask=...))"
            )
    if query.ndim >= 3 and key.ndim >= 3:
        heads_q, heads_kv = query.shape[-3], key.shape[-3]
        if heads_q != heads_kv and heads_kv != 1 and not enable_gqa:
            raise ShapeError(
                f"query has {heads_q} heads and key {heads_kv}: pass enable_gqa=True for "
                f"grouped-query attention (as torch.nn.functional.scaled_dot_product_attention "
                f"requires)"
            )
    opts: dict[str, Any] = {
        "causal": is_causal,
        "scale": scale,
        "dropout_p": dropout_p,
        "seed": _dropout_seed(dropout_p),
        "device": "cpu",
    }
    if isinstance(is_causal, bool) and is_causal:
        # PyTorch aligns the causal mask top-left: query i at position i,
        # key j at j.
        opts["q_offset"] = 0
        opts["k_offset"] = 0
    lead = query.shape[:-3]
    if query.ndim > 4:
        if key.shape[:-3] != lead or value.shape[:-3] != lead:
            raise ShapeError(
                f"query {tuple(query.shape)}, key {tuple(key.shape)} and value "
                f"{tuple(value.shape)} must have the same leading dimensions"
            )
        batch = math.prod(lead)
        query, key, value = (x.reshape(batch, *x.shape[-3:]) for x in (query, key, value))
        if attn_mask is not None and attn_mask.ndim > 2:
            m = attn_mask.reshape((1,) * (len(lead) + 3 - attn_mask.ndim) + attn_mask.shape)
            attn_mask = m.expand(*lead, *m.shape[-3:]).reshape(batch, *m.shape[-3:])
    try:
        out = _run(query, key, value, attn_mask, None, opts, return_lse=False)
    except FlashportError as e:
        # The core names flashport's own arguments; the caller passed
        # PyTorch's.
        raise type(e)(_SDPA_NAMES.sub(lambda m: _SDPA_RENAMED[m[0]], str(e))) from None
    return out.reshape(*lead, *out.shape[-3:]) if len(lead) > 1 else out


# flashport's argument names in the core's messages, and the names of
# scaled_dot_product_attention's arguments they stand for (whole words:
# heads_q, k_offset and the like stay).
_SDPA_RENAMED = {"q": "query", "k": "key", "v": "value", "mask": "attn_mask"}
_SDPA_NAMES = re.compile(r"\b(q|k|v|mask)\b")


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int | None, int | None] | None = None,
    mask: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    seed: int | None = None,
    q_offset: int | None = None,
    k_offset: int | None = None,
    return_lse: bool = False,
    device: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`flashport.attention` on CPU tensors, with its keywords and
    semantics (causal and window bottom-right aligned unless ``q_offset`` /
    ``k_offset`` say otherwise; see its docstring), differentiable with
    respect to ``q``, ``k``, ``v``, a float ``mask`` and ``sinks``.

    ``mask``, ``alibi_slopes`` and ``sinks`` are tensors (CPU); ALiBi slopes
    get no gradient, so they must not require one. ``dropout_p > 0`` without
    ``seed`` draws the seed from torch's default generator.
    ``device="gpu"`` computes on flashport's GPU backend (wgpu): the tensors
    stay CPU tensors, flashport copies them to the GPU and back.

    Returns ``o``, or ``(o, lse)`` with ``return_lse=True`` (``lse`` gets no
    gradient).
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t)
    if mask is not None:
        check_tensor("mask", mask)
        mask = _float_mask("mask", mask)
    if sinks is not None:
        check_tensor("sinks", sinks)
    alibi = None
    if alibi_slopes is not None:
        check_tensor("alibi_slopes", alibi_slopes)
        if alibi_slopes.requires_grad and torch.is_grad_enabled():
            raise InvalidArgumentError(
                "alibi_slopes requires grad, but flashport computes no gradient for ALiBi "
                "slopes: pass alibi_slopes.detach()"
            )
        alibi = to_numpy(alibi_slopes)
    if seed is None:
        seed = _dropout_seed(dropout_p)
    opts: dict[str, Any] = {
        "causal": causal,
        "scale": scale,
        "window": window,
        "alibi_slopes": alibi,
        "softcap": softcap,
        "dropout_p": dropout_p,
        "seed": seed,
        "q_offset": q_offset,
        "k_offset": k_offset,
        "device": device,
    }
    return _run(q, k, v, mask, sinks, opts, return_lse)
