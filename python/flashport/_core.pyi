# Stubs of the compiled extension (rust/flashport-py). tests/test_stubs.py
# checks them against the module with mypy.stubtest.
import numpy as np
import numpy.typing as npt

__version__: str

def attention(
    q: npt.NDArray[np.floating],
    k: npt.NDArray[np.floating],
    v: npt.NDArray[np.floating],
    causal: bool,
    scale: float | None,
    device: str | None,
    variants: dict[str, object],
) -> tuple[npt.NDArray[np.floating], npt.NDArray[np.floating]]: ...
def attention_backward(
    d_out: npt.NDArray[np.floating],
    q: npt.NDArray[np.floating],
    k: npt.NDArray[np.floating],
    v: npt.NDArray[np.floating],
    out: npt.NDArray[np.floating],
    lse: npt.NDArray[np.floating],
    causal: bool,
    scale: float | None,
    device: str | None,
    variants: dict[str, object],
    return_dmask: bool,
) -> tuple[
    npt.NDArray[np.floating],
    npt.NDArray[np.floating],
    npt.NDArray[np.floating],
    npt.NDArray[np.floating] | None,
    npt.NDArray[np.floating] | None,
]: ...
def devices() -> list[dict[str, object]]: ...
def _gpu_kernel_times() -> list[tuple[str, float]]: ...
def _gpu_lose_device_for_tests() -> None: ...
