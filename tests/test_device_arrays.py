"""DeviceArrays: arrays that stay on the GPU between calls. Results live where
the inputs live, and carry the same bits as the NumPy-in GPU path (which the
property suites check against the oracle; here too), through every path:
whole arrays, chunks of heads under a small binding limit (float16 heads of
odd size, GQA groups cut across chunks), mixed NumPy and device inputs, the
forward's outputs fed straight into the backward, the variants. And the
errors: device="cpu", DeviceArrays where only NumPy is read, shapes, dtypes,
a lost device."""

from __future__ import annotations

import flashport
import numpy as np
import pytest
from cases import (
    Case,
    Variants,
    assert_close,
    cases,
    naive,
    naive_backward,
    oracle,
    oracle_backward,
    score_magnitude,
    term_magnitudes,
)
from conftest import overrides
from flashport import (
    DeviceArray,
    DTypeError,
    GpuError,
    InvalidArgumentError,
    ShapeError,
    _core,
    to_device,
)
from hypothesis import given, settings
from hypothesis import strategies as st

# Each example runs the NumPy path, the device path and the oracle.
EXAMPLES = settings(max_examples=max(8, settings.default.max_examples // 2))

# GQA, seq_q != seq_k, d != d_v, causal rows that see no key, sizes that are
# no tile multiples, odd float16 heads, unbatched layouts.
SHAPES = [
    Case(2, 2, 2, 37, 53, 16, 24, True, None, 4, 1),
    Case(1, 1, 4, 65, 17, 64, 32, True, 0.3, 4, 2),
    Case(1, 3, 1, 21, 13, 5, 7, False, None, 4, 3),
    Case(1, 2, 3, 9, 30, 3, 1, True, 1.3, 3, 4),
    Case(1, 1, 1, 19, 11, 7, 9, False, None, 2, 5),
]


def _ids(shapes):
    return [
        f"b{c.batch}h{c.heads_q}/{c.heads_kv}-s{c.seq_q}x{c.seq_k}-d{c.d}/{c.dv}"
        f"{'-causal' if c.causal else ''}-{c.ndim}d"
        for c in shapes
    ]


def same_bits(got, want, name):
    got = got.numpy() if isinstance(got, DeviceArray) else np.asarray(got)
    assert got.dtype == want.dtype and got.shape == want.shape, (name, got.dtype, got.shape)
    assert got.tobytes() == want.tobytes(), f"{name}: device path differs from the NumPy path"


def binding_limit(limit):
    """Chunks of heads as on an adapter whose bindings hold ``limit`` bytes."""
    return overrides(binding_limit=limit)


def uploads():
    """The host uploads the last GPU call recorded."""
    return [name for name, _ in _core._gpu_kernel_times() if name == "host:upload"]


def submissions():
    """The submissions the last GPU call made, waited for or queued: one per
    chunk of heads."""
    return sum(name == "host:submit" for name, _ in _core._gpu_kernel_times())


def check_device_path(
    case: Case, dtype, gpu: str, return_dmask=False, min_chunks=1, **variants
) -> None:
    """Forward and backward through DeviceArrays (inputs uploaded once, the
    forward's outputs passed on as they are) give the bits of the NumPy-in
    GPU path, leave every input as it was, upload nothing in the backward,
    and match the oracle with test_properties' tolerance rule."""
    q, k, v, do = case.arrays(dtype)
    kw = {"causal": case.causal, "scale": case.scale, **variants}
    host_before = [x.copy() for x in (q, k, v, do)]
    bkw = {**kw, "return_dmask": return_dmask}
    out, lse = flashport.attention(q, k, v, return_lse=True, device=gpu, **kw)
    grads = flashport.attention_backward(do, q, k, v, out, lse, device=gpu, **bkw)
    assert uploads(), "the NumPy backward records its uploads"

    tq, tk, tv, tdo = (to_device(x) for x in (q, k, v, do))
    t_out, t_lse = flashport.attention(tq, tk, tv, return_lse=True, **kw)
    assert isinstance(t_out, DeviceArray) and isinstance(t_lse, DeviceArray)
    same_bits(t_out, out, "o")
    same_bits(t_lse, lse, "lse")
    t_grads = flashport.attention_backward(tdo, tq, tk, tv, t_out, t_lse, **bkw)
    assert uploads() == [], "the backward uploaded device inputs"
    assert submissions() >= min_chunks, "the backward ran fewer chunks of heads than planned"
    assert len(t_grads) == len(grads)
    for name, got, want in zip(("dq", "dk", "dv"), t_grads, grads, strict=False):
        assert isinstance(got, DeviceArray), name
        same_bits(got, want, name)
    # dsinks and dmask: NumPy, as the arrays they are the gradients of.
    for got, want in zip(t_grads[3:], grads[3:], strict=True):
        assert isinstance(got, np.ndarray)
        same_bits(got, want, "dsinks/dmask")

    for before, x in zip(host_before, (q, k, v, do), strict=True):
        assert x.tobytes() == before.tobytes(), "a NumPy input was modified"
    for before, t in zip(host_before, (tq, tk, tv, tdo), strict=True):
        assert t.numpy().tobytes() == before.tobytes(), "a device input was modified"

    if not variants:
        want_out, want_lse = oracle(case, q, k, v, dtype)
        base_out, base_lse = naive(case, q, k, v, dtype)
        scores = score_magnitude(case, q, k)
        terms = term_magnitudes(case, do, q, k, v)
        assert_close("o", t_out.numpy(), want_out, base_out, dtype, scores, terms["o"])
        assert_close("lse", t_lse.numpy(), want_lse, base_lse, dtype, scores, terms["lse"])
        want = oracle_backward(case, do, q, k, v, dtype)
        baseline = naive_backward(case, do, q, k, v, dtype)
        for name, g, w, b in zip(("dq", "dk", "dv"), t_grads, want, baseline, strict=True):
            assert_close(name, g.numpy(), w, b, dtype, scores, terms[name])


# ---------------------------------------------------------------------------
# The array itself.


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=lambda t: t.__name__)
def test_round_trip_is_exact(gpu, dtype):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((3, 5, 7)) * 100).astype(dtype)  # an odd float16 count
    x.flat[:6] = np.array([np.inf, -np.inf, np.nan, -0.0, 1e-7, 65504], dtype)
    t = to_device(x)
    assert isinstance(t, DeviceArray)
    assert (t.shape, t.dtype, t.ndim, t.size, t.nbytes) == (x.shape, x.dtype, 3, 105, x.nbytes)
    assert t.device and t.device in repr(t) and "shape=(3, 5, 7)" in repr(t)
    back = t.numpy()
    assert back.dtype == dtype and back.shape == x.shape and back.tobytes() == x.tobytes()
    assert np.asarray(t).tobytes() == x.tobytes()
    assert np.asarray(t, dtype=np.float64).dtype == np.float64
    assert t.numpy() is not back, "numpy() returns a new array each time"
    with pytest.raises(ValueError, match="always copies"):
        np.asarray(t, copy=False)
    # Any layout uploads the same values.
    reversed_view = np.ascontiguousarray(x[:, ::-1])[:, ::-1]
    for view in (np.asfortranarray(x), reversed_view, x.astype(x.dtype.newbyteorder(">"))):
        assert to_device(view).numpy().tobytes() == x.tobytes()
    assert to_device(t) is t
    assert to_device(np.empty((0, 4), dtype)).numpy().shape == (0, 4)
    # A copy made on the GPU: a new array with the same bits.
    c = t.copy()
    assert isinstance(c, DeviceArray) and c is not t and c._array is not t._array
    assert (c.shape, c.dtype) == (t.shape, t.dtype)
    assert c.numpy().tobytes() == x.tobytes() and t.numpy().tobytes() == x.tobytes()
    assert to_device(np.empty((0, 4), dtype)).copy().numpy().shape == (0, 4)


def test_device_arrays_are_immutable(gpu):
    t = to_device(np.arange(12, dtype=np.float32).reshape(3, 4))
    for name in ("shape", "dtype", "_array", "anything"):
        with pytest.raises(AttributeError):
            setattr(t, name, None)
    with pytest.raises(AttributeError):
        del t._array
    mutators = {"__setitem__", "fill", "resize", "sort", "put", "itemset", "__iadd__"}
    assert not mutators & set(dir(t))
    with pytest.raises(TypeError, match="to_device"):
        DeviceArray(np.zeros(3, np.float32))


def test_float64_is_refused_as_the_gpu_refuses_it(gpu):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 8, 4))
    with pytest.raises(DTypeError) as from_call:
        flashport.attention(x, x, x, device=gpu)
    with pytest.raises(DTypeError) as from_upload:
        to_device(x)
    # The same reason, naming the argument each time.
    assert str(from_call.value).startswith("q has dtype float64: ")
    assert str(from_upload.value).startswith("array has dtype float64: ")
    assert str(from_upload.value).split(": ", 1)[1] == str(from_call.value).split(": ", 1)[1]
    for bad in (x.astype(np.int32), x.astype(np.complex64)):
        with pytest.raises(DTypeError, match=bad.dtype.name):
            to_device(bad)


# ---------------------------------------------------------------------------
# The same bits as NumPy inputs, through every path.


@pytest.mark.parametrize("case", SHAPES, ids=_ids(SHAPES))
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=lambda t: t.__name__)
def test_device_path_gives_the_bits_of_the_numpy_path(gpu, case, dtype):
    check_device_path(case, dtype, gpu)


@EXAMPLES
@given(data=st.data(), dtype=st.sampled_from([np.float32, np.float16]))
def test_device_path_on_random_shapes(gpu, data, dtype):
    check_device_path(data.draw(cases(gpu), label="case"), dtype, gpu)


CHUNKED = [
    # float32 MQA, a group cut across chunks: dK/dV pieces summed on the GPU.
    (Case(2, 1, 4, 33, 21, 16, 8, True, None, 4, 11), np.float32, 4 * 33 * 16),
    (Case(2, 1, 4, 33, 21, 16, 8, False, None, 4, 12), np.float32, 4 * 33 * 16 * 2),
    # float16 heads of odd size: chunks that start mid-word.
    (Case(2, 3, 1, 19, 23, 3, 5, True, None, 4, 13), np.float16, 4 * 23 * 5),
    (Case(2, 3, 1, 19, 23, 3, 5, False, None, 4, 14), np.float16, 4 * 23 * 5 * 2),
    # ... and a GQA group cut across them.
    (Case(1, 2, 3, 37, 29, 5, 7, True, 0.5, 4, 15), np.float16, 4 * 37 * 7),
    (Case(1, 2, 3, 37, 29, 5, 7, False, None, 4, 16), np.float16, 4 * 37 * 7 * 2),
]


CHUNK_IDS = _ids([case for case, _, _ in CHUNKED])


@pytest.mark.parametrize(
    "case,dtype,limit",
    CHUNKED,
    ids=[
        f"{name}-{d.__name__}-limit{n}" for name, (_, d, n) in zip(CHUNK_IDS, CHUNKED, strict=True)
    ],
)
def test_chunked_device_path(gpu, case, dtype, limit):
    with binding_limit(limit):
        check_device_path(case, dtype, gpu, min_chunks=2)


def test_mixed_numpy_and_device_inputs(gpu):
    case = Case(2, 2, 2, 23, 31, 8, 12, True, None, 4, 21)
    q, k, v, do = case.arrays(np.float32)
    out, lse = flashport.attention(q, k, v, causal=True, return_lse=True, device=gpu)
    grads = flashport.attention_backward(do, q, k, v, out, lse, causal=True, device=gpu)
    tk = to_device(k)
    # One device input makes every result a DeviceArray.
    t_out, t_lse = flashport.attention(q, tk, v, causal=True, return_lse=True)
    same_bits(t_out, out, "o")
    same_bits(t_lse, lse, "lse")
    mixes = [
        (do, q, tk, v, out, lse),
        (to_device(do), q, k, v, out, lse),
        (do, q, k, v, t_out, lse),
        (do, to_device(q), k, to_device(v), out, t_lse),
        # float64 lse from NumPy beside device arrays.
        (do, q, tk, v, t_out, lse.astype(np.float64)),
    ]
    for args in mixes:
        t_grads = flashport.attention_backward(*args, causal=True, device="gpu")
        for name, got, want in zip(("dq", "dk", "dv"), t_grads, grads, strict=True):
            assert isinstance(got, DeviceArray), name
            same_bits(got, want, name)


def test_variants_with_device_arrays(gpu):
    """The variant arrays stay NumPy; the results follow the main arrays,
    and dsinks and dmask (gradients of NumPy arrays) are NumPy."""
    case = Case(1, 2, 2, 24, 29, 8, 6, True, None, 4, 31)
    spec = Variants(
        window=(9, None),
        mask="float",
        mask_shape=(24, 29),
        mask_density=0.9,
        alibi="heads",
        softcap=20.0,
        sinks=True,
        dropout_p=0.2,
        dropout_seed=5,
        seed=3,
    )
    check_device_path(case, np.float32, gpu, return_dmask=True, **spec.kwargs(case, np.float32))


def test_device_arrays_ignore_a_cpu_default(gpu, monkeypatch):
    """device=None with a DeviceArray means the GPU, whatever
    $FLASHPORT_DEVICE says."""
    monkeypatch.setenv("FLASHPORT_DEVICE", "cpu")
    q, k, v, _ = Case(1, 1, 2, 12, 12, 8, 8, False, None, 4, 41).arrays(np.float32)
    want = flashport.attention(q, k, v, device="gpu")
    for device in (None, "auto"):
        out = flashport.attention(to_device(q), k, v, device=device)
        assert isinstance(out, DeviceArray)
        same_bits(out, want, "o")


def test_empty_problems_give_device_arrays(gpu):
    rng = np.random.default_rng(3)
    q = to_device(rng.standard_normal((2, 4, 7, 8)).astype(np.float16))
    k = to_device(rng.standard_normal((2, 2, 0, 8)).astype(np.float16))
    v = to_device(rng.standard_normal((2, 2, 0, 3)).astype(np.float16))
    out, lse = flashport.attention(q, k, v, return_lse=True)
    assert isinstance(out, DeviceArray) and out.dtype == np.float16 and lse.dtype == np.float32
    assert np.all(out.numpy() == 0) and np.all(np.isneginf(lse.numpy()))
    do = to_device(rng.standard_normal(out.shape).astype(np.float16))
    dq, dk, dv = flashport.attention_backward(do, q, k, v, out, lse)
    assert isinstance(dq, DeviceArray) and np.all(dq.numpy() == 0)
    assert dk.shape == k.shape and dv.shape == v.shape


# ---------------------------------------------------------------------------
# Errors.

rng = np.random.default_rng(7)


def arr(*shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


Q, K, V = arr(2, 4, 10, 8), arr(2, 2, 12, 8), arr(2, 2, 12, 6)


def test_cpu_with_a_device_array_names_it(gpu):
    with pytest.raises(InvalidArgumentError) as info:
        flashport.attention(Q, to_device(K), V, device="cpu")
    message = str(info.value)
    assert 'device="cpu"' in message and "k is a device array" in message
    assert "k.numpy()" in message
    out, lse = flashport.attention(Q, K, V, return_lse=True, device=gpu)
    with pytest.raises(InvalidArgumentError, match="lse is a device array"):
        flashport.attention_backward(out, Q, K, V, out, to_device(lse), device="cpu")


@pytest.mark.parametrize("name", ["mask", "alibi_slopes", "sinks"])
def test_device_arrays_are_refused_as_variant_arrays(gpu, name):
    values = {
        "mask": arr(10, 12) > 0,
        "alibi_slopes": np.abs(arr(4)),
        "sinks": arr(4),
    }[name]
    device_value = to_device(values.astype(np.float32))
    for tq in (Q, to_device(Q)):
        with pytest.raises(InvalidArgumentError, match=rf"{name} is a flashport.DeviceArray"):
            flashport.attention(tq, K, V, device=gpu, **{name: device_value})
    out, lse = flashport.attention(Q, K, V, return_lse=True, device=gpu)
    with pytest.raises(InvalidArgumentError, match=rf"{name}.numpy\(\)"):
        flashport.attention_backward(out, Q, K, V, out, lse, device=gpu, **{name: device_value})


SHAPE_ERRORS = [
    (arr(10), K, V),
    (arr(1, 2, 2, 10, 8), K, V),
    (Q, arr(3, 2, 12, 8), arr(3, 2, 12, 6)),
    (Q, K, arr(2, 1, 12, 6)),
    (arr(2, 6, 10, 8), arr(2, 4, 12, 8), arr(2, 4, 12, 6)),
    (Q, K, arr(2, 2, 11, 6)),
    (Q, arr(2, 2, 12, 9), V),
    (arr(4, 10, 8), K, V),
]


@pytest.mark.parametrize("args", SHAPE_ERRORS, ids=[str(i) for i in range(len(SHAPE_ERRORS))])
def test_wrong_shapes_give_the_numpy_errors(gpu, args):
    with pytest.raises(ShapeError) as from_numpy:
        flashport.attention(*args, device=gpu)
    for i in range(3):
        mixed = [to_device(a) if j == i else a for j, a in enumerate(args)]
        with pytest.raises(ShapeError) as from_device:
            flashport.attention(*mixed, device=gpu)
        assert str(from_device.value) == str(from_numpy.value)


def test_backward_shape_and_dtype_errors_match_numpy(gpu):
    out, lse = flashport.attention(Q, K, V, return_lse=True, device=gpu)
    do = np.cos(out)
    bad = [
        (do[..., :5], Q, K, V, out, lse),
        (do, Q, K, V, out[:, :2], lse),
        (do, Q, K, V, out, lse[..., :9]),
        (do, Q, K, V, out, lse.astype(np.float16)),
        (do.astype(np.float16), Q, K, V, out, lse),
    ]
    for args in bad:
        with pytest.raises((ShapeError, DTypeError)) as from_numpy:
            flashport.attention_backward(*args, device=gpu)
        for i in range(6):
            mixed = [to_device(a) if j == i else a for j, a in enumerate(args)]
            with pytest.raises(type(from_numpy.value)) as from_device:
                flashport.attention_backward(*mixed, device=gpu)
            assert str(from_device.value) == str(from_numpy.value)


def test_lost_device_names_the_argument_and_the_cpu_keeps_working(gpu):
    want = flashport.attention(Q, K, V, device="cpu")
    tq, tv = to_device(Q), to_device(V)
    flashport.attention(tq, K, tv)  # runs on the device the arrays are on
    _core._testing_lose_device()
    with pytest.raises(GpuError) as info:
        flashport.attention(tq, K, tv)
    message = str(info.value)
    assert (
        message.startswith("q is a device array") and "lost" in message and "to_device" in message
    )
    with pytest.raises(GpuError, match="lost"):
        tq.numpy()
    assert flashport.attention(Q, K, V, device="cpu").tobytes() == want.tobytes()
    # New arrays live on a fresh device.
    again = flashport.attention(to_device(Q), K, V)
    np.testing.assert_allclose(again.numpy(), want, rtol=1e-5, atol=1e-6)
