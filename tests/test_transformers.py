"""flashport as a transformers attention implementation: small Llama- and
Qwen2-style models built from configs with random weights (nothing is
downloaded) give the logits and one training step's gradients of
``attn_implementation="sdpa"`` (by cases.assert_close's rule: flashport's
error against the float64 model is at most twice SDPA's float32 error,
plus the floor), and the same tokens when generating with a KV cache."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import flashport  # noqa: E402
import flashport.torch as fpt  # noqa: E402
from cases import assert_close  # noqa: E402
from transformers import AttentionInterface, AutoModelForCausalLM  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask  # noqa: E402

VOCAB, SEQ = 128, 24
# Weights wider than transformers' default (0.02) give scores of order 1,
# so attention is far from uniform and a wrong mask shows in the logits.
COMMON = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": VOCAB,
    "max_position_embeddings": 64,
    "initializer_range": 0.15,
}


def _llama():
    return transformers.LlamaConfig(**COMMON)


def _qwen2():
    # Layer 1 is a sliding-window layer with a window shorter than the
    # sequence.
    return transformers.Qwen2Config(
        **COMMON, use_sliding_window=True, sliding_window=8, max_window_layers=1
    )


CONFIGS = {"llama": _llama, "qwen2": _qwen2}


@pytest.fixture(scope="module")
def name():
    return fpt.register_transformers()


def _models(config_fn, name):
    """The flashport model, and SDPA ones in float32 and float64, all with
    the same random weights."""
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(config_fn(), attn_implementation="sdpa")
    mine = AutoModelForCausalLM.from_config(config_fn(), attn_implementation=name)
    mine.load_state_dict(ref.state_dict())
    ref64 = AutoModelForCausalLM.from_config(config_fn(), attn_implementation="sdpa")
    ref64.load_state_dict(ref.state_dict())
    return mine, ref, ref64.double()


def _batch(left_padding: bool):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    mask = torch.ones(2, SEQ, dtype=torch.long)
    if left_padding:
        mask[1, :7] = 0
    return ids, mask


class _Spy:
    """Counts the calls of the registered attention function (so a test
    cannot pass on SDPA by accident)."""

    def __init__(self, name):
        self.name, self.calls = name, 0

    def __enter__(self):
        self.original = AttentionInterface._global_mapping[self.name]

        def spy(*args, **kwargs):
            self.calls += 1
            return self.original(*args, **kwargs)

        AttentionInterface.register(self.name, spy)
        return self

    def __exit__(self, *exc):
        AttentionInterface.register(self.name, self.original)


def _step(model, ids, mask):
    """Logits and the gradients of one training step's loss (padding
    positions excluded from the loss)."""
    model.train()
    model.zero_grad()
    labels = ids.masked_fill(mask == 0, -100)
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return out.logits.detach(), grads


@pytest.mark.parametrize("left_padding", [False, True], ids=["no_padding", "left_padding"])
@pytest.mark.parametrize("arch", list(CONFIGS))
def test_logits_and_gradients_match_sdpa(arch, left_padding, name):
    mine, ref, ref64 = _models(CONFIGS[arch], name)
    assert mine.config._attn_implementation == name and "flash" not in name
    ids, mask = _batch(left_padding)
    with _Spy(name) as spy:
        got_logits, got = _step(mine, ids, mask)
    assert spy.calls == 2  # one per layer
    base_logits, base = _step(ref, ids, mask)
    want_logits, want = _step(ref64, ids, mask)
    real = mask.bool()  # the padding rows' logits are not compared
    assert_close(
        "logits",
        got_logits[real].numpy(),
        want_logits[real].numpy(),
        base_logits[real].numpy(),
        np.float32,
    )
    assert set(got) == set(want)
    for param in got:
        g, w, b = (x[param].numpy() for x in (got, want, base))
        assert np.abs(g).max() > 0, f"{param}: zero gradient"
        assert_close(param, g, w, b, np.float32)


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_generation_with_kv_cache_gives_sdpas_tokens(arch, name):
    mine, ref, _ = _models(CONFIGS[arch], name)
    ids, mask = _batch(left_padding=True)
    kw = {"attention_mask": mask, "max_new_tokens": 6, "do_sample": False, "use_cache": True}
    with torch.no_grad():
        want = ref.generate(ids, **kw)
        with _Spy(name) as spy:
            got = mine.generate(ids, **kw)
    # Prefill and 5 decoding steps, each through both layers.
    assert spy.calls == 2 * 6
    assert got.shape == (2, SEQ + 6)
    assert torch.equal(got, want)


def test_sliding_window_layers_see_only_the_window(name):
    """The Qwen2 model's sliding layer differs from full attention: turning
    the window off changes the logits (so the comparison above covers it)."""
    mine, _, _ = _models(_qwen2, name)
    ids, mask = _batch(left_padding=False)
    with torch.no_grad():
        windowed = mine(input_ids=ids, attention_mask=mask).logits
        for layer in mine.model.layers:
            layer.self_attn.sliding_window = None
        mine.config.layer_types = ["full_attention"] * 2
        full = mine(input_ids=ids, attention_mask=mask).logits
    assert mine.config.sliding_window < SEQ
    assert not torch.allclose(windowed[:, -1], full[:, -1], atol=1e-3)


def test_register_returns_the_name_and_the_mask_function(name):
    assert name == fpt.register_transformers() == "fport"
    assert AttentionInterface._global_mapping[name] is fpt.transformers_attention
    assert AttentionMaskInterface._global_mapping[name] is sdpa_mask
    assert fpt.register_transformers("my_attention") == "my_attention"
    with pytest.raises(flashport.InvalidArgumentError, match=r"'flash'"):
        fpt.register_transformers("flashport")
    with pytest.raises(flashport.InvalidArgumentError, match=r"'sdpa'"):
        fpt.register_transformers("fp_sdpa")
    with pytest.raises(flashport.InvalidArgumentError, match=r"'/'"):
        fpt.register_transformers("me/flp")


def test_unsupported_features_are_refused(name):
    q = torch.randn(1, 2, 3, 8)
    module = torch.nn.Module()
    with pytest.raises(flashport.InvalidArgumentError, match="position_bias"):
        fpt.transformers_attention(module, q, q, q, None, position_bias=torch.zeros(1, 2, 3, 3))
    out, weights = fpt.transformers_attention(module, q, q, q, None)
    assert out.shape == (1, 3, 2, 8) and weights is None
