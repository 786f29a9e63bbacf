"""merge_states on every backend: attention over random splits of the keys
(parts of any size, 0 included; causal and windows leaving parts empty for
some rows and rows empty altogether), merged in the stacked and the
sequence form, against the oracle of the whole attention; the empty-row
and invalid-lse rules; determinism; inputs never modified; DeviceArrays;
errors naming the argument."""

from __future__ import annotations

import copy
import dataclasses

import flashport
import numpy as np
import pytest
from cases import (
    assert_close,
    cases,
    naive,
    naive_merge,
    oracle,
    score_magnitude,
    splits,
    term_magnitudes,
)
from conftest import overrides
from flashport import DTypeError, InvalidArgumentError, ShapeError
from hypothesis import given
from hypothesis import strategies as st

DTYPES = [np.float32, np.float64, np.float16]
MAX_WORK = {"cpu": 2e7, "gpu": 3e6}


def _dtype_for(backend, dtype):
    return np.float32 if backend == "gpu" and dtype == np.float64 else dtype


def _lse_dtype(dtype):
    return np.float64 if dtype == np.float64 else np.float32


@given(data=st.data(), dtype=st.sampled_from(DTYPES))
def test_merged_key_blocks_match_the_whole_attention(backend, data, dtype):
    dtype = _dtype_for(backend, dtype)
    case = data.draw(cases(backend, max_work=MAX_WORK[backend]), label="case")
    window = data.draw(
        st.one_of(
            st.none(),
            st.tuples(
                st.one_of(st.none(), st.integers(0, 20)), st.one_of(st.none(), st.integers(0, 20))
            ),
        ),
        label="window",
    )
    blocks = data.draw(splits(case.seq_k), label="blocks")
    q, k, v, do = case.arrays(dtype)
    kw = {"window": window} if window is not None else {}
    common = {"causal": case.causal, "scale": case.scale, "device": backend, **kw}
    q_offset = case.seq_k - case.seq_q
    outs, lses, naive_outs, naive_lses = [], [], [], []
    for start, end in blocks:
        position = {"q_offset": q_offset, "k_offset": start}
        kb, vb = k[..., start:end, :], v[..., start:end, :]
        o, lse = flashport.attention(q, kb, vb, return_lse=True, **position, **common)
        outs.append(o)
        lses.append(lse)
        part = dataclasses.replace(case, seq_k=end - start)
        no, nl = naive(part, q, kb, vb, dtype, **position, **kw)
        naive_outs.append(no)
        naive_lses.append(nl)
    form_outs = data.draw(st.sampled_from(["sequence", "stacked"]), label="outs form")
    form_lses = data.draw(st.sampled_from(["sequence", "stacked"]), label="lses form")
    args = (
        np.stack(outs) if form_outs == "stacked" else outs,
        np.stack(lses) if form_lses == "stacked" else lses,
    )
    before = copy.deepcopy(args)
    out, lse = flashport.merge_states(*args, device=backend)
    for b, a in zip(before, args, strict=True):
        assert all(np.array_equal(x, y) for x, y in zip(b, a, strict=True)), "input modified"
    assert out.dtype == dtype and out.shape == outs[0].shape
    assert lse.dtype == _lse_dtype(dtype) and lse.shape == lses[0].shape
    want_out, want_lse = oracle(case, q, k, v, dtype, **kw)
    base_out, base_lse = naive_merge(naive_outs, naive_lses, dtype)
    scores = score_magnitude(case, q, k, **kw)
    terms = term_magnitudes(case, do, q, k, v, **kw)
    assert_close("o", out, want_out, base_out, dtype, scores, terms["o"])
    assert_close("lse", lse, want_lse, base_lse, dtype, scores, terms["lse"])
    again = flashport.merge_states(*args, device=backend)
    assert again[0].tobytes() == out.tobytes() and again[1].tobytes() == lse.tobytes()


def _states(dtype=np.float32, parts=3, shape=(2, 3, 5, 4), seed=0):
    rng = np.random.default_rng(seed)
    outs = [rng.standard_normal(shape).astype(dtype) for _ in range(parts)]
    lses = [(rng.standard_normal(shape[:-1]) * 3).astype(_lse_dtype(dtype)) for _ in range(parts)]
    return outs, lses


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: t.__name__)
def test_empty_parts_and_empty_rows(backend, dtype):
    """A part whose lse is -inf is not read (its out may be NaN); a row whose
    every part is empty gives 0 and -inf; a single part is itself."""
    dtype = _dtype_for(backend, dtype)
    outs, lses = _states(dtype)
    outs[1][0, 1] = np.nan
    lses[1][0, 1] = -np.inf
    for x in lses:
        x[1, 2, 3] = -np.inf
    out, lse = flashport.merge_states(outs, lses, device=backend)
    assert np.all(out[1, 2, 3] == 0) and not np.signbit(out[1, 2, 3]).any()
    assert lse[1, 2, 3] == -np.inf
    rest = [(o[0, 1], x[0, 1]) for o, x in zip(outs, lses, strict=True) if x is not lses[1]]
    want, want_lse = flashport.merge_states(
        [o for o, _ in rest], [x for _, x in rest], device=backend
    )
    np.testing.assert_array_equal(out[0, 1], want)
    np.testing.assert_array_equal(lse[0, 1], want_lse)
    assert np.isfinite(out).all() and np.isfinite(lse[lse != -np.inf]).all()
    outs, lses = _states(dtype, parts=1, seed=1)
    one, one_lse = flashport.merge_states(outs, lses, device=backend)
    np.testing.assert_array_equal(one, outs[0])
    np.testing.assert_array_equal(one_lse, lses[0])


def test_nan_or_plus_infinity_in_lse_makes_the_row_nan_or_infinite(backend):
    """As attention over the union: a NaN lse gives lse NaN, a +inf one
    lse +inf; o is NaN either way (docs/design.md#non-finite-inputs)."""
    outs, lses = _states()
    lses[2][0, 0, 1] = np.nan
    lses[0][1, 2, 0] = np.inf
    out, lse = flashport.merge_states(outs, lses, device=backend)
    for row in [(0, 0, 1), (1, 2, 0)]:
        assert np.isnan(out[row]).all()
    assert np.isnan(lse[0, 0, 1]) and lse[1, 2, 0] == np.inf
    mask = np.ones(lse.shape, bool)
    mask[0, 0, 1] = mask[1, 2, 0] = False
    assert np.isfinite(out[mask]).all() and np.isfinite(lse[mask]).all()


def test_far_apart_lses_do_not_overflow(backend):
    outs, lses = _states(parts=2)
    lses[0][...] = 80.0
    lses[1][...] = -80.0
    out, lse = flashport.merge_states(outs, lses, device=backend)
    np.testing.assert_allclose(out, outs[0], rtol=1e-6)
    np.testing.assert_allclose(lse, 80.0, rtol=1e-7)


@pytest.mark.parametrize("shape", [(7, 3), (4, 7, 3), (2, 1, 7, 3), (1, 2, 3, 7, 3), (7, 0)])
def test_any_leading_shape(backend, shape):
    outs, lses = _states(shape=shape, parts=2)
    out, lse = flashport.merge_states(np.stack(outs), np.stack(lses), device=backend)
    assert out.shape == shape and lse.shape == shape[:-1]
    rows = int(np.prod(shape[:-1]))
    want, want_lse = flashport.merge_states(
        [o.reshape(rows, shape[-1]) for o in outs], [x.reshape(rows) for x in lses], device=backend
    )
    np.testing.assert_array_equal(out.reshape(want.shape), want)
    np.testing.assert_array_equal(lse.reshape(-1), want_lse)


def test_views_and_byte_order(backend):
    """Strided, Fortran-ordered and byte-swapped parts give the same bits."""
    outs, lses = _states(parts=2)
    want = flashport.merge_states(outs, lses, device=backend)
    odd = [np.asfortranarray(outs[0]), outs[1].astype(outs[1].dtype.newbyteorder(">"))]
    stacked = np.stack(lses)[:, ::-1][:, ::-1]
    got = flashport.merge_states(odd, stacked, device=backend)
    for g, w in zip(got, want, strict=True):
        assert g.tobytes() == w.tobytes()


def test_device_arrays_merge_on_the_gpu(gpu):
    """DeviceArray parts (either form, mixed with NumPy) merge on the GPU,
    results stay there, with the bits of NumPy inputs."""
    outs, lses = _states(np.float16, parts=3, shape=(3, 5, 7))
    want = flashport.merge_states(outs, lses, device=gpu)
    mixed = [flashport.to_device(outs[0]), outs[1], flashport.to_device(outs[2])]
    got = flashport.merge_states(mixed, flashport.to_device(np.stack(lses)))
    assert all(isinstance(x, flashport.DeviceArray) for x in got)
    for g, w in zip(got, want, strict=True):
        assert g.numpy().tobytes() == w.tobytes()
    with pytest.raises(InvalidArgumentError, match=r"outs\[0\] is a device array"):
        flashport.merge_states(mixed, lses, device="cpu")


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=lambda t: t.__name__)
def test_rows_in_chunks_on_the_gpu(gpu, dtype):
    """Bindings smaller than the arrays: the GPU merges chunks of rows,
    with the bits of one chunk, from NumPy and from device arrays (float16
    parts of odd size, so chunks start inside a word)."""
    outs, lses = _states(dtype, parts=3, shape=(3, 31, 7), seed=4)
    lses[1][0, :9] = -np.inf
    want = flashport.merge_states(outs, lses, device=gpu)
    on_device = flashport.to_device(np.stack(outs))
    with overrides(binding_limit=256):
        got = flashport.merge_states(outs, lses, device=gpu)
        kept = flashport.merge_states(on_device, [flashport.to_device(x) for x in lses])
    for g, k, w in zip(got, kept, want, strict=True):
        assert g.tobytes() == w.tobytes() and k.numpy().tobytes() == w.tobytes()


def test_float64_is_cpu_only(gpu):
    outs, lses = _states(np.float64)
    with pytest.raises(DTypeError, match="float64"):
        flashport.merge_states(outs, lses, device=gpu)


OUTS, LSES = _states(parts=2)

ERRORS = [
    (([], []), ShapeError, ["outs is an empty sequence"]),
    ((np.zeros((0, 3, 4), np.float32), np.zeros((0, 3), np.float32)), ShapeError, ["no parts"]),
    ((OUTS, LSES[:1]), ShapeError, ["outs has 2 parts but lses has 1"]),
    (([*OUTS, OUTS[0][..., :3]], [*LSES, LSES[0]]), ShapeError, ["outs[2] has shape", "outs[0]"]),
    ((OUTS, [LSES[0], LSES[1][..., :4]]), ShapeError, ["lses[1] has shape (2, 3, 4)"]),
    ((np.zeros((2, 4), np.float32), np.zeros(2, np.float32)), ShapeError, ["part of shape (4,)"]),
    ((OUTS, [x.astype(np.float64) for x in LSES]), DTypeError, ["lses[0]", "float64"]),
    ((OUTS, [x.astype(np.float16) for x in LSES]), DTypeError, ["lses[0]", "float16"]),
    (([OUTS[0], OUTS[1].astype(np.float64)], LSES), DTypeError, ["outs[1] has dtype float64"]),
    (([x.astype(np.int32) for x in OUTS], LSES), DTypeError, ["outs[0] has dtype int32"]),
    (([OUTS[0], "not an array"], LSES), DTypeError, ["outs[1]"]),
    (([OUTS[0], None], LSES), DTypeError, ["outs[1] has dtype object"]),
    ((OUTS, [LSES[0], None]), DTypeError, ["lses[1] has dtype object"]),
    # Not arrays at all (NumPy makes them 0-d arrays of strings or
    # objects): the dtype error the docstring promises, before the shape.
    ((OUTS, None), DTypeError, ["lses has dtype object"]),
    (("abc", LSES), DTypeError, ["outs has dtype str"]),
    (((x for x in OUTS), LSES), DTypeError, ["outs has dtype object"]),
    ((np.float32(1.0), LSES), ShapeError, ["outs has shape ()"]),
]


@pytest.mark.parametrize("args,error,fragments", ERRORS)
def test_errors_name_the_argument(backend, args, error, fragments):
    with pytest.raises(error) as info:
        flashport.merge_states(*args, device=backend)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))
    assert np.isfinite(flashport.merge_states(OUTS, LSES, device=backend)[0]).all()


def test_bad_device():
    with pytest.raises(InvalidArgumentError, match="device"):
        flashport.merge_states(OUTS, LSES, device="tpu")
