"""Bad input gets a specific exception whose message names the argument and
the values seen; nothing crashes, and the library keeps working afterwards."""

from __future__ import annotations

import flashport
import numpy as np
import pytest
from flashport import DTypeError, InvalidArgumentError, ShapeError

rng = np.random.default_rng(2)


def arr(*shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


Q, K, V = arr(2, 4, 10, 8), arr(2, 2, 12, 8), arr(2, 2, 12, 6)

FORWARD_SHAPE_ERRORS = [
    ((arr(10), K, V), ["q", "(10,)", "1 dimensions"]),
    ((arr(1, 2, 2, 10, 8), K, V), ["q", "5 dimensions"]),
    ((Q, arr(3, 2, 12, 8), arr(3, 2, 12, 6)), ["batch", "q: 2", "k: 3"]),
    ((Q, K, arr(2, 1, 12, 6)), ["k and v", "heads", "k: 2", "v: 1"]),
    ((arr(2, 6, 10, 8), arr(2, 4, 12, 8), arr(2, 4, 12, 6)), ["(4)", "(6)", "divide"]),
    ((Q, K, arr(2, 2, 11, 6)), ["sequence length", "k: 12", "v: 11"]),
    ((Q, arr(2, 2, 12, 9), V), ["head dimension", "q: 8", "k: 9"]),
    ((arr(4, 10, 8), K, V), ["same number of dimensions"]),
    ((arr(2, 4, 10, 0), arr(2, 2, 12, 0), V), ["at least 1"]),
]


@pytest.mark.parametrize("args,fragments", FORWARD_SHAPE_ERRORS)
def test_forward_shape_errors_name_the_problem(backend, args, fragments):
    with pytest.raises(ShapeError) as info:
        flashport.attention(*args, device=backend)
    assert isinstance(info.value, ValueError)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


@pytest.mark.parametrize("dtype", [np.int64, np.int8, np.complex64, np.bool_, object])
def test_unsupported_dtype_is_a_type_error_naming_it(backend, dtype):
    bad = Q.astype(dtype)
    with pytest.raises(TypeError) as info:
        flashport.attention(bad, bad, bad, device=backend)
    assert isinstance(info.value, DTypeError)
    assert np.dtype(dtype).name in str(info.value)


def test_mixed_dtypes_are_rejected(backend):
    with pytest.raises(DTypeError, match=r"k has dtype float64.*q has dtype float32"):
        flashport.attention(Q, K.astype(np.float64), V, device=backend)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_scale(backend, scale):
    with pytest.raises(InvalidArgumentError, match="scale"):
        flashport.attention(Q, K, V, scale=scale, device=backend)


@pytest.mark.parametrize("name", ["scale", "softcap"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_scale_beyond_float32_is_rejected(backend, name, dtype):
    # float16 and float32 compute in float32, where 1e300 is infinite: every
    # score would be inf or NaN (rows reported as seeing no key), while
    # float64 computes it.
    q, k, v = (x.astype(dtype) for x in (Q, K, V))
    with pytest.raises(InvalidArgumentError, match=rf"{name}=1e300.*float32's range"):
        flashport.attention(q, k, v, device=backend, **{name: 1e300})
    with pytest.raises(InvalidArgumentError, match=name):
        flashport.attention(q, k, v, device=backend, **{name: -1e300})


def test_scale_beyond_float32_computes_in_float64():
    q, k, v = (x.astype(np.float64) * 1e-300 for x in (Q, K, V))
    out = flashport.attention(q, k, v, scale=1e300, device="cpu")
    expected = flashport.reference.attention(q, k, v, scale=1e300)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-310)


def test_unknown_device():
    with pytest.raises(InvalidArgumentError, match=r"device=\"tpu\""):
        flashport.attention(Q, K, V, device="tpu")


def test_bad_environment_variables(monkeypatch):
    monkeypatch.setenv("FLASHPORT_DEVICE", "quantum")
    with pytest.raises(InvalidArgumentError, match="FLASHPORT_DEVICE"):
        flashport.attention(Q, K, V)
    monkeypatch.delenv("FLASHPORT_DEVICE")
    monkeypatch.setenv("FLASHPORT_NUM_THREADS", "0")
    with pytest.raises(InvalidArgumentError, match="FLASHPORT_NUM_THREADS"):
        flashport.attention(Q, K, V, device="cpu")
    monkeypatch.setenv("FLASHPORT_NUM_THREADS", "two")
    with pytest.raises(InvalidArgumentError, match="two"):
        flashport.attention(Q, K, V, device="cpu")


@pytest.mark.parametrize("name", ["FLASHPORT_GPU_POISON", "FLASHPORT_GPU_CHECKED"])
@pytest.mark.parametrize("value", ["true", "yes", "2"])
def test_bad_gpu_switches_are_rejected(gpu, monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(InvalidArgumentError, match=rf'{name}="{value}".*1 \(on\) or 0'):
        flashport.attention(Q, K, V, device=gpu)
    monkeypatch.setenv(name, "0")
    out = flashport.attention(Q, K, V, device=gpu)
    np.testing.assert_allclose(out, flashport.reference.attention(Q, K, V), atol=1e-5)


def test_not_an_array():
    with pytest.raises((TypeError, ValueError)):
        flashport.attention("not an array", K, V)


def _forward(backend):
    out, lse = flashport.attention(Q, K, V, return_lse=True, device=backend)
    return out, lse, np.cos(out)


def test_backward_shape_and_dtype_errors(backend):
    out, lse, do = _forward(backend)
    with pytest.raises(ShapeError, match=r"do has shape \(2, 4, 10, 5\).*\(2, 4, 10, 6\)"):
        flashport.attention_backward(do[..., :5], Q, K, V, out, lse, device=backend)
    with pytest.raises(ShapeError, match=r"o has shape"):
        flashport.attention_backward(do, Q, K, V, out[:, :2], lse, device=backend)
    with pytest.raises(ShapeError, match=r"lse has shape \(2, 4, 9\).*\(2, 4, 10\)"):
        flashport.attention_backward(do, Q, K, V, out, lse[..., :9], device=backend)
    with pytest.raises(DTypeError, match="o has dtype float64"):
        flashport.attention_backward(do, Q, K, V, out.astype(np.float64), lse, device=backend)
    with pytest.raises(DTypeError, match="lse has dtype float16"):
        flashport.attention_backward(do, Q, K, V, out, lse.astype(np.float16), device=backend)
    with pytest.raises(ShapeError, match="divide"):
        flashport.attention_backward(
            do, Q, arr(2, 3, 12, 8), arr(2, 3, 12, 6), out, lse, device=backend
        )


def test_library_keeps_working_after_errors(backend):
    for args, _ in FORWARD_SHAPE_ERRORS:
        with pytest.raises(ShapeError):
            flashport.attention(*args, device=backend)
    out = flashport.attention(Q, K, V, device=backend)
    assert np.isfinite(out).all() and out.shape == (2, 4, 10, 6)


def test_exception_hierarchy():
    assert issubclass(flashport.ShapeError, ValueError)
    assert issubclass(flashport.DTypeError, TypeError)
    assert issubclass(flashport.BackendUnavailableError, RuntimeError)
    assert issubclass(flashport.GpuError, RuntimeError)
    for cls in (flashport.ShapeError, flashport.DTypeError, flashport.GpuError):
        assert issubclass(cls, flashport.FlashportError)


def test_lost_gpu_device_is_an_error_and_nothing_else_breaks(gpu):
    """A device lost mid-session (driver reset, removed GPU) surfaces as
    flashport.GpuError or is recovered from transparently; it never crashes
    the process, the CPU path keeps working, and a later GPU call works on a
    fresh device."""
    want = flashport.attention(Q, K, V, device="cpu")
    flashport.attention(Q, K, V, device=gpu)  # the context exists now
    flashport._core._testing_lose_device()
    try:
        out = flashport.attention(Q, K, V, device=gpu)
    except flashport.GpuError as e:
        assert "was lost" in str(e), str(e)
    else:
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    assert flashport.attention(Q, K, V, device="cpu").tobytes() == want.tobytes()
    again = flashport.attention(Q, K, V, device=gpu)
    np.testing.assert_allclose(again, want, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------- scalar keywords
# Each keyword takes the kinds of value it means and nothing Python would
# coerce: the core names the keyword and shows the value.

BAD_SCALARS = [
    ("scale", "abc"),
    ("scale", "0.5"),
    ("scale", True),
    ("scale", 10**400),
    ("scale", np.array(0.5)),
    ("scale", {0.5}),
    ("causal", "False"),
    ("causal", 1),
    ("causal", np.array([True, False])),
    ("causal", None),
    ("dropout_p", None),
    ("dropout_p", "0.1"),
    ("seed", 1.5),
    ("seed", True),
    ("seed", 2**127),
    ("seed", "3"),
    ("window", (1.5, 2)),
    ("window", (True, False)),
    ("window", {1, 2}),
    ("window", (2**63, 0)),
    ("window", (1, 2, 3)),
    ("window", 3),
    ("softcap", "30"),
    ("q_offset", 1.0),
    ("k_offset", np.int64(1) + 0.5),
    ("device", 1),
    ("device", b"cpu"),
    ("return_lse", "no"),
    ("return_lse", 0),
]


@pytest.mark.parametrize("name,value", BAD_SCALARS, ids=[f"{n}={v!r}"[:40] for n, v in BAD_SCALARS])
def test_bad_scalar_keywords_name_the_keyword(backend, name, value):
    kw = {"device": backend, name: value}
    if name == "seed":
        kw["dropout_p"] = 0.1
    with pytest.raises(InvalidArgumentError) as info:
        flashport.attention(Q, K, V, **kw)
    assert str(info.value).startswith(f"{name}="), str(info.value)


@pytest.mark.parametrize("name,value", [("causal", "False"), ("return_dmask", "no")])
def test_bad_backward_flags_name_the_keyword(backend, name, value):
    out, lse = flashport.attention(Q, K, V, return_lse=True, device="cpu")
    do = arr(*out.shape)
    mask = arr(10, 12)
    with pytest.raises(InvalidArgumentError, match=f"^{name}="):
        flashport.attention_backward(
            do, Q, K, V, out, lse, mask=mask, device=backend, **{name: value}
        )


def test_merge_states_device_must_be_a_name():
    out, lse = flashport.attention(Q, K, V, return_lse=True, device="cpu")
    with pytest.raises(InvalidArgumentError, match=r"^device=1"):
        flashport.merge_states([out], [lse], device=1)


def test_numpy_scalars_are_taken_as_their_values(backend):
    plain = flashport.attention(
        Q, K, V, scale=0.5, window=(3, None), causal=True, q_offset=4, device=backend
    )
    numpy_scalars = flashport.attention(
        Q,
        K,
        V,
        scale=np.float32(0.5),
        window=[np.int32(3), None],
        causal=np.bool_(True),
        q_offset=np.int64(4),
        device=backend,
    )
    np.testing.assert_array_equal(plain, numpy_scalars)
    whole = flashport.attention(Q, K, V, scale=1, device=backend)
    np.testing.assert_array_equal(whole, flashport.attention(Q, K, V, scale=1.0, device=backend))
