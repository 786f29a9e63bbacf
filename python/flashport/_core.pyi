# Stubs of the compiled extension (rust/flashport-py). tests/test_stubs.py
# checks them against the module with mypy.stubtest.
from collections.abc import Iterable
from typing import final

import numpy as np
import numpy.typing as npt

__version__: str

@final
class DeviceArray:
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def dtype(self) -> str: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def adapter(self) -> str: ...
    @property
    def device(self) -> str: ...
    def numpy(self) -> npt.NDArray[np.floating]: ...
    def copy(self) -> DeviceArray: ...
    def to(self, device: str) -> DeviceArray: ...

# A floating NumPy array: ml_dtypes' bfloat16 is a numpy.generic, not a
# numpy.floating.
_Float = npt.NDArray[np.floating] | npt.NDArray[np.generic]
# A main array argument or result: NumPy, or resident on the GPU.
_Tensor = _Float | DeviceArray

def to_device(array: npt.NDArray[np.floating], device: str | None = None) -> DeviceArray: ...
def attention(
    q: _Tensor,
    k: _Tensor,
    v: _Tensor,
    device: object,
    variants: dict[str, object],
    return_lse: object,
) -> tuple[_Tensor, _Tensor]: ...
def attention_backward(
    d_out: _Tensor,
    q: _Tensor,
    k: _Tensor,
    v: _Tensor,
    out: _Tensor,
    lse: _Tensor,
    device: object,
    variants: dict[str, object],
    return_dmask: object,
) -> tuple[
    _Tensor,
    _Tensor,
    _Tensor,
    _Float | None,
    _Float | None,
]: ...
def merge_states(
    outs: list[_Tensor] | _Tensor,
    lses: list[_Tensor] | _Tensor,
    device: object,
) -> tuple[_Tensor, _Tensor]: ...
def sum_widened(parts: list[_Float], dtype: str) -> _Float: ...
def attention_varlen(
    q: _Tensor,
    k: _Tensor,
    v: _Tensor,
    cu_seqlens_q: npt.NDArray[np.generic],
    cu_seqlens_k: npt.NDArray[np.generic],
    device: object,
    variants: dict[str, object],
    return_lse: object,
) -> tuple[_Tensor, _Tensor]: ...
def attention_varlen_backward(
    d_out: _Tensor,
    q: _Tensor,
    k: _Tensor,
    v: _Tensor,
    out: _Tensor,
    lse: _Tensor,
    cu_seqlens_q: npt.NDArray[np.generic],
    cu_seqlens_k: npt.NDArray[np.generic],
    device: object,
    variants: dict[str, object],
) -> tuple[_Tensor, _Tensor, _Tensor, _Float | None]: ...
def attention_with_kvcache(
    q: _Tensor,
    k_cache: _Tensor,
    v_cache: _Tensor,
    cache_seqlens: npt.NDArray[np.integer],
    block_table: npt.NDArray[np.integer] | None,
    device: object,
    variants: dict[str, object],
    num_splits: object,
    return_lse: object,
) -> tuple[_Tensor, _Tensor]: ...

@final
class KVCache:
    def __new__(
        cls,
        num_blocks: int,
        block_size: int,
        heads_kv: int,
        head_dim: int,
        head_dim_v: int | None,
        layers: int,
        dtype: str,
        device: str | None,
        swap_blocks: int,
    ) -> KVCache: ...
    def new_sequence(self) -> int: ...
    def fork(self, sid: int) -> int: ...
    def free(self, sid: int) -> None: ...
    def swap_out(self, seq_ids: Iterable[int]) -> None: ...
    def swap_in(self, seq_ids: Iterable[int]) -> None: ...
    def is_swapped(self, sid: int) -> bool: ...
    def swapped(self) -> list[int]: ...
    def swap_usage(self) -> tuple[int, int]: ...
    def append(
        self,
        sid: int,
        k: _Tensor,
        v: _Tensor,
        layer: int,
        tokens: npt.NDArray[np.integer] | None,
    ) -> None: ...
    def append_batch(
        self,
        seq_ids: Iterable[int],
        k: _Tensor,
        v: _Tensor,
        layer: int,
        tokens: npt.NDArray[np.integer] | None,
    ) -> None: ...
    def attention(
        self,
        q: _Tensor,
        seq_ids: Iterable[int],
        layer: int,
        variants: dict[str, object],
        num_splits: object,
        return_lse: object,
    ) -> tuple[_Tensor, _Tensor]: ...
    def length(self, sid: int, layer: int | None) -> int: ...
    def block_table(self, seq_ids: Iterable[int]) -> npt.NDArray[np.integer]: ...
    def ref_counts(self) -> npt.NDArray[np.int64]: ...
    def read_layer(self, layer: int) -> tuple[_Float, _Float]: ...
    def sequences(self) -> list[int]: ...
    def config(self) -> tuple[int, int, int, int, int, int, str, str, int]: ...
    def usage(self) -> tuple[int, int, int]: ...

def devices() -> list[dict[str, object]]: ...
def synchronize(device: str | None = None) -> None: ...
def _gpu_kernel_times() -> list[tuple[str, float]]: ...
def _gpu_kernel_timing(enabled: bool) -> None: ...

# The development build (cargo feature `testing`) also has the test hooks
# `_testing_set_overrides`, `_testing_lose_device`,
# `_testing_held_call_that_fails`, `_testing_queued_submissions`,
# `_testing_held_calls` and `_testing_open_gpus`; the wheel does not, so
# they have no stubs
# here (stubtest runs with --ignore-missing-stub).
