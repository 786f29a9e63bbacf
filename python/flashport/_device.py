"""Arrays that stay in GPU memory between calls: :class:`DeviceArray`,
:func:`to_device`, and :func:`synchronize` for the calls on them, which
return as soon as their work is queued."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from . import _core

__all__ = ["DeviceArray", "synchronize", "to_device"]


class DeviceArray:
    """A float32 or float16 array resident in GPU memory.

    Made by :func:`to_device`, or returned by :func:`flashport.attention` and
    :func:`flashport.attention_backward` when one of their main arrays is a
    ``DeviceArray`` (results live where the inputs live). Passing it to those
    functions again binds its GPU buffer directly: a forward followed by its
    backward uploads q, k and v once, and the forward's ``o`` and ``lse`` need
    never leave the GPU.

    It lives on one GPU, :attr:`device` (``"gpu:N"``): a call on it runs
    there, a call mixing arrays of two GPUs raises
    :class:`flashport.InvalidArgumentError` naming both, and :meth:`to` copies
    it to another GPU.

    Immutable: it has no methods that modify it, and no flashport call writes
    into an array it was given; :meth:`copy` makes a new one on the GPU. To
    read it, call :meth:`numpy` (or
    ``np.asarray(x)``): each returns a new NumPy array copied back from the
    GPU. It holds GPU memory until it is garbage-collected. If the GPU device
    is lost or reset (a driver reset, a removed GPU), its data is gone:
    using it raises :class:`flashport.GpuError` naming the argument.

    Asynchronous, as CUDA tensors are: a call whose arrays are all
    ``DeviceArray`` s (and :meth:`copy`, and an append to a GPU
    :class:`flashport.KVCache`) returns as soon as its work is queued on the
    GPU, and its results are ``DeviceArray`` s whose values
    are computed later. The GPU runs calls in the order they were made, so
    passing a result to the next call is always correct. :meth:`numpy`,
    ``np.asarray(x)``, every call with a NumPy array among its arguments or
    results, and :func:`flashport.synchronize` wait for the work queued
    before them. A GPU failure in queued work (a lost device) raises
    :class:`flashport.GpuError` at the latest at the next call that waits,
    and reading any array the lost device held raises it too: such an
    array never returns stale values. ``del`` of an array while calls that
    use it are queued is safe: its memory is reused only by later work.
    """

    __slots__ = ("_array",)

    _array: _core.DeviceArray

    def __init__(self, array: _core.DeviceArray) -> None:
        if not isinstance(array, _core.DeviceArray):
            raise TypeError(
                "DeviceArray is made by flashport.to_device(array), not constructed directly"
            )
        object.__setattr__(self, "_array", array)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"DeviceArray is immutable: cannot set {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"DeviceArray is immutable: cannot delete {name!r}")

    @property
    def shape(self) -> tuple[int, ...]:
        return self._array.shape

    @property
    def dtype(self) -> np.dtype:
        """``numpy.float32`` or ``numpy.float16``."""
        return np.dtype(self._array.dtype)

    @property
    def ndim(self) -> int:
        return len(self._array.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self._array.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        """Bytes of the elements in GPU memory."""
        return self._array.nbytes

    @property
    def device(self) -> str:
        """``"gpu:N"``: the GPU that holds the array (an index of
        :func:`flashport.devices`)."""
        return self._array.device

    @property
    def adapter(self) -> str:
        """The name of the GPU adapter that holds the array."""
        return self._array.adapter

    def numpy(self) -> np.ndarray:
        """A new NumPy array with the values, copied back from the GPU."""
        return self._array.numpy()

    def copy(self) -> DeviceArray:
        """A new ``DeviceArray`` with the same values, copied on the GPU
        (nothing passes through host memory)."""
        return DeviceArray(self._array.copy())

    def to(self, device: str) -> DeviceArray:
        """The array on ``device`` (``"gpu:N"``; ``"gpu"`` and ``"auto"`` the
        default GPU): this array itself where it is there already, else a new
        one copied through host memory (read back, then uploaded).

        Raises
        ------
        InvalidArgumentError
            ``device`` names no GPU of this machine (the message lists them),
            or is ``"cpu"`` (use :meth:`numpy`).
        GpuError
            Either GPU failed, or this array's was lost.
        """
        moved = self._array.to(device)
        # On its own GPU the core hands back the same buffer: keep this object.
        return self if moved.device == self.device else DeviceArray(moved)

    def __array__(self, dtype: npt.DTypeLike | None = None, copy: bool | None = None) -> np.ndarray:
        # NumPy's protocol: np.asarray(x) and np.array(x) read the array back.
        if copy is False:
            raise ValueError(
                "a DeviceArray lives in GPU memory: converting it to NumPy always copies "
                "(use x.numpy())"
            )
        array = self.numpy()
        return array if dtype is None else array.astype(dtype, copy=False)

    def __repr__(self) -> str:
        return f"DeviceArray(shape={self.shape}, dtype={self.dtype.name}, device={self.device!r})"


def to_device(array: npt.ArrayLike | DeviceArray, device: str | None = None) -> DeviceArray:
    """Uploads ``array`` to a GPU, where it stays until garbage-collected.

    Arguments
    ---------
    array : float32 or float16 array
        Any strides, byte order or writeability (it is copied, never
        modified). A ``DeviceArray`` is returned as it is (they are
        immutable, so sharing one is safe), or with ``device`` its copy on
        that GPU (:meth:`DeviceArray.to`).
    device : "gpu:N", "gpu", "auto" or None, optional
        Which GPU: ``"gpu:N"`` is entry ``N`` of :func:`flashport.devices`;
        ``None``, ``"gpu"`` and ``"auto"`` the default GPU (the one
        ``$FLASHPORT_DEVICE="gpu:N"`` names, else the best, ``gpu:0``).

    Returns
    -------
    DeviceArray
        On that GPU (:attr:`DeviceArray.device` says which).

    Raises
    ------
    DTypeError (a TypeError)
        Any dtype other than float32 and float16 (the GPU does not compute
        in float64: keep float64 arrays in NumPy and use ``device="cpu"``;
        it keeps no bfloat16: pass bfloat16 NumPy arrays to the calls, which
        widen them to float32 for the GPU), or float16 on an adapter that
        cannot read it.
    InvalidArgumentError
        ``device`` names no GPU of this machine (the message lists them),
        or is ``"cpu"``.
    BackendUnavailableError
        No usable GPU adapter.
    ProblemTooLargeError
        The array is larger than the adapter's largest buffer.
    GpuError
        The GPU failed while uploading.
    """
    if isinstance(array, DeviceArray):
        return array if device is None else array.to(device)
    return DeviceArray(_core.to_device(as_native_array(array), device))


def synchronize(device: str | None = None) -> None:
    """Waits until the GPUs have finished every flashport call queued on them.

    Calls whose arrays are all :class:`DeviceArray` s return as soon as their
    work is queued (as PyTorch's CUDA calls do); reading a result
    (:meth:`DeviceArray.numpy`) waits for it anyway. ``synchronize`` is
    for the rest: timing GPU work from the host (``time.perf_counter()``
    around a call measures only its queueing otherwise), and finding out
    that queued work failed. Decoding's queued calls
    (:func:`attention_with_kvcache`, a GPU :class:`KVCache`'s ``attention``
    and writes) may be held in the host, up to 8, and handed to the GPU
    together with the next call that is not one of them, a read, or this.

    Arguments
    ---------
    device : "gpu:N", "gpu", "auto", "cpu" or None, optional
        ``None`` (the default), ``"gpu"`` and ``"auto"`` wait for every GPU
        in use; ``"gpu:N"`` for that one; ``"cpu"`` returns at once (CPU
        calls return when they are done). Without a GPU in use, there is
        nothing to wait for.

    Raises
    ------
    GpuError
        The GPU device was lost (a driver reset, a removed GPU) while
        queued work ran: that work, and every ``DeviceArray`` the device
        held, are gone (reading one raises). The next GPU call opens the
        device again.
    InvalidArgumentError
        ``device`` is not one of the names above, or names no GPU of this
        machine.
    """
    _core.synchronize(device)


def as_native_array(x: Any) -> np.ndarray:
    """An ndarray view of ``x``; a copy only if its byte order is not the
    machine's (the core reads native-order elements)."""
    array = np.asarray(x)
    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    return array
