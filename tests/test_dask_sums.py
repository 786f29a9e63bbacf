"""flashport.dask's gradient sums (``_tasks.add``, and through it the ring's
``carry + share``): with float16 or bfloat16 among the parts or as the
result, flashport's core sums them (``_core.sum_widened``), and the result
is bit for bit NumPy's formula, NaN payloads, infinities, subnormals and
-0.0 included, on the AVX2 path and on the portable one.

One exception, which NumPy itself does not keep: where two NaNs meet in
one add, x86 returns its first operand's, and NumPy's AVX-512 loop passes
the running total first in its body but second in its last partial group
of 16 (an element's payload depends on where it falls). The core always
keeps the total's; there the results are only both NaN."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("dask.array")

import ml_dtypes
from conftest import overrides
from flashport import DTypeError, ProblemTooLargeError, ShapeError, _core
from flashport.dask import _tasks
from hypothesis import given
from hypothesis import strategies as st

# Casting NaN and overflowing float16 is the point here, not a warning.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

F16, BF16, F32 = np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32)

# Bit patterns planted among the values: quiet and signaling NaNs of
# either sign and several payloads, ±inf, ±0, the extreme subnormals, the
# largest finite value (two of them overflow float16 when added).
SPECIAL_BITS = {
    F16: [0x7E00, 0x7C01, 0xFE17, 0x7D55, 0x7C00, 0xFC00, 0x8000, 0x0000, 0x0001, 0x83FF, 0x7BFF],
    BF16: [0x7FC0, 0x7F81, 0xFFC1, 0x7FA5, 0x7F80, 0xFF80, 0x8000, 0x0000, 0x0001, 0x807F, 0x7F7F],
    F32: [
        0x7FC00000,
        0x7F800001,
        0xFFC12345,
        0x7FA00F00,
        0x7F800000,
        0xFF800000,
        0x80000000,
        0x00000000,
        0x00000001,
        0x807FFFFF,
        0x477FE000,  # 65504, float16's largest
        0x33C00000,  # 8.9e-8, a float16 subnormal
    ],
}
UINT = {2: np.uint16, 4: np.uint32}


def numpy_add(*parts: np.ndarray, dtype) -> np.ndarray:
    """``add``'s formula in NumPy alone, as it was before the core summed:
    widened, added left to right with the total first, rounded once (a
    lone part already in ``dtype`` as it is)."""
    dtype = np.dtype(dtype)
    if len(parts) == 1 and parts[0].dtype == dtype:
        return parts[0]
    acc = np.result_type(_tasks.accumulation_dtype(dtype), *(p.dtype for p in parts))
    if len(parts) == 1:
        total = np.array(parts[0], dtype=acc, copy=True)
    else:
        total = np.add(parts[0], parts[1], dtype=acc)
        for p in parts[2:]:
            total += p
    return total.astype(dtype, copy=False)


def values(rng: np.random.Generator, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """Normal values at several scales (float16's subnormals among them),
    a quarter of them replaced by the special bit patterns."""
    scale = rng.choice([1e-6, 1.0, 3e4], size=shape)
    x = np.asarray(rng.standard_normal(shape) * scale).astype(dtype)
    bits = x.view(UINT[dtype.itemsize])
    special = np.array(SPECIAL_BITS[dtype], dtype=bits.dtype)
    planted = rng.random(shape) < 0.25
    bits[planted] = rng.choice(special, size=int(planted.sum()))
    return x


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def nans_meet(parts: list[np.ndarray]) -> np.ndarray:
    """Where some add of the sum takes two NaNs: a NaN running total (a
    NaN part's, or inf − inf's) and a NaN part."""
    total = np.asarray(parts[0], dtype=np.float32)
    met = np.zeros(total.shape, bool)
    for p in parts[1:]:
        met |= np.isnan(total) & np.isnan(p.astype(np.float32))
        total = total + p.astype(np.float32)
    return met


def same_sum(got: np.ndarray, parts: list[np.ndarray], dtype) -> bool:
    """``got`` is bit for bit NumPy's sum of ``parts``, except that where two
    NaNs meet both are NaN (see the module's docstring)."""
    want = numpy_add(*parts, dtype=dtype)
    if got.dtype != want.dtype or got.shape != want.shape:
        return False
    met = nans_meet(parts) if len(parts) > 1 else np.zeros(got.shape, bool)
    bits = UINT[got.itemsize]
    same = np.asarray(got).view(bits) == np.asarray(want).view(bits)
    both_nan = np.isnan(got.astype(np.float32)) & np.isnan(want.astype(np.float32))
    return bool(np.all(same | (met & both_nan)))


# (result dtype, the dtypes its parts may have): as the graph calls add.
COMBINATIONS = [(F16, [F16, F32]), (BF16, [BF16, F32]), (F32, [F16, F32]), (F32, [BF16, F32])]


@pytest.fixture(params=[False, True], ids=["vector", "portable"])
def path(request):
    """Each test on the AVX2 + F16C kernels (where the CPU has them) and on
    the portable ones, which every other machine runs."""
    with overrides(portable_cpu=request.param):
        yield


@given(
    shape=st.lists(st.integers(0, 9), min_size=0, max_size=4).map(tuple),
    count=st.integers(1, 5),
    combination=st.sampled_from(COMBINATIONS),
    seed=st.integers(0, 2**32 - 1),
)
def test_sums_are_numpys_bit_for_bit_and_leave_the_parts_alone(
    path, shape, count, combination, seed
):
    dtype, allowed = combination
    rng = np.random.default_rng(seed)
    parts = [values(rng, shape, allowed[rng.integers(len(allowed))]) for _ in range(count)]
    before = [p.copy() for p in parts]
    got = _tasks.add(*parts, dtype=dtype)
    assert same_sum(got, before, dtype)
    assert all(same_bits(p, b) for p, b in zip(parts, before, strict=True))


@pytest.mark.parametrize("count", [2, 3, 5])
@pytest.mark.parametrize("dtype, allowed", COMBINATIONS)
def test_large_odd_sums_cross_every_block_and_task_boundary(path, count, dtype, allowed):
    """Several tasks of the core's threads, blocks and a ragged end."""
    rng = np.random.default_rng(count)
    shape = (3, 70_001)
    parts = [values(rng, shape, allowed[i % len(allowed)]) for i in range(count)]
    before = [p.copy() for p in parts]
    assert same_sum(_tasks.add(*parts, dtype=dtype), before, dtype)
    assert all(same_bits(p, b) for p, b in zip(parts, before, strict=True))


def test_nan_payloads_follow_the_running_total(path):
    """Where the total is NaN its payload wins, whatever is added; else
    the part's NaN; the quiet bit is set either way (x86's add with the
    total first; inf − inf gives x86's default NaN, negative)."""
    bits = np.array
    p0 = bits([0x7E01, 0x3C00, 0x7C02, 0xFC00, 0x3C00], np.uint16).view(F16)
    p1 = bits([0x7E02, 0xFE03, 0x3C00, 0x7C00, 0x3C00], np.uint16).view(F16)
    p2 = bits([0x3C00, 0x7E04, 0x7E05, 0x3C00, 0x7C06], np.uint16).view(F16)
    got = _tasks.add(p0, p1, p2, dtype=F16)
    assert got.view(np.uint16).tolist() == [0x7E01, 0xFE03, 0x7E02, 0xFE00, 0x7E06]


def test_non_contiguous_parts_are_summed_as_their_elements(path):
    rng = np.random.default_rng(3)
    base = values(rng, (4, 34, 20), F16)
    wide = values(rng, (4, 20, 34), F32)
    parts = [base[:, ::2, :], wide.transpose(0, 2, 1)[:, ::2, :], base[::-1, 1::2, :]]
    assert not any(p.flags.c_contiguous for p in parts)
    before = [p.copy() for p in parts]
    for dtype in (F16, F32):
        assert same_sum(_tasks.add(*parts, dtype=dtype), before, dtype)
    assert all(same_bits(p, b) for p, b in zip(parts, before, strict=True))


def test_ring_carries_add_their_share_like_numpy(path):
    """``backward_ring_block``'s ``carry + share``, as ``add`` with the
    result in float32: a float32 carry and a float16 share."""
    rng = np.random.default_rng(4)
    carry, share = values(rng, (2, 33, 16), F32), values(rng, (2, 33, 16), F16)
    got = _tasks.add(carry, share, dtype=np.result_type(F32, carry.dtype, share.dtype))
    assert same_sum(got, [carry, share], F32)
    assert same_sum(np.add(carry, share, dtype=F32), [carry, share], F32)


def test_half_sums_go_to_the_core_and_others_stay_in_numpy(monkeypatch):
    calls = []

    def counted(parts, dtype):
        calls.append((tuple(p.dtype.name for p in parts), dtype))
        return _core.sum_widened(parts, dtype)

    monkeypatch.setattr(_tasks, "_core", type("Core", (), {"sum_widened": staticmethod(counted)}))
    x16, x32, x64 = (np.ones((2, 3), d) for d in (F16, F32, np.float64))
    _tasks.add(x16, x16, dtype=F16)
    _tasks.add(x32, x32, dtype=F16)
    _tasks.add(x32, x16, dtype=F32)
    assert calls == [
        (("float16", "float16"), "float16"),
        (("float32", "float32"), "float16"),
        (("float32", "float16"), "float32"),
    ]
    calls.clear()
    # Float32 alone (NumPy adds it as fast), float64, and a lone part (a
    # cast, which keeps a signaling NaN signaling as NumPy's does).
    _tasks.add(x32, x32, dtype=F32)
    _tasks.add(x16, x16, dtype=np.float64)
    _tasks.add(x64, x64, dtype=np.float64)
    assert same_bits(_tasks.add(x32, dtype=F16), x16)
    assert calls == []


def test_bad_parts_are_refused_by_name():
    a = np.ones((2, 3), F16)
    with pytest.raises(ShapeError, match=r"parts\[1\] has shape \(3, 2\) but parts\[0\] has"):
        _core.sum_widened([a, np.ones((3, 2), F16)], "float16")
    with pytest.raises(ShapeError, match="at least one part"):
        _core.sum_widened([], "float16")
    with pytest.raises(DTypeError, match=r"parts\[2\] has dtype float64"):
        _core.sum_widened([a, a, np.ones((2, 3))], "float16")
    with pytest.raises(DTypeError, match=r"parts\[0\] has dtype int32"):
        _core.sum_widened([np.ones((2, 3), np.int32), a], "float32")
    with pytest.raises(DTypeError, match="dtype has dtype float64"):
        _core.sum_widened([a, a], "float64")
    with pytest.raises(TypeError, match=r"parts\[1\] must be a numpy.ndarray, got list"):
        _core.sum_widened([a, [[1.0] * 3] * 2], "float16")
    # A broadcast view larger than memory: refused before any copy.
    huge = np.broadcast_to(np.ones(1, F16), (1 << 40, 1 << 20))
    with pytest.raises(ProblemTooLargeError, match=r"parts\[0\] is not contiguous"):
        _core.sum_widened([huge, huge], "float16")
    # Through add: shapes that NumPy would broadcast are not a sum of parts.
    with pytest.raises(ShapeError, match=r"parts\[1\] has shape \(3,\)"):
        _tasks.add(a, np.ones(3, F16), dtype=F16)
