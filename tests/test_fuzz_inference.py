"""Fuzzing the inference half of the public API as a hostile or careless
caller would use it: ``attention_with_kvcache``, ``attention_varlen``,
``merge_states``, ``KVCache`` and ``flashport.torch``'s SDPA. Half the
examples are valid and their results are checked against a float64
oracle; the others change one or two arguments to something wrong. Every
call either returns right results or raises a ``FlashportError`` other
than ``InternalError``, with a message; inputs are never modified, and a
``KVCache`` is exactly as it was after a call that failed.

The "ci" profile runs a few dozen examples per test; the long hunt is
``HYPOTHESIS_PROFILE=fuzz pytest tests/test_fuzz_inference.py`` (5,000 per
test, see conftest.py)."""

from __future__ import annotations

import copy
import math

import flashport
import numpy as np
import pytest
from cases import assert_close, oracle_dtype
from conftest import cache_state
from flashport import reference
from hypothesis import event, given
from hypothesis import strategies as st
from test_fuzz_api import _call
from test_kvcache import _magnitudes, kv_cases, kv_variants
from test_kvcache_manager import assert_same

# Values a careless caller passes where an integer, a float, a flag, a
# window or an array belongs.
BAD_INTS = [-1, 2**70, -(2**70), 1.5, "2", True, None, np.float32(2.0)]
BAD_REALS = [math.nan, math.inf, "0.5", 10**400, True, [1.0]]
BAD_FLAGS = [1, "False", None, np.array([True, False])]
BAD_WINDOWS = [(1.5, 2), "ab", (1, 2, 3), {1, 2}, (2**63, 0)]
BAD_ARRAYS = [None, 1.5, "x", [[1.0, 2.0]], np.zeros((2, 3), np.complex64)]


def _snapshot(x):
    """A copy of ``x`` to compare after the call: arrays copied, except
    read-only ones (broadcast views of terabytes among them), which no
    call can write and are kept as they are."""
    if isinstance(x, np.ndarray):
        return x if not x.flags.writeable else x.copy()
    if isinstance(x, dict):
        return {n: _snapshot(v) for n, v in x.items()}
    if isinstance(x, list | tuple):
        return type(x)(_snapshot(v) for v in x)
    return copy.deepcopy(x)


def _unchanged(before, after):
    for b, a in zip(before, after, strict=True):
        if isinstance(b, np.ndarray):
            assert isinstance(a, np.ndarray) and a.dtype == b.dtype
            assert np.array_equal(a, b, equal_nan=True), "input modified"
        elif isinstance(b, dict):
            assert b.keys() == a.keys()
            _unchanged(list(b.values()), list(a.values()))
        elif isinstance(b, list | tuple):
            _unchanged(list(b), list(a))


def _settled(error, hostile: bool) -> bool:
    """Whether an example is done once its call returned: refused (which
    only a hostile call may be), or hostile and accepted all the same (a
    spoiler that happened to be harmless: there is no oracle for it)."""
    if error is not None:
        event(f"refused: {type(error).__name__}")
        assert hostile, f"a valid call was refused: {error!r}"
        return True
    event("accepted")
    return hostile


def _mutate(draw, rng, args: dict, spoilers: dict) -> list[str]:
    """Replaces one or two of ``args`` by what ``spoilers[name](rng)``
    gives; returns the names spoiled."""
    names = draw(st.lists(st.sampled_from(sorted(spoilers)), min_size=1, max_size=2, unique=True))
    for name in names:
        args[name] = draw(st.sampled_from(spoilers[name](rng, args)))
    return names


# attention_with_kvcache ----------------------------------------------------


def _kv_spoilers():
    def lens(rng, a):
        n = a["cache_seqlens"]
        return [
            n + 10**6,
            -n - 1,
            n.astype(np.float32),
            np.concatenate([n, n]),
            n.astype(np.uint64) + np.uint64(2**63),
            np.broadcast_to(n[:1], (2**33,)),
            *BAD_ARRAYS[:3],
        ]

    def table(rng, a):
        t = a["block_table"]
        if t is None:
            # (cache_seqlens may be spoiled already: its length is no guide.)
            return [np.zeros((1, 1), np.int32), np.zeros((2, 1), np.int64)]
        return [t + 10**6, t - 10**6, t.astype(np.float64), t[:, None], t.T.copy(), "t"]

    def q(rng, a):
        x = a["q"]
        return [x.astype(np.int32), x[..., :-1], x[0], x.astype(np.complex64), *BAD_ARRAYS[:2]]

    def k_cache(rng, a):
        x = a["k_cache"]
        return [
            x[..., :-1],
            x.astype(np.float64),
            x[:, :, :0],
            np.broadcast_to(x[:1], (2**40, *x.shape[1:])),
        ]

    return {
        "cache_seqlens": lens,
        "block_table": table,
        "q": q,
        "k_cache": k_cache,
        "v_cache": lambda rng, a: [
            a["v_cache"][:, :1][:, :0],
            np.zeros_like(a["v_cache"], np.int8),
        ],
        "num_splits": lambda rng, a: [0, *BAD_INTS],
        "causal": lambda rng, a: BAD_FLAGS,
        "scale": lambda rng, a: BAD_REALS,
        "window": lambda rng, a: BAD_WINDOWS,
        "softcap": lambda rng, a: [-1.0, *BAD_REALS],
        "alibi_slopes": lambda rng, a: [np.ones(99), np.ones((2, 2, 2)), *BAD_ARRAYS[1:3]],
        "sinks": lambda rng, a: [np.ones(99), *BAD_ARRAYS[1:3]],
    }


@pytest.mark.parametrize("paged", [False, True])
@given(data=st.data())
def test_attention_with_kvcache(backend, paged, data):
    case = data.draw(kv_cases(backend), label="case")
    dtype = data.draw(st.sampled_from([np.float32, np.float16]), label="dtype")
    kw = data.draw(kv_variants(case), label="variants")
    q, (pool_k, pool_v, table), (k, v), lens = case.arrays(dtype)
    args = {
        "q": q,
        "k_cache": pool_k if paged else k,
        "v_cache": pool_v if paged else v,
        "cache_seqlens": lens,
        "block_table": table if paged else None,
        "causal": case.causal,
        "scale": case.scale,
        "num_splits": data.draw(st.sampled_from([None, None, 1, 3]), label="num_splits"),
        **kw,
    }
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    hostile = data.draw(st.booleans(), label="hostile")
    if hostile:
        spoiled = _mutate(data.draw, rng, args, _kv_spoilers())
        event(f"spoiled {'+'.join(spoiled)}")
    before = _snapshot(args)
    positional = [args.pop(n) for n in ("q", "k_cache", "v_cache", "cache_seqlens")]
    result, error = _call(
        flashport.attention_with_kvcache, *positional, return_lse=True, device=backend, **args
    )
    _unchanged(
        before,
        {
            **dict(zip(("q", "k_cache", "v_cache", "cache_seqlens"), positional, strict=True)),
            **args,
        },
    )
    if _settled(error, hostile):
        return
    out, lse = result
    oracle_args = (q, k, v, lens, None, case.causal, case.scale, True)
    want_out, want_lse = reference._attention_with_kvcache(*oracle_args, oracle_dtype(dtype), **kw)
    base_out, base_lse = reference._attention_with_kvcache(*oracle_args, dtype, **kw)
    scores, terms, score_terms = _magnitudes(case, q, (k, v), lens, kw)
    assert_close("o", out, want_out, base_out, dtype, scores, terms)
    assert_close("lse", lse, want_lse, base_lse, dtype, scores, max(scores, score_terms))


# attention_varlen ------------------------------------------------------------


@given(data=st.data())
def test_attention_varlen(backend, data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    dtype = data.draw(st.sampled_from([np.float32, np.float16]), label="dtype")
    batch = data.draw(st.integers(1, 3), label="batch")
    lens_q = [data.draw(st.integers(0, 6)) for _ in range(batch)]
    lens_k = [data.draw(st.integers(0, 6)) for _ in range(batch)]
    heads_kv = data.draw(st.sampled_from([1, 2]))
    heads_q = heads_kv * data.draw(st.sampled_from([1, 2]))
    d, dv = data.draw(st.integers(1, 8)), data.draw(st.integers(1, 8))
    args = {
        "q": rng.standard_normal((sum(lens_q), heads_q, d)).astype(dtype),
        "k": rng.standard_normal((sum(lens_k), heads_kv, d)).astype(dtype),
        "v": rng.standard_normal((sum(lens_k), heads_kv, dv)).astype(dtype),
        "cu_seqlens_q": np.cumsum([0, *lens_q]).astype(np.int32),
        "cu_seqlens_k": np.cumsum([0, *lens_k]).astype(np.int32),
        "causal": data.draw(st.booleans()),
    }
    hostile = data.draw(st.booleans(), label="hostile")
    if hostile:

        def cu(name):
            def spoil(rng, a):
                c = a[name]
                return [c[::-1].copy(), c + 1, c[:1], c.astype(np.float32), c - 100, c * 10**6, "c"]

            return spoil

        spoilers = {
            "cu_seqlens_q": cu("cu_seqlens_q"),
            "cu_seqlens_k": cu("cu_seqlens_k"),
            "q": lambda rng, a: [a["q"][..., :0], a["q"][None], a["q"].astype(np.int64), None],
            "k": lambda rng, a: [
                a["k"][:, :, :-1] if d > 1 else a["k"][None],
                a["k"].astype(np.float64),
            ],
            "causal": lambda rng, a: BAD_FLAGS,
            "scale": lambda rng, a: BAD_REALS,
            "window": lambda rng, a: BAD_WINDOWS,
        }
        spoiled = _mutate(data.draw, rng, args, spoilers)
        event(f"spoiled {'+'.join(spoiled)}")
    before = _snapshot(args)
    result, error = _call(flashport.attention_varlen, return_lse=True, device=backend, **args)
    _unchanged(before, args)
    if _settled(error, hostile):
        return
    out, lse = result
    names = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k")
    positional = [args[n] for n in names]
    want = reference._attention_varlen(*positional, args["causal"], None, oracle_dtype(dtype))
    base = reference._attention_varlen(*positional, args["causal"], None, dtype)
    scores = _varlen_scores(*positional[:2], *positional[3:])
    assert_close("o", out, want[0], base[0], dtype, scores)
    assert_close("lse", lse, want[1], base[1], dtype, scores, scores)


def _varlen_scores(q, k, cu_q, cu_k) -> float:
    """The largest |score| between a query and a key of its sequence (the
    softmax's conditioning, as assert_close takes it)."""
    group = q.shape[1] // k.shape[1]
    q64, k64 = q.astype(np.float64), np.repeat(k.astype(np.float64), group, axis=1)
    largest = 0.0
    for b in range(len(cu_q) - 1):
        qs, ks = q64[cu_q[b] : cu_q[b + 1]], k64[cu_k[b] : cu_k[b + 1]]
        if len(qs) and len(ks):
            s = np.einsum("qhd,khd->hqk", qs, ks) / math.sqrt(q.shape[2])
            largest = max(largest, float(np.abs(s).max()))
    return largest


# merge_states ------------------------------------------------------------------


def _merge64(outs, lses):
    """The merge in float64, as merge_states documents it: a row whose
    every part is empty gets o = 0 and lse = -inf."""
    outs = np.stack([o.astype(np.float64) for o in outs])
    lses = np.stack([x.astype(np.float64) for x in lses])
    top = lses.max(axis=0)
    finite = np.isfinite(top)
    safe = np.where(finite, top, 0.0)
    w = np.where(np.isfinite(lses), np.exp(lses - safe), 0.0)
    total = w.sum(axis=0)
    lse = np.where(finite, safe + np.log(np.where(finite, total, 1.0)), -np.inf)
    out = np.where(finite[..., None], (w[..., None] * outs).sum(axis=0), 0.0)
    out = out / np.where(finite, total, 1.0)[..., None]
    return out, lse


@given(data=st.data())
def test_merge_states(backend, data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    dtype = data.draw(st.sampled_from([np.float32, np.float16, np.float64]), label="dtype")
    parts = data.draw(st.integers(1, 4), label="parts")
    shape = data.draw(st.sampled_from([(3, 4), (2, 1, 5, 3), (1, 7)]), label="shape")
    outs = [rng.standard_normal(shape).astype(dtype) for _ in range(parts)]
    lse_dtype = np.float64 if dtype == np.float64 else np.float32
    lses = [(rng.standard_normal(shape[:-1]) * 3).astype(lse_dtype) for _ in range(parts)]
    for x in lses:
        x[rng.random(x.shape) < 0.2] = -np.inf  # parts that saw no key
    args = {"outs": outs, "lses": lses}
    hostile = data.draw(st.booleans(), label="hostile")
    if hostile:
        spoilers = {
            "outs": lambda rng, a: [
                [],
                "abc",
                a["outs"] + [a["outs"][0][..., :1]],
                np.stack(a["outs"])[:0],
                None,
            ],
            "lses": lambda rng, a: [
                a["lses"][:-1] or [],
                [x.astype(np.float16) for x in a["lses"]],
                [x[..., None] for x in a["lses"]],
                3.0,
            ],
        }
        spoiled = _mutate(data.draw, rng, args, spoilers)
        event(f"spoiled {'+'.join(spoiled)}")
    before = _snapshot(args)
    device = "cpu" if dtype == np.float64 else backend
    result, error = _call(flashport.merge_states, args["outs"], args["lses"], device=device)
    _unchanged(before, args)
    if _settled(error, hostile):
        return
    out, lse = result
    want_out, want_lse = _merge64(outs, lses)
    tol = {np.float16: 2e-3, np.float32: 1e-6, np.float64: 1e-12}[dtype]
    np.testing.assert_allclose(lse, want_lse, rtol=tol, atol=tol)
    np.testing.assert_allclose(out.astype(np.float64), want_out, rtol=tol, atol=tol * 4)


# KVCache ---------------------------------------------------------------------


def _cache_op(cache, op, sid, k, v, q):
    if op == "new":
        return cache.new_sequence()
    if op == "append":
        return cache.append(sid, k, v)
    if op == "fork":
        return cache.fork(sid)
    if op == "free":
        return cache.free(sid)
    return cache.attention(q, [sid])


@given(data=st.data())
def test_kvcache_under_hostile_calls(backend, data):
    """Random appends, forks, frees and attention with hostile arguments
    mixed in: a failed call leaves the cache bitwise as it was, a valid
    one agrees with the oracle on the tokens appended so far."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    heads_kv, group, d, dv, block = 2, 2, 4, 3, 2
    cache = flashport.KVCache(6, block, heads_kv, d, head_dim_v=dv, device=backend)
    model: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for _ in range(data.draw(st.integers(1, 12), label="steps")):
        op = data.draw(st.sampled_from(["new", "append", "fork", "free", "attention"]), label="op")
        hostile = data.draw(st.booleans(), label="hostile")
        live = sorted(model)
        sid = data.draw(st.sampled_from(live), label="sid") if live else 0
        if hostile:
            sid = data.draw(st.sampled_from([*BAD_INTS, 99, True]), label="bad sid")
        before = cache_state(cache)
        n = data.draw(st.integers(0, 3), label="n")
        k = rng.standard_normal((heads_kv, n, d)).astype(np.float32)
        v = rng.standard_normal((heads_kv, n, dv)).astype(np.float32)
        if hostile and op == "append":
            k, v = data.draw(
                st.sampled_from(
                    [(k[..., :-1], v), (k, v[:1]), (k.astype(np.int32), v), (None, v), (k, "v")]
                )
            )
        q = rng.standard_normal((1, heads_kv * group, 1, d)).astype(np.float32)
        saved = _snapshot([k, v, q])
        result, error = _call(_cache_op, cache, op, sid, k, v, q)
        _unchanged(saved, [k, v, q])
        if error is not None:
            event(f"{op} refused: {type(error).__name__}")
            assert_same(before, cache_state(cache))
            continue
        event(f"{op} done")
        if op == "new":
            model[result] = (np.zeros((heads_kv, 0, d)), np.zeros((heads_kv, 0, dv)))
        elif op == "append":
            mk, mv = model[sid]
            model[sid] = (np.concatenate([mk, k], 1), np.concatenate([mv, v], 1))
        elif op == "fork":
            model[result] = model[sid]
        elif op == "free":
            del model[sid]
        else:
            mk, mv = model[sid]
            want = reference.attention(q.astype(np.float64), mk[None], mv[None])
            np.testing.assert_allclose(result, want, rtol=1e-5, atol=1e-5)
        assert sorted(model) == cache.sequences
        for s, (mk, _) in model.items():
            assert cache.length(s) == mk.shape[1]


# flashport.torch -------------------------------------------------------------


@given(data=st.data())
def test_torch_sdpa(data):
    torch = pytest.importorskip("torch")
    import flashport.torch as fpt
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1), label="seed"))
    dtype = data.draw(st.sampled_from([torch.float32, torch.float64]), label="dtype")
    heads_kv = data.draw(st.sampled_from([1, 2]))
    heads_q = heads_kv * data.draw(st.sampled_from([1, 2]))
    L, S, E = (
        data.draw(st.integers(1, 6)),
        data.draw(st.integers(1, 6)),
        data.draw(st.integers(1, 8)),
    )
    args = {
        "query": torch.randn(2, heads_q, L, E, dtype=dtype, generator=g, requires_grad=True),
        "key": torch.randn(2, heads_kv, S, E, dtype=dtype, generator=g, requires_grad=True),
        "value": torch.randn(2, heads_kv, S, E, dtype=dtype, generator=g, requires_grad=True),
        "attn_mask": data.draw(st.sampled_from([None, "bool", "float"])),
        "is_causal": False,
        "scale": data.draw(st.sampled_from([None, 0.5])),
        "enable_gqa": heads_q != heads_kv,
    }
    if args["attn_mask"] == "bool":
        args["attn_mask"] = torch.rand(L, S, generator=g) < 0.8
        args["attn_mask"][:, 0] = True  # every row sees a key, as torch needs
    elif args["attn_mask"] == "float":
        args["attn_mask"] = torch.randn(1, heads_q, L, S, dtype=dtype, generator=g)
    else:
        args["is_causal"] = data.draw(st.booleans())
    hostile = data.draw(st.booleans(), label="hostile")
    if hostile:
        rng = np.random.default_rng(0)
        spoilers = {
            "query": lambda rng, a: [
                a["query"].int(),
                a["query"][..., :-1] if E > 1 else a["query"][0],
                a["query"].detach().numpy(),
                None,
            ],
            "key": lambda rng, a: [a["key"].to(torch.complex64), a["key"][:, :, :0]],
            "attn_mask": lambda rng, a: [
                torch.ones(3, 99, dtype=torch.bool),
                torch.ones(L, S, dtype=torch.int32),
            ],
            "is_causal": lambda rng, a: [True] if a["attn_mask"] is not None else ["yes"],
            "scale": lambda rng, a: BAD_REALS,
            "enable_gqa": lambda rng, a: [not a["enable_gqa"]] if heads_q != heads_kv else ["no"],
        }
        spoiled = _mutate(data.draw, rng, args, spoilers)
        event(f"spoiled {'+'.join(spoiled)}")
    result, error = _call(fpt.scaled_dot_product_attention, **args)
    if _settled(error, hostile):
        return
    want = F.scaled_dot_product_attention(
        **{
            n: x.double() if torch.is_tensor(x) and x.is_floating_point() else x
            for n, x in args.items()
        }
    )
    tol = 1e-5 if dtype == torch.float32 else 1e-10
    torch.testing.assert_close(result.double(), want, rtol=tol, atol=tol)
    grads = torch.autograd.grad(result.sum(), [args["query"], args["key"], args["value"]])
    want_grads = torch.autograd.grad(want.sum(), [args["query"], args["key"], args["value"]])
    for got, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got.double(), w.double(), rtol=tol * 10, atol=tol * 10)
