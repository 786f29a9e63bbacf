"""Random attention problems and the error measure the property tests use."""

from __future__ import annotations

from dataclasses import dataclass

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
def cases(draw, backend: str = "cpu", max_seq: int | None = None) -> Case:
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
    # Keep the float64 oracle and lavapipe fast: at most ~60 M multiply-adds.
    work = batch * heads_kv * group * seq_q * seq_k * (d + dv)
    if work > 6e7:
        shrink = (6e7 / work) ** 0.5
        seq_q = max(1, int(seq_q * shrink))
        seq_k = max(1, int(seq_k * shrink))
    seed = draw(st.integers(0, 2**32 - 1))
    return Case(batch, heads_kv, group, seq_q, seq_k, d, dv, causal, scale, ndim, seed)


def oracle_dtype(dtype):
    """The precision the oracle must beat the kernel by: float64 for float16
    and float32 kernels, extended precision for float64 kernels (on x86,
    numpy's longdouble has a 64-bit mantissa)."""
    return np.longdouble if dtype == np.float64 else np.float64


def oracle(case: Case, q, k, v, dtype):
    return reference._attention(q, k, v, case.causal, case.scale, True, oracle_dtype(dtype))


def oracle_backward(case: Case, do, q, k, v, dtype):
    return reference._attention_backward(do, q, k, v, case.causal, case.scale, oracle_dtype(dtype))


def naive(case: Case, q, k, v, dtype):
    """Plain attention computed in ``dtype``: the same-precision baseline."""
    return reference._attention(q, k, v, case.causal, case.scale, True, dtype)


def naive_backward(case: Case, do, q, k, v, dtype):
    return reference._attention_backward(do, q, k, v, case.causal, case.scale, dtype)


def score_magnitude(case: Case, q, k) -> float:
    """Largest |scale · q·k| over the scores the queries see."""
    q4, _ = reference._as_4d(q, np.float64)
    k4, _ = reference._as_4d(k, np.float64)
    s, visible, _, _ = reference._scores(q4, k4, case.causal, case.scale)
    return float(np.abs(s[visible]).max()) if visible.any() else 0.0


def term_magnitudes(case: Case, do, q, k, v) -> dict[str, float]:
    """For each result, the largest sum of the absolute values of the terms
    that add up to one of its elements, in float64: ``Σ_j P_ij |v_j|`` for
    ``o``, ``scale · Σ_j P_ij (|dP_ij| + |D_i|) |k_j|`` for ``dq``, and so on.

    Rounding errors scale with these sums, not with the result: dq is 0 when
    a row sees one key, while its terms are not."""
    f64 = np.float64
    q4, _ = reference._as_4d(q, f64)
    k4, _ = reference._as_4d(k, f64)
    v4, _ = reference._as_4d(v, f64)
    do4 = np.asarray(do, dtype=f64).reshape((*q4.shape[:3], v4.shape[-1]))
    s, visible, group, scale = reference._scores(q4, k4, case.causal, case.scale)
    p, lse = reference._probabilities(s, visible)
    k_rep, v_rep = np.repeat(k4, group, axis=1), np.repeat(v4, group, axis=1)
    out = p @ v_rep
    # dS = P ∘ (dP - D): the subtraction's terms count, not its difference
    # (which is exactly 0 when a row sees one key).
    ds_abs = p * (np.abs(do4 @ v_rep.swapaxes(-1, -2)) + np.abs((do4 * out).sum(-1, keepdims=True)))
    a = np.abs
    sums = {
        "o": p @ a(v_rep),
        "lse": a(lse[np.isfinite(lse)]),
        "dq": abs(scale) * ds_abs @ a(k_rep),
        "dk": abs(scale) * ds_abs.swapaxes(-1, -2) @ a(q4),
        "dv": p.swapaxes(-1, -2) @ a(do4),
    }
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
    floor = 8 * np.finfo(dtype).eps * max(magnitude, terms) * max(1.0, scores)
    assert err <= 2 * naive_err + floor, (
        f"{name}: max error {err:.3g} > 2 × naive {dtype.__name__} error "
        f"{naive_err:.3g} + floor {floor:.3g} (max |ref| {magnitude:.3g})"
    )
