"""The public attention functions: argument conversion and contracts. The
computation and all validation happen in the Rust core (``flashport._core``)."""

from __future__ import annotations

from typing import Any, Literal, overload

import numpy as np
import numpy.typing as npt

from . import _core
from ._device import DeviceArray, as_native_array
from ._errors import InvalidArgumentError

__all__ = ["attention", "attention_backward", "devices"]

# "cpu", "gpu", "gpu:N" or "auto" (a string: "gpu:N" is no Literal).
Device = str

# A main array argument (q, k, v; do, o, lse).
Tensor = npt.ArrayLike | DeviceArray


def _main_array(x: Tensor) -> np.ndarray | _core.DeviceArray:
    """A main argument as the core takes it: a NumPy array, or the GPU
    tensor of a DeviceArray (never read back here)."""
    return x._array if isinstance(x, DeviceArray) else as_native_array(x)


def _variant_array(name: str, x: npt.ArrayLike | None) -> np.ndarray | None:
    """A variant array (mask, alibi_slopes, sinks): NumPy only, since the host
    reads them; a DeviceArray is refused rather than silently read back."""
    if x is None:
        return None
    if isinstance(x, DeviceArray):
        raise InvalidArgumentError(
            f"{name} is a flashport.DeviceArray: mask, alibi_slopes and sinks are read on "
            f"the host and must be NumPy arrays (pass {name}.numpy(), a copy from the GPU)"
        )
    return as_native_array(x)


def _result(x: np.ndarray | _core.DeviceArray) -> np.ndarray | DeviceArray:
    return DeviceArray(x) if isinstance(x, _core.DeviceArray) else x


Window = tuple[int | None, int | None]


def _variants(
    *,
    causal: bool = False,
    scale: float | None = None,
    window: Window | None = None,
    mask: npt.ArrayLike | None = None,
    alibi_slopes: npt.ArrayLike | None = None,
    softcap: float | None = None,
    sinks: npt.ArrayLike | None = None,
    dropout_p: float = 0.0,
    seed: int | None = None,
    q_offset: int | None = None,
    k_offset: int | None = None,
) -> dict[str, Any]:
    """The variant keywords of one call, by name, as the caller gave them: the
    dict the binding reads as its one ``VariantArgs``, for every entry point
    (the core checks each keyword, its type too, and names it). An entry
    point passes the keywords its signature has; the others keep these
    defaults, the values that leave a variant off (the core refuses any
    other for an operation that does not take the keyword)."""
    return {
        "causal": causal,
        "scale": scale,
        "window": window,
        "mask": _variant_array("mask", mask),
        "alibi_slopes": _variant_array("alibi_slopes", alibi_slopes),
        "softcap": softcap,
        "sinks": _variant_array("sinks", sinks),
        "dropout_p": dropout_p,
        "seed": seed,
        "q_offset": q_offset,
        "k_offset": k_offset,
    }


# Static types follow q: a DeviceArray q gives DeviceArrays. (At run time
# any main array that is a DeviceArray does; DeviceArray is also ArrayLike,
# so a NumPy q with a DeviceArray k or v matches the NumPy overloads.)
@overload
def attention(
    q: DeviceArray,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = ...,
    scale: float | None = ...,
    window: Window | None = ...,
    mask: npt.ArrayLike | None = ...,
    alibi_slopes: npt.ArrayLike | None = ...,
    softcap: float | None = ...,
    sinks: npt.ArrayLike | None = ...,
    dropout_p: float = ...,
    seed: int | None = ...,
    q_offset: int | None = ...,
    k_offset: int | None = ...,
    return_lse: Literal[False] = ...,
    device: Device | None = ...,
) -> DeviceArray: ...
@overload
def attention(
    q: DeviceArray,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = ...,
    scale: float | None = ...,
    window: Window | None = ...,
    mask: npt.ArrayLike | None = ...,
    alibi_slopes: npt.ArrayLike | None = ...,
    softcap: float | None = ...,
    sinks: npt.ArrayLike | None = ...,
    dropout_p: float = ...,
    seed: int | None = ...,
    q_offset: int | None = ...,
    k_offset: int | None = ...,
    return_lse: Literal[True],
    device: Device | None = ...,
) -> tuple[DeviceArray, DeviceArray]: ...
@overload
def attention(
    q: npt.ArrayLike,
    k: npt.ArrayLike,
    v: npt.ArrayLike,
    *,
    causal: bool = ...,
    scale: float | None = ...,
    window: Window | None = ...,
    mask: npt.ArrayLike | None = ...,
    alibi_slopes: npt.ArrayLike | None = ...,
    softcap: float | None = ...,
    sinks: npt.ArrayLike | None = ...,
    dropout_p: float = ...,
    seed: int | None = ...,
    q_offset: int | None = ...,
    k_offset: int | None = ...,
    return_lse: Literal[False] = ...,
    device: Device | None = ...,
) -> np.ndarray: ...
@overload
def attention(
    q: npt.ArrayLike,
    k: npt.ArrayLike,
    v: npt.ArrayLike,
    *,
    causal: bool = ...,
    scale: float | None = ...,
    window: Window | None = ...,
    mask: npt.ArrayLike | None = ...,
    alibi_slopes: npt.ArrayLike | None = ...,
    softcap: float | None = ...,
    sinks: npt.ArrayLike | None = ...,
    dropout_p: float = ...,
    seed: int | None = ...,
    q_offset: int | None = ...,
    k_offset: int | None = ...,
    return_lse: Literal[True],
    device: Device | None = ...,
) -> tuple[np.ndarray, np.ndarray]: ...
def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: Window | None = None,
    mask: npt.ArrayLike | None = None,
    alibi_slopes: npt.ArrayLike | None = None,
    softcap: float | None = None,
    sinks: npt.ArrayLike | None = None,
    dropout_p: float = 0.0,
    seed: int | None = None,
    q_offset: int | None = None,
    k_offset: int | None = None,
    return_lse: bool = False,
    device: Device | None = None,
) -> np.ndarray | DeviceArray | tuple[np.ndarray | DeviceArray, np.ndarray | DeviceArray]:
    """Exact scaled dot-product attention, ``softmax(scale · q kᵀ) v``, computed
    with FlashAttention-2's tiled online softmax: memory grows linearly with the
    sequence lengths, never as ``seq_q × seq_k``.

    Arguments
    ---------
    q : array or DeviceArray ``(batch, heads_q, seq_q, d)``
    k : array or DeviceArray ``(batch, heads_kv, seq_k, d)``
    v : array or DeviceArray ``(batch, heads_kv, seq_k, d_v)``
        The layout of PyTorch's ``scaled_dot_product_attention``. Unbatched
        ``(heads, seq, dim)`` and ``(seq, dim)`` are accepted too (all three
        arrays with the same number of dimensions). ``seq_q`` may differ from
        ``seq_k`` and ``d_v`` from ``d``. Grouped-query / multi-query attention:
        ``heads_q`` must be a multiple of ``heads_kv``; query head ``h`` reads
        key/value head ``h // (heads_q // heads_kv)``.
        Any strides, byte order or writeability; inputs are never modified.
        Each may be a :class:`DeviceArray` (see :func:`to_device`), already in
        GPU memory: it is used there without a copy from the host, and the
        call runs on the GPU. NumPy and device arrays may be mixed.
    causal : bool
        Causal mask: a query sees the keys at its position and before, at
        the positions ``q_offset`` and ``k_offset`` give. By default
        bottom-right aligned (the FlashAttention-2 convention): query ``i``
        sees keys ``j <= i + seq_k - seq_q``::

            seq_q=3, seq_k=5         seq_q=5, seq_k=2
                  keys 0 1 2 3 4           keys 0 1
            query 0    x x x . .     query 0    . .   <- sees no key:
            query 1    x x x x .     query 1    . .      output 0,
            query 2    x x x x x     query 2    . .      lse = -inf
                                     query 3    x .
                                     query 4    x x

    scale : float, optional
        Multiplier of ``q kᵀ``; defaults to ``1 / sqrt(d)``. Must be finite.
    window : (left, right), optional
        Sliding-window (local) attention, aligned like ``causal``: query ``i``
        sees keys ``i + off - left <= j <= i + off + right`` with
        ``off = q_offset - k_offset`` (by default ``seq_k - seq_q``). ``None``
        or ``-1`` leaves a side unbounded;
        ``window=(w, 0)`` is causal attention over the last ``w + 1`` keys.
        Combines with ``causal`` (the tighter right side wins).
    mask : array, optional
        Broadcastable to ``(batch, heads_q, seq_q, seq_k)`` (NumPy rules, so
        ``(seq_k,)`` is a key-padding mask and ``(seq_q, seq_k)`` is shared by
        every head). Boolean: ``True`` = attend. Float (float16/32/64,
        bfloat16): added to the scores; ``-inf`` hides a key. Tiles the mask hides entirely
        are skipped, so block-sparse masks run proportionally faster.
    alibi_slopes : array ``(heads_q,)`` or ``(batch, heads_q)``, optional
        ALiBi: adds ``-slope · |i + off - j|`` to the scores (the distance of
        the two positions, aligned like ``causal``).
    softcap : float, optional
        Logit soft-capping: the scaled scores ``u`` become
        ``softcap · tanh(u / softcap)`` before ALiBi and the mask are added.
        ``None`` or ``0`` disables it.
    sinks : array ``(heads_q,)``, optional
        One learnable logit per query head that joins every row's softmax
        denominator (an "attention sink" that absorbs probability mass and
        contributes nothing to the output). ``lse`` includes it.
    dropout_p : float
        Dropout on the attention probabilities, in ``[0, 1)``: each
        probability is kept with probability ``1 - dropout_p`` and scaled by
        ``1 / (1 - dropout_p)``. The mask is regenerated from ``seed`` and the
        element's position by a counter-based generator (Philox4x32-10, see
        :func:`flashport.reference.dropout_keep`), never stored, and is the
        same on every backend.
    seed : int, optional
        In ``[0, 2**64)``; required when ``dropout_p > 0``. Pass the same seed
        to :func:`attention_backward`.
    q_offset, k_offset : int, optional
        The global positions of query row 0 and of key 0 (Python or NumPy
        integers within ``±2**62``): query ``i`` is at ``q_offset + i``, key
        ``j`` at ``k_offset + j``, and ``causal``, ``window`` and
        ``alibi_slopes`` compare these positions. The defaults,
        ``q_offset = seq_k - seq_q`` and ``k_offset = 0``, are the
        bottom-right alignment above; explicit defaults give the same bits.
        With them, attention over keys split into blocks is each block's
        attention with its own ``k_offset``, merged by :func:`merge_states`.
        ``mask`` and dropout keep using the local ``(i, j)``. On the GPU,
        ALiBi needs ``|q_offset - k_offset| + seq_q + seq_k < 2**31``
        (``ProblemTooLargeError`` otherwise).
    return_lse : bool
        Also return the log-sum-exp, which ``attention_backward`` needs.
    device : "cpu", "gpu", "gpu:N" or "auto", optional
        Where to compute. ``None`` means ``$FLASHPORT_DEVICE`` if set, else
        ``"auto"``: the default GPU where it is a hardware one and a cost
        model of the two devices (their rates, the GPU's fixed cost per call
        and the copies of NumPy arrays to it and back) expects the call to
        finish sooner, otherwise the CPU (never a software adapter).
        ``"gpu:N"`` is entry ``N`` of :func:`devices`; ``"gpu"`` the default
        GPU: the one ``$FLASHPORT_DEVICE="gpu:N"`` names, else the best
        (``gpu:0``, or the next one where its driver refuses a device).
        The CPU uses ``$FLASHPORT_NUM_THREADS`` threads (default: all cores).
        When ``q``, ``k`` or ``v`` is a DeviceArray, ``None``, ``"gpu"`` and
        ``"auto"`` mean its GPU (whatever ``$FLASHPORT_DEVICE`` says), a
        ``"gpu:N"`` must be that one, ``"cpu"`` is an error, and so are
        DeviceArrays of two GPUs (:meth:`DeviceArray.to` copies one over).

    Returns
    -------
    Results live where the inputs live: NumPy arrays, or, when ``q``, ``k``
    or ``v`` is a DeviceArray, DeviceArrays that stay in GPU memory (pass
    them on to :func:`attention_backward` without a round trip through the
    host; ``.numpy()`` reads one back). Either way the values are the same,
    bit for bit.

    o : array ``(batch, heads_q, seq_q, d_v)``
        In the inputs' dtype. float32 and float64 are computed natively;
        float16 and bfloat16 (``ml_dtypes.bfloat16``) are accumulated in
        float32 and rounded once.
    lse : array ``(batch, heads_q, seq_q)``, only with ``return_lse=True``
        ``lse[i] = log(sum_j exp(s_ij))`` over the keys row ``i`` sees (natural
        log), where ``s_ij = scale · q_i · k_j`` modified by the variants above,
        plus ``exp(sink)`` inside the sum with ``sinks``; float32, or float64 for
        float64 inputs. ``-inf`` for a row that sees no key (and has no sink).
        Dropout does not change it.

    Results are deterministic: bitwise identical across runs and thread counts.

    Raises
    ------
    ShapeError (a ValueError)
        Wrong number of dimensions or sizes that disagree; the message names
        the argument and the shapes.
    DTypeError (a TypeError)
        A dtype other than float16/32/64 or bfloat16, or arrays of different
        dtypes.
    InvalidArgumentError (a ValueError)
        A non-finite ``scale``, an unknown ``device``, a variant keyword out
        of range (``window``, ``softcap``, ``dropout_p``, ``seed``), or a
        keyword of the wrong kind: flags take only ``True``/``False`` (NumPy
        bools too), numbers only ints and floats (not bools or strings),
        integers only ints; nothing is coerced. The message names the
        keyword and the value. Also ``device="cpu"`` with a
        DeviceArray argument (the message names it; ``x.numpy()`` gives a
        NumPy copy to compute on the CPU), and a DeviceArray as ``mask``,
        ``alibi_slopes`` or ``sinks``, which must be NumPy arrays (they are
        read on the host; flashport does not read them back silently).
    BackendUnavailableError, GpuError (RuntimeErrors)
        ``device="gpu"`` without a usable adapter or without support for a
        variant (the message names it), or a GPU failure. A DeviceArray whose
        GPU device was lost or reset since it was made raises ``GpuError``
        naming the argument; its data is gone, the CPU keeps working.
    """
    out, lse = _core.attention(
        _main_array(q),
        _main_array(k),
        _main_array(v),
        device,
        _variants(
            causal=causal,
            scale=scale,
            window=window,
            mask=mask,
            alibi_slopes=alibi_slopes,
            softcap=softcap,
            sinks=sinks,
            dropout_p=dropout_p,
            seed=seed,
            q_offset=q_offset,
            k_offset=k_offset,
        ),
        return_lse,
    )
    return (_result(out), _result(lse)) if return_lse else _result(out)


# As for attention: static types follow q; dsinks and dmask are NumPy.
@overload
def attention_backward(
    do: Tensor,
    q: DeviceArray,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    lse: Tensor,
    *,
    causal: bool = ...,
    scale: float | None = ...,
    window: Window | None = ...,
    mask: npt.ArrayLike | None = ...,
    alibi_slopes: npt.ArrayLike | None = ...,
    softcap: float | None = ...,
    sinks: npt.ArrayLike | None = ...,
    dropout_p: float = ...,
    seed: int | None = ...,
    q_offset: int | None = ...,
    k_offset: int | None = ...,
    return_dmask: bool = ...,
    device: Device | None = ...,
) -> tuple[DeviceArray | np.ndarray, ...]: ...
@overload
def attention_backward(
    do: npt.ArrayLike,
    q: npt.ArrayLike,
    k: npt.ArrayLike,
    v: npt.ArrayLike,
    o: npt.ArrayLike,
    lse: npt.ArrayLike,
    *,
    causal: bool = ...,
    scale: float | None = ...,
    window: Window | None = ...,
    mask: npt.ArrayLike | None = ...,
    alibi_slopes: npt.ArrayLike | None = ...,
    softcap: float | None = ...,
    sinks: npt.ArrayLike | None = ...,
    dropout_p: float = ...,
    seed: int | None = ...,
    q_offset: int | None = ...,
    k_offset: int | None = ...,
    return_dmask: bool = ...,
    device: Device | None = ...,
) -> tuple[np.ndarray, ...]: ...
def attention_backward(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    lse: Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: Window | None = None,
    mask: npt.ArrayLike | None = None,
    alibi_slopes: npt.ArrayLike | None = None,
    softcap: float | None = None,
    sinks: npt.ArrayLike | None = None,
    dropout_p: float = 0.0,
    seed: int | None = None,
    q_offset: int | None = None,
    k_offset: int | None = None,
    return_dmask: bool = False,
    device: Device | None = None,
) -> tuple[np.ndarray | DeviceArray, ...]:
    """Gradients of :func:`attention` with respect to ``q``, ``k`` and ``v``.

    FlashAttention-2's backward: the attention probabilities are recomputed
    tile by tile from ``lse`` instead of being stored, so memory stays linear.

    Arguments
    ---------
    do : array or DeviceArray shaped like ``o``
        Gradient of the loss with respect to the attention output.
    q, k, v, causal, scale, window, mask, alibi_slopes, softcap, sinks, dropout_p, seed
    q_offset, k_offset, device
        Exactly as passed to :func:`attention`.
    o, lse
        The output and log-sum-exp :func:`attention` returned for them
        (``return_lse=True``). ``lse`` may be float32 or float64. They may
        also be those of a larger attention that these keys are a block of:
        called per key block (each with its ``k_offset``) with the ``o`` and
        ``lse`` of the attention over all blocks (:func:`merge_states` of
        the blocks' forwards), the backward gives each block's ``dk`` and
        ``dv`` and a share of ``dq``; the shares sum to the whole ``dq``
        (what ring attention does).

    Any of ``do``, ``q``, ``k``, ``v``, ``o`` and ``lse`` may be a
    :class:`DeviceArray` (the forward's DeviceArray outputs, passed back as
    they are, never leave the GPU); then the call runs on the GPU, as for
    :func:`attention`. ``mask``, ``alibi_slopes`` and ``sinks`` are NumPy only.

    Returns
    -------
    Results live where the inputs live: when any of ``do``, ``q``, ``k``,
    ``v``, ``o``, ``lse`` is a DeviceArray, ``dq``, ``dk`` and ``dv`` are
    DeviceArrays (bit for bit the values NumPy inputs give). ``dsinks`` and
    ``dmask`` are NumPy arrays either way: they are the gradients of NumPy
    arguments and are computed on the host (``dsinks`` in float64 from
    ``do``, ``o`` and ``lse``, which are read back from the GPU for it when
    they are DeviceArrays; ``dmask`` from the full score gradient, which is
    read back).

    dq : array shaped like ``q``
    dk : array shaped like ``k`` (``heads_kv`` heads: the gradients of the
        query heads that share a key/value head are summed)
    dv : array shaped like ``v``
        In the inputs' dtype. Deterministic: computed without atomics, in an
        order that depends neither on scheduling nor on the thread count.
    dsinks : array shaped like ``sinks``, only when ``sinks`` is given
        In the dtype of ``sinks``.
    dmask : array shaped like ``mask``, only with ``return_dmask=True``
        The gradient of a float mask (summed over the dimensions it
        broadcasts along), in the mask's dtype. Computing it takes memory for
        the full ``batch × heads_q × seq_q × seq_k`` gradient.

    The tuple is ``(dq, dk, dv)``, then ``dsinks`` if ``sinks`` was given,
    then ``dmask`` if it was asked for.

    Raises
    ------
    The same errors as :func:`attention`; ``do``/``o`` must have the output's
    shape and dtype and ``lse`` the shape ``q.shape[:-1]``.
    """
    dq, dk, dv, dsinks, dmask = _core.attention_backward(
        _main_array(do),
        _main_array(q),
        _main_array(k),
        _main_array(v),
        _main_array(o),
        _main_array(lse),
        device,
        _variants(
            causal=causal,
            scale=scale,
            window=window,
            mask=mask,
            alibi_slopes=alibi_slopes,
            softcap=softcap,
            sinks=sinks,
            dropout_p=dropout_p,
            seed=seed,
            q_offset=q_offset,
            k_offset=k_offset,
        ),
        return_dmask,
    )
    grads = [_result(dq), _result(dk), _result(dv)]
    if sinks is not None:
        grads.append(dsinks)
    if return_dmask:
        grads.append(dmask)
    return tuple(grads)


def devices() -> list[dict[str, Any]]:
    """What flashport can compute on: the CPU (thread count, per-core cache)
    and each GPU adapter: ``"device"`` (``"gpu:N"``, what ``device=`` takes),
    ``"index"`` (N), backend API, name, type (``"discrete"``,
    ``"integrated"``, ``"virtual"`` or ``"software"``), ``"pci_bus_id"``
    (``domain:bus:device.function``; empty where the backend does not say),
    driver, and the limits and features flashport uses.

    The GPUs are numbered the same way in every process on one machine:
    hardware before software adapters (discrete, integrated, virtual), then
    by PCI bus address (``nvidia-smi``'s order), then by name; a card that
    two backends show (Vulkan and DX12) is listed once. ``gpu:0`` is the
    best, what ``device="gpu"`` uses by default."""
    return _core.devices()
