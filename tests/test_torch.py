"""flashport.torch: the drop-in for torch.nn.functional.scaled_dot_product_attention
against PyTorch's own (forward and gradients, float32, with the tolerance
rule of cases.assert_close; gradcheck in float64), flashport's keywords
through flashport.torch.attention (CPU and GPU), the dtypes, zero-copy
conversion, the errors, and the lazy import."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import flashport  # noqa: E402
import flashport.torch as fpt  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from cases import Case, assert_close, score_magnitude, term_magnitudes  # noqa: E402
from conftest import gpu_adapters  # noqa: E402
from flashport.torch._convert import from_numpy, to_numpy  # noqa: E402

# (batch, heads_q, heads_kv, seq_q, seq_k, d, dv, causal, mask kind)
SHAPES = [
    (2, 2, 2, 6, 6, 8, 8, False, None),
    (1, 4, 2, 5, 9, 8, 4, True, None),  # GQA, seq_q < seq_k
    (2, 2, 1, 9, 4, 8, 8, True, None),  # seq_q > seq_k: top-left keeps every row
    (1, 2, 2, 7, 5, 4, 8, False, "bool"),
    (2, 4, 2, 6, 8, 8, 8, False, "float"),  # GQA, differentiable float mask
    (1, 2, 2, 6, 6, 8, 8, False, "bool_dead_row"),
]


def _inputs(shape, dtype, seed, requires_grad=True):
    batch, hq, hkv, sq, sk, d, dv, _, mask_kind = shape
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, hq, sq, d, generator=g, dtype=torch.float64)
    k = torch.randn(batch, hkv, sk, d, generator=g, dtype=torch.float64)
    v = torch.randn(batch, hkv, sk, dv, generator=g, dtype=torch.float64)
    do = torch.randn(batch, hq, sq, dv, generator=g, dtype=torch.float64)
    mask = None
    if mask_kind and mask_kind.startswith("bool"):
        # (seq_q, seq_k), shared by every batch and head: broadcasting.
        mask = torch.rand(sq, sk, generator=g) < 0.6
        mask[:, 0] = True
        if mask_kind == "bool_dead_row":
            mask[1] = False
    elif mask_kind == "float":
        # (batch, 1, seq_q, seq_k): broadcast over the heads.
        mask = torch.randn(batch, 1, sq, sk, generator=g, dtype=torch.float64)
        mask[..., 1, 2] = -torch.inf
    q, k, v, do = (x.to(dtype) for x in (q, k, v, do))
    if mask is not None and mask.is_floating_point():
        mask = mask.to(dtype)
    for x in (q, k, v):
        x.requires_grad_(requires_grad)
    if mask is not None and mask.is_floating_point():
        mask.requires_grad_(requires_grad)
    return q, k, v, do, mask


def _leaves(q, k, v, mask):
    return [x for x in (q, k, v, mask) if x is not None and x.requires_grad]


@pytest.mark.parametrize("shape", SHAPES, ids=[str(s) for s in SHAPES])
def test_gradcheck_float64(shape):
    q, k, v, _, mask = _inputs(shape, torch.float64, seed=1)
    causal, gqa = shape[7], shape[1] != shape[2]

    def f(q, k, v, *rest):
        m = rest[0] if rest else mask
        return fpt.scaled_dot_product_attention(
            q, k, v, attn_mask=m, is_causal=causal, enable_gqa=gqa, scale=0.7
        )

    args = (q, k, v) + ((mask,) if mask is not None and mask.requires_grad else ())
    assert torch.autograd.gradcheck(f, args, eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("shape", SHAPES, ids=[str(s) for s in SHAPES])
@pytest.mark.parametrize("scale", [None, 0.4])
def test_matches_torch_float32(shape, scale):
    """flashport's error against PyTorch's SDPA in float64 is at most twice
    PyTorch's own float32 error, plus assert_close's floor."""
    batch, hq, hkv, sq, sk, d, dv, causal, _ = shape
    q, k, v, do, mask = _inputs(shape, torch.float32, seed=2)
    gqa = hq != hkv
    before = [x.detach().clone() for x in (q, k, v, do, mask) if x is not None]

    def run(fn, dtype):
        xs = [x.detach().to(dtype).requires_grad_(x.requires_grad) for x in (q, k, v)]
        m = (
            None
            if mask is None
            else mask.detach().to(mask.dtype if not mask.is_floating_point() else dtype)
        )
        if m is not None and mask.requires_grad:
            m.requires_grad_()
        out = fn(*xs, attn_mask=m, is_causal=causal, scale=scale, enable_gqa=gqa)
        leaves = _leaves(*xs, m)
        grads = torch.autograd.grad(out, leaves, do.to(dtype))
        return [t.detach().numpy() for t in (out, *grads)]

    got = run(fpt.scaled_dot_product_attention, torch.float32)
    want = run(F.scaled_dot_product_attention, torch.float64)
    baseline = run(F.scaled_dot_product_attention, torch.float32)

    case = Case(batch, hkv, hq // hkv, sq, sk, d, dv, causal, scale, 4, 0)
    kw = {"q_offset": 0, "k_offset": 0} if causal else {}
    if mask is not None:
        kw["mask"] = mask.detach().numpy()
    arrays = [x.detach().numpy() for x in (q, k, v)]
    scores = score_magnitude(case, *arrays[:2], **kw)
    terms = term_magnitudes(case, do.numpy(), *arrays, **kw)
    names = ["o", "dq", "dk", "dv"] + (["dmask"] if mask is not None and mask.requires_grad else [])
    assert len(got) == len(names)
    for name, g, w, b in zip(names, got, want, baseline, strict=True):
        assert_close(name, g, w, b, np.float32, scores, terms[name])
    after = [x.detach() for x in (q, k, v, do, mask) if x is not None]
    for b, a in zip(before, after, strict=True):
        assert torch.equal(a, b), "input modified"


def test_double_backward_raises_instead_of_dropping_the_term():
    """A gradient taken with create_graph=True has the first derivatives of
    the plain backward and stays in the graph; differentiating it again
    raises (it used to come back without a grad_fn, so a gradient penalty
    silently took the second-order term as 0)."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 5, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    k, v = (torch.randn(1, 2, 7, 4, dtype=torch.float64, generator=gen) for _ in range(2))
    (plain,) = torch.autograd.grad(fpt.scaled_dot_product_attention(q, k, v).sum(), q)
    out = fpt.scaled_dot_product_attention(q, k, v)
    (g,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    assert torch.equal(g.detach(), plain)
    assert g.requires_grad
    with pytest.raises(flashport.BackendUnavailableError, match="no double backward"):
        (g * g).sum().backward()


def test_no_grad_path_gives_the_same_bits():
    q, k, v, do, _ = _inputs(SHAPES[1], torch.float32, seed=3)
    out = fpt.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert out.requires_grad and out.grad_fn is not None
    with torch.no_grad():
        plain = fpt.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert plain.grad_fn is None and torch.equal(plain, out.detach())
    # Only some inputs requiring grad: the others get none.
    q2 = q.detach().requires_grad_()
    out = fpt.scaled_dot_product_attention(q2, k.detach(), v.detach(), enable_gqa=True)
    (dq,) = torch.autograd.grad(out, [q2], do)
    assert dq.shape == q2.shape and dq.abs().max() > 0


def test_more_leading_dimensions_than_batch():
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 3, 2, 5, 8, generator=g) for _ in range(3))
    mask = torch.rand(3, 1, 5, 5, generator=g) < 0.7
    mask[..., 0] = True
    got = fpt.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)
    assert got.shape == (2, 3, 2, 5, 8)
    assert torch.allclose(got.double(), want, rtol=0, atol=1e-5)


def test_conversion_shares_memory():
    x = torch.randn(2, 3, 4, 6)[..., ::2]  # strided, not contiguous
    a = to_numpy(x)
    assert np.shares_memory(a, x.numpy()) and a.strides == tuple(s * 4 for s in x.stride())
    back = from_numpy(a)
    assert back.data_ptr() == x.data_ptr() and torch.equal(back, x)


def _bf16_supported() -> bool:
    """flashport's core computes in bfloat16 (ml_dtypes) once that support
    lands; until then it refuses the dtype with DTypeError."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = np.ones((1, 2, 4), ml_dtypes.bfloat16)
    try:
        flashport.attention(x, x, x, device="cpu")
    except flashport.DTypeError:
        return False
    return True


def test_bfloat16_converts_without_copies():
    pytest.importorskip("ml_dtypes")
    x = torch.randn(3, 5).to(torch.bfloat16)
    a = to_numpy(x)
    assert a.dtype.name == "bfloat16" and np.shares_memory(a, x.view(torch.int16).numpy())
    np.testing.assert_array_equal(a.astype(np.float32), x.float().numpy())
    back = from_numpy(a)
    assert back.dtype == torch.bfloat16 and back.data_ptr() == x.data_ptr()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_dtypes_match_torch(dtype):
    if dtype == torch.bfloat16 and not _bf16_supported():
        pytest.skip("flashport's core refuses bfloat16 (DTypeError): bf16 support not merged yet")
    shape = SHAPES[4]
    q, k, v, do, mask = _inputs(shape, dtype, seed=5)

    def run(fn, dt):
        xs = [x.detach().to(dt).requires_grad_() for x in (q, k, v)]
        m = mask.detach().to(dt).requires_grad_()
        out = fn(*xs, attn_mask=m, enable_gqa=True)
        grads = torch.autograd.grad(out, [*xs, m], do.to(dt))
        return [t.detach() for t in (out, *grads)]

    got = run(fpt.scaled_dot_product_attention, dtype)
    want = run(F.scaled_dot_product_attention, torch.float64)
    baseline = run(F.scaled_dot_product_attention, dtype)
    for name, g, w, b in zip(("o", "dq", "dk", "dv", "dmask"), got, want, baseline, strict=True):
        assert g.dtype == dtype, name
        err = (g.double() - w).abs().max()
        naive = (b.double() - w).abs().max()
        # The half-precision rounding of the result alone is up to half an
        # ulp of its magnitude; PyTorch's error is the yardstick beyond it.
        ulp = torch.finfo(dtype).eps * w.abs().max()
        assert err <= 2 * naive + 2 * ulp, f"{name}: {err} vs torch {naive}"


def test_dropout_is_flashports_seeded_from_torch():
    q, k, v, do, _ = _inputs(SHAPES[0], torch.float32, seed=6)
    torch.manual_seed(123)
    a = fpt.scaled_dot_product_attention(q, k, v, dropout_p=0.4)
    torch.manual_seed(123)
    b = fpt.scaled_dot_product_attention(q, k, v, dropout_p=0.4)
    assert torch.equal(a, b)
    torch.manual_seed(123)
    seed = int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64).item())
    want = flashport.attention(
        *(to_numpy(x) for x in (q, k, v)), dropout_p=0.4, seed=seed, device="cpu"
    )
    np.testing.assert_array_equal(a.detach().numpy(), want)
    assert not torch.equal(a, fpt.scaled_dot_product_attention(q, k, v))
    # The backward regenerates the forward's dropout mask: its gradients are
    # those of flashport.attention_backward with the same seed.
    out, lse = flashport.attention(
        *(to_numpy(x) for x in (q, k, v)), dropout_p=0.4, seed=seed, return_lse=True
    )
    want_grads = flashport.attention_backward(
        do.numpy(), *(to_numpy(x) for x in (q, k, v)), out, lse, dropout_p=0.4, seed=seed
    )
    grads = torch.autograd.grad(a, (q, k, v), do)
    for g, w in zip(grads, want_grads, strict=True):
        np.testing.assert_array_equal(g.numpy(), w)


def test_attention_keywords_gradcheck():
    """flashport.torch.attention: window, softcap, sinks (with their
    gradient), ALiBi, explicit positions and a seeded dropout, in float64."""
    g = torch.Generator().manual_seed(7)
    q = torch.randn(1, 4, 6, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 7, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, 7, 4, generator=g, dtype=torch.float64, requires_grad=True)
    sinks = torch.randn(4, generator=g, dtype=torch.float64, requires_grad=True)
    slopes = torch.rand(4, generator=g, dtype=torch.float64)
    kw = {
        "causal": True,
        "window": (3, None),
        "softcap": 2.0,
        "alibi_slopes": slopes,
        "q_offset": 2,
        "k_offset": 0,
        "dropout_p": 0.2,
        "seed": 99,
    }

    def f(q, k, v, sinks):
        return fpt.attention(q, k, v, sinks=sinks, **kw)

    assert torch.autograd.gradcheck(f, (q, k, v, sinks), eps=1e-6, atol=1e-7, rtol=1e-5)
    # And the same values as flashport on the NumPy arrays.
    np_kw = {**kw, "alibi_slopes": slopes.numpy()}
    arrays = [x.detach().numpy() for x in (q, k, v)]
    want, want_lse = flashport.attention(
        *arrays, sinks=sinks.detach().numpy(), return_lse=True, **np_kw
    )
    got, lse = fpt.attention(q, k, v, sinks=sinks, return_lse=True, **kw)
    np.testing.assert_array_equal(got.detach().numpy(), want)
    np.testing.assert_array_equal(lse.numpy(), want_lse)
    assert not lse.requires_grad


def _gpu_or_skip():
    if not gpu_adapters():
        import os

        if os.environ.get("FLASHPORT_REQUIRE_GPU") == "1":
            pytest.fail("FLASHPORT_REQUIRE_GPU=1 but flashport.devices() lists no GPU adapter")
        pytest.skip("no GPU adapter (install lavapipe)")


def test_attention_on_flashports_gpu_backend():
    _gpu_or_skip()
    q, k, v, do, mask = _inputs(SHAPES[4], torch.float32, seed=8)
    kw = {"mask": mask, "window": (4, 1)}
    results = {}
    for device in ("cpu", "gpu"):
        xs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        m = mask.detach().clone().requires_grad_()
        out = fpt.attention(*xs, device=device, **{**kw, "mask": m})
        results[device] = [out.detach(), *torch.autograd.grad(out, [*xs, m], do)]
    for name, c, gp in zip(("o", "dq", "dk", "dv", "dmask"), *results.values(), strict=True):
        assert gp.device.type == "cpu" and gp.dtype == torch.float32
        scale = c.abs().max()
        assert (c - gp).abs().max() <= 1e-5 * max(float(scale), 1.0), name


def test_refuses_tensors_on_other_devices():
    q = torch.randn(1, 2, 4, 8)
    meta = torch.empty(1, 2, 4, 8, device="meta")
    with pytest.raises(flashport.InvalidArgumentError, match=r"key is on device 'meta'.*\.cpu\(\)"):
        fpt.scaled_dot_product_attention(q, meta, q)
    with pytest.raises(flashport.InvalidArgumentError, match=r"mask is on device 'meta'"):
        fpt.attention(q, q, q, mask=torch.empty(4, 4, device="meta", dtype=torch.bool))


def test_errors_name_the_argument():
    q = torch.randn(1, 4, 5, 8)
    k = torch.randn(1, 2, 5, 8)
    with pytest.raises(flashport.ShapeError, match="enable_gqa=True"):
        fpt.scaled_dot_product_attention(q, k, k)
    with pytest.raises(flashport.InvalidArgumentError, match="attn_mask and is_causal"):
        fpt.scaled_dot_product_attention(
            q, q, q, attn_mask=torch.ones(5, 5, dtype=bool), is_causal=True
        )
    with pytest.raises(flashport.DTypeError, match=r"attn_mask.*torch.int32"):
        fpt.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(5, 5, dtype=torch.int32))
    with pytest.raises(flashport.InvalidArgumentError, match=r"value must be a torch\.Tensor"):
        fpt.scaled_dot_product_attention(q, q, q.numpy())
    with pytest.raises(flashport.InvalidArgumentError, match=r"alibi_slopes.*detach"):
        fpt.attention(q, q, q, alibi_slopes=torch.rand(4, requires_grad=True))
    with pytest.raises(flashport.DTypeError):
        fpt.scaled_dot_product_attention(q, q.double(), q)
    with pytest.raises(flashport.InvalidArgumentError, match="dropout_p"):
        fpt.scaled_dot_product_attention(q, q, q, dropout_p=1.5)
    # The core's checks, in the names of PyTorch's arguments (they said
    # q, k, v and mask).
    with pytest.raises(flashport.ShapeError, match=r"^query and key .* \(query: 8, key: 4\)"):
        fpt.scaled_dot_product_attention(q, q[..., :4], q)
    with pytest.raises(flashport.DTypeError, match=r"^value has dtype float64: query has"):
        fpt.scaled_dot_product_attention(q, q, q.double())
    with pytest.raises(flashport.ShapeError, match=r"^attn_mask has shape \(3, 5\)"):
        fpt.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(3, 5))


def test_plain_flashport_never_imports_torch():
    code = (
        "import sys, numpy as np, flashport\n"
        "x = np.ones((1, 4, 8), np.float32)\n"
        "flashport.attention(x, x, x, device='cpu')\n"
        "assert 'torch' not in sys.modules, 'flashport imported torch'\n"
        "sys.modules['torch'] = None\n"
        "try:\n"
        "    import flashport.torch\n"
        "except ImportError as e:\n"
        "    assert \"pip install 'flashport[torch]'\" in str(e), e\n"
        "else:\n"
        "    raise SystemExit('imported without torch')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
