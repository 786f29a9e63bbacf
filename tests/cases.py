"""Random attention problems and the error measure the property tests use."""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass

import flashport
import numpy as np
from flashport import reference
from hypothesis import strategies as st

# Software adapters (lavapipe) run a few GFLOP/s: the GPU gets smaller shapes.
MAX_SEQ = {"cpu": 300, "gpu": 72}
MAX_DIM = {"cpu": 256, "gpu": 256}


@dataclass(frozen=True)
class Case:
    batch: int
    heads_kv: int
    group: int
    seq_q: int
    seq_k: int
    d: int
    dv: int
    causal: bool
    scale: float | None
    ndim: int
    seed: int

    @property
    def heads_q(self) -> int:
        return self.heads_kv * self.group

    def arrays(self, dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """q, k, v and an output gradient, standard normal (never zeros)."""
        rng = np.random.default_rng(self.seed)
        lead_q = (self.batch, self.heads_q)[4 - self.ndim :] if self.ndim > 2 else ()
        lead_k = (self.batch, self.heads_kv)[4 - self.ndim :] if self.ndim > 2 else ()
        shapes = [
            (*lead_q, self.seq_q, self.d),
            (*lead_k, self.seq_k, self.d),
            (*lead_k, self.seq_k, self.dv),
            (*lead_q, self.seq_q, self.dv),
        ]
        q, k, v, do = (rng.standard_normal(s).astype(dtype) for s in shapes)
        return q, k, v, do


@st.composite
def cases(draw, backend: str = "cpu", max_seq: int | None = None, max_work: float = 6e7) -> Case:
    """Random shapes; ``max_work`` caps batch·heads·seq_q·seq_k·(d + d_v)
    (the default keeps the float64 oracle and lavapipe fast)."""
    max_seq = max_seq or MAX_SEQ[backend]
    max_dim = MAX_DIM[backend]
    ndim = draw(st.sampled_from([4, 4, 4, 3, 2]))
    batch = draw(st.integers(1, 3)) if ndim == 4 else 1
    heads_kv = draw(st.integers(1, 3)) if ndim >= 3 else 1
    group = draw(st.sampled_from([1, 1, 2, 3, 4])) if ndim >= 3 else 1
    seq_q = draw(st.integers(1, max_seq))
    seq_k = draw(st.one_of(st.just(seq_q), st.integers(1, max_seq)))
    d = draw(st.one_of(st.sampled_from([16, 32, 64, 128]), st.integers(1, max_dim)))
    dv = draw(st.one_of(st.just(d), st.integers(1, max_dim)))
    causal = draw(st.booleans())
    scale = draw(st.one_of(st.none(), st.floats(0.01, 2.0)))
    work = batch * heads_kv * group * seq_q * seq_k * (d + dv)
    if work > max_work:
        shrink = (max_work / work) ** 0.5
        seq_q = max(1, int(seq_q * shrink))
        seq_k = max(1, int(seq_k * shrink))
    seed = draw(st.integers(0, 2**32 - 1))
    return Case(batch, heads_kv, group, seq_q, seq_k, d, dv, causal, scale, ndim, seed)


VARIANT_NAMES = ("window", "mask", "alibi", "softcap", "sinks", "dropout")


@dataclass(frozen=True)
class Variants:
    """The variant keywords of one problem, as a printable spec; ``kwargs``
    builds the arrays (deterministically from ``seed``)."""

    window: tuple[int | None, int | None] | None = None
    # "bool" or "float", in shape ``mask_shape`` (before broadcasting),
    # float ones in ``mask_dtype`` ("same" = the inputs' dtype).
    mask: str | None = None
    mask_shape: tuple[int, ...] = ()
    mask_dtype: str = "same"
    mask_density: float = 0.5  # bool: P(True); float: P(-inf) is 1 - density
    mask_dead_row: bool = False  # hide every key of the first row
    alibi: str | None = None  # "heads" (heads_q,) or "batch" (batch, heads_q)
    softcap: float | None = None
    sinks: bool = False
    sink_scale: float = 1.0
    param_dtype: str = "same"  # dtype of slopes and sinks
    dropout_p: float = 0.0
    dropout_seed: int | None = None
    seed: int = 0

    def kwargs(self, case: Case, dtype) -> dict:
        rng = np.random.default_rng(self.seed)
        same = np.dtype(dtype)
        param_dtype = same if self.param_dtype == "same" else np.dtype(self.param_dtype)
        kw: dict = {}
        if self.window is not None:
            kw["window"] = self.window
        if self.mask is not None:
            shape = self.mask_shape
            if self.mask == "bool":
                m = rng.random(shape) < self.mask_density
                if self.mask_dead_row and m.ndim >= 2:
                    m[..., 0, :] = False
            else:
                mask_dtype = same if self.mask_dtype == "same" else np.dtype(self.mask_dtype)
                m = rng.standard_normal(shape) * 2.0
                m[rng.random(shape) >= self.mask_density] = -np.inf
                if self.mask_dead_row and m.ndim >= 2:
                    m[..., 0, :] = -np.inf
                m = m.astype(mask_dtype)
            kw["mask"] = m
        if self.alibi is not None:
            shape = (case.heads_q,) if self.alibi == "heads" else (case.batch, case.heads_q)
            kw["alibi_slopes"] = rng.uniform(0.0, 1.0, shape).astype(param_dtype)
        if self.softcap is not None:
            kw["softcap"] = self.softcap
        if self.sinks:
            kw["sinks"] = (rng.standard_normal(case.heads_q) * self.sink_scale).astype(param_dtype)
        if self.dropout_p:
            kw["dropout_p"] = self.dropout_p
            kw["seed"] = self.dropout_seed
        return kw


@st.composite
def variants(draw, case: Case, names=VARIANT_NAMES, each: bool = False) -> Variants:
    """Variant keywords for ``case``: all of ``names`` when ``each``, else a
    random subset of them."""
    on = {n: True for n in names} if each else {n: draw(st.booleans()) for n in names}
    spec: dict = {"seed": draw(st.integers(0, 2**32 - 1))}
    longest = max(case.seq_q, case.seq_k) + 2
    if on.get("window"):
        side = st.one_of(st.none(), st.just(-1), st.integers(0, 8), st.integers(0, longest))
        spec["window"] = (draw(side), draw(side))
    if on.get("mask"):
        spec["mask"] = draw(st.sampled_from(["bool", "float"]))
        full = (case.batch, case.heads_q, case.seq_q, case.seq_k)
        ndim = draw(st.integers(1, 4))
        spec["mask_shape"] = tuple(
            draw(st.sampled_from([size, size, 1])) for size in full[4 - ndim :]
        )
        spec["mask_dtype"] = draw(st.sampled_from(["same", "same", "float64"]))
        spec["mask_density"] = draw(st.sampled_from([0.1, 0.5, 0.9, 1.0]))
        spec["mask_dead_row"] = draw(st.booleans())
    if on.get("alibi"):
        spec["alibi"] = draw(st.sampled_from(["heads", "batch"]))
    if on.get("softcap"):
        spec["softcap"] = draw(st.one_of(st.sampled_from([1.0, 30.0]), st.floats(0.1, 50.0)))
    if on.get("sinks"):
        spec["sinks"] = True
        spec["sink_scale"] = draw(st.sampled_from([0.5, 1.0, 4.0]))
    if on.get("alibi") or on.get("sinks"):
        spec["param_dtype"] = draw(st.sampled_from(["same", "float64"]))
    if on.get("dropout"):
        spec["dropout_p"] = draw(st.one_of(st.sampled_from([0.1, 0.5, 0.9]), st.floats(0.0, 0.95)))
        spec["dropout_seed"] = draw(st.integers(0, 2**64 - 1))
    return Variants(**spec)


def eps(dtype) -> float:
    """Machine epsilon of ``dtype``, bfloat16 (which NumPy's finfo does not
    know) through ml_dtypes."""
    if np.dtype(dtype).name == "bfloat16":
        import ml_dtypes

        return float(ml_dtypes.finfo(dtype).eps)
    return float(np.finfo(dtype).eps)


def oracle_dtype(dtype):
    """The precision the oracle must beat the kernel by: float64 for float16
    and float32 kernels, extended precision for float64 kernels (on x86,
    numpy's longdouble has a 64-bit mantissa)."""
    return np.longdouble if dtype == np.float64 else np.float64


# ``**variants`` below are the variant keywords of flashport.attention
# (window, mask, alibi_slopes, softcap, sinks, dropout_p, seed); the
# backward ones also take return_dmask.


def oracle(case: Case, q, k, v, dtype, **variants):
    return reference._attention(
        q, k, v, case.causal, case.scale, True, oracle_dtype(dtype), **variants
    )


def oracle_backward(case: Case, do, q, k, v, dtype, **variants):
    return reference._attention_backward(
        do, q, k, v, case.causal, case.scale, oracle_dtype(dtype), **variants
    )


def naive(case: Case, q, k, v, dtype, **variants):
    """Plain attention computed in ``dtype``: the same-precision baseline."""
    return reference._attention(q, k, v, case.causal, case.scale, True, dtype, **variants)


def naive_backward(case: Case, do, q, k, v, dtype, **variants):
    return reference._attention_backward(do, q, k, v, case.causal, case.scale, dtype, **variants)


def _score_kwargs(variants: dict) -> dict:
    names = ("window", "mask", "alibi_slopes", "softcap", "q_offset", "k_offset")
    return {n: variants[n] for n in names if n in variants}


def score_magnitude(case: Case, q, k, **variants) -> float:
    """Largest |score| over the scores the queries see: the final ``s``, and
    with softcap also the scaled ``u`` before capping (rounding ``u`` moves
    ``t`` by as much)."""
    q4, _ = reference._as_4d(q, np.float64)
    k4, _ = reference._as_4d(k, np.float64)
    s, visible, _, _, (u, _) = reference._scores(
        q4, k4, case.causal, case.scale, **_score_kwargs(variants)
    )
    if not visible.any():
        return 0.0
    return float(max(np.abs(s[visible]).max(), np.abs(u[visible]).max()))


def term_magnitudes(case: Case, do, q, k, v, **variants) -> dict[str, float]:
    """For each result, the largest sum of the absolute values of the terms
    that add up to one of its elements, in float64: ``Σ_j P_ij Z_ij |v_j|``
    for ``o``, ``|lse|`` or a seen score's ``scale · Σ_c |q_c k_c|`` for
    ``lse``, ``scale · Σ_j P_ij (|dP_ij| + |D_i|) |k_j|`` for ``dq``, and so
    on (``dsinks``: ``Σ_i exp(sink - lse_i) Σ_c |do_ic o_ic|``; ``dmask``:
    ``dS``'s terms summed over the mask's broadcast dimensions).

    Rounding errors scale with these sums, not with the result: dq is 0 when
    a row sees one key, while its terms are not."""
    f64 = np.float64
    q4, _ = reference._as_4d(q, f64)
    k4, _ = reference._as_4d(k, f64)
    v4, _ = reference._as_4d(v, f64)
    do4 = np.asarray(do, dtype=f64).reshape((*q4.shape[:3], v4.shape[-1]))
    s, visible, group, scale, _ = reference._scores(
        q4, k4, case.causal, case.scale, **_score_kwargs(variants)
    )
    sinks = variants.get("sinks")
    p, lse = reference._probabilities(s, visible, sinks)
    z = reference._dropout_factor(p.shape, variants.get("dropout_p"), variants.get("seed"), f64)
    pz = p if z is None else p * z
    k_rep, v_rep = np.repeat(k4, group, axis=1), np.repeat(v4, group, axis=1)
    out = pz @ v_rep
    a = np.abs
    dp_abs = a(do4 @ v_rep.swapaxes(-1, -2)) * (1.0 if z is None else z)
    delta_terms = (a(do4) * a(out)).sum(-1, keepdims=True)
    # dS = P ∘ (dP - D): the subtraction's terms count, not its difference
    # (which is exactly 0 when a row sees one key). The softcap factor
    # (1 - tanh²) is at most 1.
    ds_abs = p * (dp_abs + delta_terms)
    # A score is summed from scale · q_i k_i: rounded relative to those
    # terms, which can be far larger than the score (cancellation), and the
    # lse inherits it (with one key, lse is that score).
    score_terms = np.where(visible, abs(scale) * (a(q4) @ a(k_rep).swapaxes(-1, -2)), 0.0)
    lse_terms = np.maximum(a(np.where(np.isfinite(lse), lse, 0.0)), score_terms.max(-1))
    sums = {
        "o": pz @ a(v_rep),
        "lse": lse_terms[np.isfinite(lse)],
        "dq": abs(scale) * ds_abs @ a(k_rep),
        "dk": abs(scale) * ds_abs.swapaxes(-1, -2) @ a(q4),
        "dv": pz.swapaxes(-1, -2) @ a(do4),
    }
    if "mask" in variants:
        sums["dmask"] = reference._reduce_to_shape(ds_abs, np.shape(variants["mask"]))
    if sinks is not None:
        sink = np.asarray(sinks, f64)[None, :, None]
        finite = np.isfinite(lse)
        weight = np.where(finite, np.exp(sink - np.where(finite, lse, 0.0)), 0.0)
        sums["dsinks"] = (weight * delta_terms[..., 0]).sum(axis=(0, 2))
    return {name: float(x.max()) if x.size else 0.0 for name, x in sums.items()}


def assert_close(
    name: str, got, want, baseline, dtype, scores: float = 0.0, terms: float = 0.0
) -> None:
    """The error of ``got`` against the oracle must be at most twice the error
    of a naive implementation in the same precision (flash-attention's own
    test criterion, which adapts to each shape's conditioning instead of a
    tolerance chosen by eye), plus a floor for the naive error being small by
    luck: 8 ulps of the magnitude of the terms summed (``terms``, see
    term_magnitudes, or the result's magnitude if larger), times the largest
    score magnitude ``scores`` when that exceeds 1. The second factor is the
    softmax's conditioning: merely rounding a score of size M to working
    precision moves exp(score), and so every output, by a relative M·eps."""
    got = np.asarray(got, dtype=np.longdouble)
    want = np.asarray(want, dtype=np.longdouble)
    baseline = np.asarray(baseline, dtype=np.longdouble)
    assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
    assert not np.isnan(got).any(), f"{name}: NaN in result"
    if want.size == 0:
        return
    finite = np.isfinite(want)
    assert np.array_equal(np.isinf(got), ~finite), f"{name}: -inf pattern differs"
    assert np.array_equal(got[~finite], want[~finite]), f"{name}: infinities differ"
    if not finite.any():
        return
    err = np.abs(got[finite] - want[finite]).max()
    naive_err = np.abs(baseline[finite] - want[finite]).max()
    magnitude = max(np.abs(want[finite]).max(), 1e-30)
    floor = 8 * eps(dtype) * max(magnitude, terms) * max(1.0, scores)
    assert err <= 2 * naive_err + floor, (
        f"{name}: max error {err:.3g} > 2 × naive {dtype.__name__} error "
        f"{naive_err:.3g} + floor {floor:.3g} (max |ref| {magnitude:.3g})"
    )


def assert_backends_agree(case: Case, results: dict, q, k, v, do, dtype, **variants) -> None:
    """``results`` maps "cpu" and the GPU to their ``(out, dq, dk, dv)``: the
    two compute the same function, so they may differ by at most what each
    may differ from the oracle (twice a naive same-precision implementation's
    error, plus the floor of :func:`assert_close`), added up."""
    want = (
        oracle(case, q, k, v, dtype, **variants)[0],
        *oracle_backward(case, do, q, k, v, dtype, **variants),
    )
    baseline = (
        naive(case, q, k, v, dtype, **variants)[0],
        *naive_backward(case, do, q, k, v, dtype, **variants),
    )
    scores = score_magnitude(case, q, k, **variants)
    terms = term_magnitudes(case, do, q, k, v, **variants)
    (cpu, *others) = ["cpu", *(name for name in results if name != "cpu")]
    assert len(others) == 1, f"expected cpu and one GPU, got {list(results)}"
    for i, name in enumerate(("o", "dq", "dk", "dv")):
        on_cpu, on_gpu = (np.asarray(results[d][i], np.float64) for d in (cpu, others[0]))
        ref, base = np.asarray(want[i], np.float64), np.asarray(baseline[i], np.float64)
        if ref.size == 0:
            continue
        naive_err = np.abs(base - ref).max()
        magnitude = max(np.abs(ref).max(), terms[name], 1e-30)
        floor = 8 * eps(dtype) * magnitude * max(1.0, scores)
        gap = np.abs(on_cpu - on_gpu).max()
        assert gap <= 2 * (2 * naive_err + floor), f"{name}: cpu and gpu differ by {gap:.3g}"


def _snapshot(*arrays):
    return [copy.deepcopy(a) for a in arrays]


def _assert_unchanged(before, after):
    for b, a in zip(before, after, strict=True):
        if isinstance(b, np.ndarray):
            assert a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True), "input modified"
        elif isinstance(b, dict):
            _assert_unchanged(list(b.values()), list(a.values()))


def check_against_oracle(case: Case, kw: dict, dtype, backend: str) -> None:
    """Forward (o, lse) and backward (dq, dk, dv, dsinks, dmask) of ``case``
    with the keywords ``kw`` (variants, positions) against the oracle, with
    assert_close's tolerance rule; the inputs must come back unmodified."""
    q, k, v, do = case.arrays(dtype)
    before = _snapshot(q, k, v, do, kw)
    common = {"causal": case.causal, "scale": case.scale, "device": backend, **kw}
    out, lse = flashport.attention(q, k, v, return_lse=True, **common)
    assert out.dtype == dtype and out.shape == (*q.shape[:-1], v.shape[-1])
    assert lse.dtype == (np.float64 if dtype == np.float64 else np.float32)
    want_out, want_lse = oracle(case, q, k, v, dtype, **kw)
    base_out, base_lse = naive(case, q, k, v, dtype, **kw)
    scores = score_magnitude(case, q, k, **kw)
    terms = term_magnitudes(case, do, q, k, v, **kw)
    assert_close("o", out, want_out, base_out, dtype, scores, terms["o"])
    assert_close("lse", lse, want_lse, base_lse, dtype, scores, terms["lse"])

    mask = kw.get("mask")
    return_dmask = mask is not None and mask.dtype != np.bool_
    grads = flashport.attention_backward(do, q, k, v, out, lse, return_dmask=return_dmask, **common)
    want = oracle_backward(case, do, q, k, v, dtype, return_dmask=return_dmask, **kw)
    baseline = naive_backward(case, do, q, k, v, dtype, return_dmask=return_dmask, **kw)
    names, like = ["dq", "dk", "dv"], [q, k, v]
    if "sinks" in kw:
        names.append("dsinks")
        like.append(kw["sinks"])
    if return_dmask:
        names.append("dmask")
        like.append(mask)
    assert len(grads) == len(names), f"{len(grads)} gradients, expected {names}"
    for name, g, w, b, x in zip(names, grads, want, baseline, like, strict=True):
        assert g.shape == x.shape and g.dtype == x.dtype, (name, g.shape, g.dtype, x.dtype)
        assert_close(name, g, w, b, dtype, scores, terms[name])
    _assert_unchanged(before, [q, k, v, do, kw])


@st.composite
def splits(draw, seq_k: int) -> list[tuple[int, int]]:
    """1 to 5 consecutive key blocks covering ``0..seq_k``, empty ones too."""
    count = draw(st.integers(1, 5))
    cuts = sorted(draw(st.lists(st.integers(0, seq_k), min_size=count - 1, max_size=count - 1)))
    bounds = [0, *cuts, seq_k]
    return list(itertools.pairwise(bounds))


def naive_merge(outs, lses, dtype):
    """The same-precision baseline of a merge: the formula in ``dtype`` (in
    float16's case, float16 arithmetic), the parts in order."""
    lses = [np.asarray(x, dtype) for x in lses]
    outs = [np.asarray(x, dtype) for x in outs]
    stacked = np.stack(lses)
    finite = np.isfinite(stacked)
    m = np.where(finite.any(axis=0), np.where(finite, stacked, -np.inf).max(axis=0), 0)
    with np.errstate(invalid="ignore", over="ignore"):
        w = np.where(finite, np.exp(stacked - m), 0).astype(dtype)
    s = w.sum(axis=0)
    out = np.zeros_like(outs[0])
    for wi, oi in zip(w, outs, strict=True):
        with np.errstate(invalid="ignore", divide="ignore"):
            out = out + np.where(s[..., None] > 0, (wi / s)[..., None] * oi, 0).astype(dtype)
    with np.errstate(divide="ignore"):
        lse = np.where(s > 0, m + np.log(np.where(s > 0, s, 1)), -np.inf)
    return out.astype(dtype), lse.astype(dtype)
