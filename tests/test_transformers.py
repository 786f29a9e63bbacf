"""flashport as a transformers attention implementation: small Llama-,
Qwen2-, Gemma-2- and gpt-oss-style models built from configs with random
weights (nothing is downloaded) give the logits and one training step's
gradients of transformers' own attention (``"sdpa"``; ``"eager"`` for
Gemma-2's softcap and gpt-oss's sinks, which SDPA lacks) by
cases.assert_close's rule (flashport's error against the float64 model is
at most twice the float32 reference's, plus the floor), and the same tokens
when generating with a KV cache."""

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


def _gemma2():
    # Scores are softcapped (tanh) at 2, well inside their range here; layer
    # 0 slides over 8 keys.
    return transformers.Gemma2Config(
        **COMMON,
        head_dim=16,
        query_pre_attn_scalar=16,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=None,
        sliding_window=8,
    )


def _gpt_oss():
    # Learned sinks per head (s_aux), a mixture of 4 experts, layer 0
    # sliding over 8 keys.
    common = {**COMMON, "intermediate_size": 64}
    return transformers.GptOssConfig(
        **common,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )


# The model, and the attention implementation of transformers it is held to.
CONFIGS = {
    "llama": (_llama, "sdpa"),
    "qwen2": (_qwen2, "sdpa"),
    "gemma2": (_gemma2, "eager"),
    "gpt_oss": (_gpt_oss, "eager"),
}


@pytest.fixture(scope="module")
def name():
    return fpt.register_transformers()


def _models(arch, name):
    """The flashport model, and reference ones in float32 and float64, all
    with the same random weights."""
    config_fn, impl = CONFIGS[arch]
    # The experts as a loop of matmuls: the grouped kernel takes no float64.
    kw = {"experts_implementation": "eager"} if arch == "gpt_oss" else {}
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(config_fn(), attn_implementation=impl, **kw)
    with torch.no_grad():
        for param_name, param in ref.named_parameters():
            if param_name.endswith("sinks"):
                param.normal_()  # initialised to zeros: would test nothing
    mine = AutoModelForCausalLM.from_config(config_fn(), attn_implementation=name, **kw)
    mine.load_state_dict(ref.state_dict())
    ref64 = AutoModelForCausalLM.from_config(config_fn(), attn_implementation=impl, **kw)
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


# Left padding is compared where the reference is SDPA: eager attention in
# float64 turns the padded rows, which see no key, into NaN that reaches the
# real tokens through the next layer (0 · NaN in its P V), so it is no
# oracle there. The generation test below covers padding for every model.
CASES = [
    (arch, pad)
    for arch, (_, impl) in CONFIGS.items()
    for pad in (False, True)
    if not (pad and impl == "eager")
]


@pytest.mark.parametrize(
    ("arch", "left_padding"),
    CASES,
    ids=[f"{a}-{'left_padding' if p else 'no_padding'}" for a, p in CASES],
)
def test_logits_and_gradients_match_sdpa(arch, left_padding, name):
    mine, ref, ref64 = _models(arch, name)
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
    mine, ref, _ = _models(arch, name)
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
    mine, _, _ = _models("qwen2", name)
    ids, mask = _batch(left_padding=False)
    with torch.no_grad():
        windowed = mine(input_ids=ids, attention_mask=mask).logits
        for layer in mine.model.layers:
            layer.self_attn.sliding_window = None
        mine.config.layer_types = ["full_attention"] * 2
        full = mine(input_ids=ids, attention_mask=mask).logits
    assert mine.config.sliding_window < SEQ
    assert not torch.allclose(windowed[:, -1], full[:, -1], atol=1e-3)


@pytest.mark.parametrize("arch", ["gemma2", "gpt_oss"])
def test_softcap_and_sinks_reach_the_kernel(arch, name):
    """Gemma-2's softcap and gpt-oss's sinks change the logits (so the
    comparisons above cover their pass-through): without them, different."""
    mine, _, _ = _models(arch, name)
    ids, mask = _batch(left_padding=False)
    with torch.no_grad():
        given = mine(input_ids=ids, attention_mask=mask).logits
        for layer in mine.model.layers:
            if arch == "gemma2":
                layer.self_attn.attn_logit_softcapping = None
            else:
                layer.self_attn.sinks.fill_(-1e4)  # a sink that takes nothing
        without = mine(input_ids=ids, attention_mask=mask).logits
    assert not torch.allclose(given[:, -1], without[:, -1], atol=1e-3)


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
    with pytest.raises(flashport.InvalidArgumentError, match="paged cache"):
        fpt.transformers_attention(module, q, q, q, None, cache=object())
    with pytest.raises(flashport.DTypeError, match="position_bias must be floating point"):
        fpt.transformers_attention(module, q, q, q, None, position_bias=torch.ones(1, 2, 3, 3) > 0)
    out, weights = fpt.transformers_attention(module, q, q, q, None)
    assert out.shape == (1, 3, 2, 8) and weights is None


def _t5_config():
    # initializer_factor widens T5's initial weights so that the scores,
    # and the learned position bias added to them, are far from uniform.
    return transformers.T5Config(
        vocab_size=VOCAB,
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        dropout_rate=0.0,
        initializer_factor=3.0,
    )


def test_t5_position_bias_is_a_float_mask_with_its_gradient(name):
    """T5 hands its learned relative position bias to the attention function
    as position_bias (it was refused): added to the scores where the mask
    lets a key through, in the encoder (padding), the causal decoder and
    cross-attention. Logits and every gradient, the bias embeddings' own
    included, against SDPA in float64."""
    model = transformers.T5ForConditionalGeneration
    torch.manual_seed(0)
    ref = model._from_config(_t5_config(), attn_implementation="sdpa")
    mine = model._from_config(_t5_config(), attn_implementation=name)
    mine.load_state_dict(ref.state_dict())
    ref64 = model._from_config(_t5_config(), attn_implementation="sdpa")
    ref64.load_state_dict(ref.state_dict())
    ref64.double()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 12), generator=g)
    dec = torch.randint(0, VOCAB, (2, 7), generator=g)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 9:] = 0

    def step(m):
        m.train()
        m.zero_grad()
        out = m(input_ids=ids, attention_mask=mask, decoder_input_ids=dec, labels=dec)
        out.loss.backward()
        return out.logits.detach(), {n: p.grad.detach().clone() for n, p in m.named_parameters()}

    with _Spy(name) as spy:
        got_logits, got = step(mine)
    # Encoder self-attention, decoder self- and cross-attention, two layers.
    assert spy.calls == 6
    base_logits, base = step(ref)
    want_logits, want = step(ref64)
    assert_close("logits", got_logits.numpy(), want_logits.numpy(), base_logits.numpy(), np.float32)
    biases = [n for n in got if "relative_attention_bias" in n]
    assert len(biases) == 2
    for param in got:
        g, w, b = (x[param].numpy() for x in (got, want, base))
        assert np.abs(g).max() > 0, f"{param}: zero gradient"
        assert_close(param, g, w, b, np.float32)
