"""flashport as an attention implementation of Hugging Face transformers
(5.x): an entry in its ``AttentionInterface`` and, under the same name, in
its ``AttentionMaskInterface``."""

from __future__ import annotations

from typing import Any

import torch

from .._errors import DTypeError, InvalidArgumentError
from ._convert import check_tensor
from ._sdpa import _dropout_seed, _float_mask, _run

__all__ = ["DEFAULT_NAME", "register_transformers", "transformers_attention"]

# transformers 5.x takes any implementation name containing "flash" for a
# FlashAttention kernel to fetch from its hub, one containing "sdpa" or
# "flex_attention" for PyTorch's own (it checks that the model supports
# those), and "owner/repo" for a hub kernel.
DEFAULT_NAME = "fport"
_RESERVED = ("flash", "sdpa", "flex_attention", "paged", "eager")


def transformers_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attention function transformers calls per layer, with the
    arguments of its ``sdpa_attention_forward``: ``query (batch, heads_q,
    q_len, d)``, ``key``/``value (batch, heads_kv, kv_len, d)`` (the whole
    cache), and the mask that ``sdpa_mask`` built (registered under the same
    name): a bool ``(batch, 1, q_len, kv_len)`` mask, or ``None`` where the
    pattern is plain causal (top-left aligned, as for PyTorch's SDPA) or,
    when decoding one token, every key. Returns the output as ``(batch,
    q_len, heads_q, d)`` and no attention weights.

    Grouped-query attention is native (no repeated key/value heads); the
    layer's ``sliding_window`` becomes flashport's ``window`` where no mask
    carries it, Gemma-2's ``softcap`` flashport's ``softcap``, gpt-oss's
    ``s_aux`` flashport's ``sinks``, and T5's ``position_bias`` a float mask
    (differentiable, so its relative attention bias learns)."""
    if kwargs.get("cache") is not None:
        raise InvalidArgumentError(
            "a paged cache (continuous batching) is not supported by the flashport attention "
            "implementation: use attn_implementation='sdpa'"
        )
    for name, t in (("query", query), ("key", key), ("value", value)):
        check_tensor(name, t)
    # T5's learned relative position bias, (batch or 1, heads, q_len,
    # kv_len): added to the scores as a float mask (with its gradient),
    # where the attention mask lets a key through, as transformers' SDPA
    # path does (create_position_bias_mask).
    bias = kwargs.get("position_bias")
    if bias is not None:
        check_tensor("position_bias", bias)
        bias = _float_mask("position_bias", bias)
        if bias.dtype == torch.bool:
            raise DTypeError("position_bias must be floating point (added to the scores)")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    q_len = query.shape[2]
    opts: dict[str, Any] = {
        "scale": scaling,
        "softcap": softcap,
        "dropout_p": dropout,
        "seed": _dropout_seed(dropout),
        "device": "cpu",
    }
    mask = attention_mask
    if mask is not None:
        check_tensor("attention_mask", mask)
        # The mask holds every pattern (causal, window, padding) at the
        # positions transformers knows; flashport skips the tiles it hides.
        mask = _float_mask("attention_mask", mask)
        opts["causal"] = False
        if bias is not None:
            if mask.dtype == torch.bool:
                mask = torch.where(mask, bias, torch.tensor(-torch.inf, dtype=bias.dtype))
            else:
                mask = bias + mask
    elif is_causal and q_len > 1:
        # As in transformers' SDPA path: no mask means plain causal, top-left
        # aligned (also for a static cache's prefill, whose extra keys lie
        # after every query).
        opts["causal"] = True
        opts["q_offset"] = opts["k_offset"] = 0
        mask = bias
        if sliding_window is not None:
            opts["window"] = (sliding_window - 1, None)
    else:
        # One query (decoding) sees every key in the cache; a sliding window
        # counts back from the last key.
        opts["causal"] = False
        mask = bias
        if is_causal and sliding_window is not None:
            opts["window"] = (sliding_window - 1, None)
    sinks = kwargs.get("s_aux")
    out = _run(query, key, value, mask, sinks, opts, return_lse=False)
    return out.transpose(1, 2).contiguous(), None


def register_transformers(name: str = DEFAULT_NAME) -> str:
    """Registers flashport with transformers' ``AttentionInterface`` (and
    ``sdpa_mask`` as its mask function in ``AttentionMaskInterface``) and
    returns the name, for ``attn_implementation=``::

        model = AutoModelForCausalLM.from_config(
            cfg, attn_implementation=flashport.torch.register_transformers()
        )

    Registering again is harmless. ``name`` must not contain "flash",
    "sdpa", "flex_attention", "paged", "eager", "/" or ":", which
    transformers reserves for its own implementations and hub kernels."""
    if not isinstance(name, str) or not name:
        raise InvalidArgumentError(f"name must be a non-empty string, got {name!r}")
    reserved = [word for word in (*_RESERVED, "/", ":", "|") if word in name]
    if reserved:
        raise InvalidArgumentError(
            f"name={name!r} contains {reserved[0]!r}, which transformers reserves for its own "
            f"attention implementations or hub kernels; choose another name "
            f"(default {DEFAULT_NAME!r})"
        )
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError as error:
        raise ImportError(
            "register_transformers needs transformers 5.x; install it with: "
            "pip install 'flashport[transformers]'"
        ) from error
    AttentionInterface.register(name, transformers_attention)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name
