"""One Dask worker per GPU of this machine: :func:`gpu_cluster`.

dask-cuda's ``LocalCUDACluster`` convention: a ``LocalCluster`` of worker
processes, one per GPU, each told its GPU through its environment (there
``CUDA_VISIBLE_DEVICES``, here ``FLASHPORT_DEVICE=gpu:N``), named after it.
A worker's flashport calls with ``device=None``, ``"gpu"`` or ``"auto"``
then run on its own GPU, so a ``flashport.dask`` graph spreads its block
tasks over every GPU with no change to the graph. Processes, not threads:
the environment is per process (and so is each GPU's context).

Needs ``distributed`` (``pip install 'flashport[dask]'``), imported only
when a cluster is made.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import flashport
from flashport import BackendUnavailableError, InvalidArgumentError

if TYPE_CHECKING:
    from distributed import LocalCluster

__all__ = ["gpu_cluster", "gpu_names"]


def gpu_names(devices: int | Iterable[int | str] | None = None) -> list[str]:
    """The GPUs a cluster gets a worker each for, as ``"gpu:N"``: every
    hardware GPU flashport lists (every GPU where there is none but software
    adapters) for ``None``; the first ``n`` of those for an int; or the
    GPUs named (``"gpu:N"`` or ``N``, one or a list), each once, in the
    order given."""
    listed = [d for d in flashport.devices() if d["device"].startswith("gpu:")]
    names = [d["device"] for d in listed]
    hardware = [d["device"] for d in listed if d["type"] != "software"]
    default = hardware or names
    if not default:
        raise BackendUnavailableError(
            "gpu_cluster: flashport.devices() lists no GPU adapter on this machine; "
            "use distributed.LocalCluster for CPU workers"
        )
    available = ", ".join(names)
    if devices is None:
        return default
    if isinstance(devices, bool) or not isinstance(devices, int | Iterable):
        raise InvalidArgumentError(
            f"devices={devices!r}: expected None, a number of GPUs, or GPUs as "
            f'"gpu:N" or N (this machine has {available})'
        )
    if isinstance(devices, str):
        devices = [devices]
    if isinstance(devices, int):
        if not 1 <= devices <= len(default):
            raise InvalidArgumentError(
                f"devices={devices}: expected 1 to {len(default)} GPUs "
                f"(this machine has {available})"
            )
        return default[:devices]
    chosen: list[str] = []
    for device in devices:
        index = isinstance(device, int) and not isinstance(device, bool)
        name = f"gpu:{device}" if index else device
        if name not in names:
            raise InvalidArgumentError(
                f"devices: {device!r} is no GPU of this machine (it has {available})"
            )
        if name in chosen:
            raise InvalidArgumentError(f"devices: {name} is named twice (one worker per GPU)")
        chosen.append(name)
    if not chosen:
        raise InvalidArgumentError("devices: no GPU named")
    return chosen


def gpu_cluster(
    devices: int | Iterable[int | str] | None = None,
    *,
    threads_per_worker: int = 1,
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> LocalCluster:
    """A ``distributed.LocalCluster`` with one worker process per GPU.

    Worker ``"gpu:N"`` runs with ``FLASHPORT_DEVICE=gpu:N`` in its
    environment, so every flashport call there with ``device=None``,
    ``"gpu"`` or ``"auto"`` computes on GPU N (``"auto"`` still leaves to
    the CPU what its cost model expects to finish sooner there): pass
    ``device=None`` (the default) to :func:`flashport.dask.attention` and its
    blocks run on the GPU of whichever worker the scheduler gives them.

    Arguments
    ---------
    devices : None, int, or GPUs as ``"gpu:N"`` or ``N``
        ``None``: every hardware GPU of :func:`flashport.devices` (every GPU
        where there are only software adapters); an int: the first that
        many of those; or the GPU or list of GPUs named.
    threads_per_worker : int
        Threads of each worker (default 1: one task at a time per GPU, as
        dask-cuda does; a GPU runs one call's kernels at a time anyway).
    env : dict, optional
        More environment variables for every worker (``FLASHPORT_DEVICE`` is
        set per worker over them).
    **kwargs
        Passed to ``distributed.LocalCluster`` (``host``,
        ``dashboard_address``, ``memory_limit``, ...); the workers are always
        processes. ``memory_limit`` defaults to the machine's memory shared
        out among the workers, as ``LocalCluster`` does.

    Returns
    -------
    distributed.LocalCluster
        Started, its workers named ``"gpu:0"``, ``"gpu:1"``, ...; connect
        with ``distributed.Client(cluster)`` and close it when done.

    Raises
    ------
    BackendUnavailableError
        flashport sees no GPU here.
    InvalidArgumentError
        ``devices`` names a GPU this machine does not have, or one twice;
        ``processes=False`` (threads share one environment).
    """
    from distributed import LocalCluster
    from distributed.worker_memory import parse_memory_limit

    names = gpu_names(devices)
    if kwargs.pop("processes", True) is not True:
        raise InvalidArgumentError(
            "processes=False: a GPU cluster's workers are processes, each with its own "
            "FLASHPORT_DEVICE"
        )
    for taken in ("n_workers", "worker_class"):
        if taken in kwargs:
            raise InvalidArgumentError(f"{taken}: gpu_cluster makes one Nanny worker per GPU")
    if "memory_limit" not in kwargs:
        share = parse_memory_limit("auto", 1, len(names), logger=logging.getLogger(__name__))
        kwargs["memory_limit"] = share
    extra = {str(k): str(v) for k, v in (env or {}).items()}

    class GpuCluster(LocalCluster):
        """``LocalCluster`` whose next worker is the first GPU without one
        (dask-cuda's ``new_worker_spec``)."""

        def new_worker_spec(self) -> dict:
            free = [name for name in names if name not in self.worker_spec]
            if not free:
                raise InvalidArgumentError(
                    f"a GPU cluster has one worker per GPU: it cannot grow past {len(names)}"
                )
            spec = copy.deepcopy(self.new_spec)
            spec["options"]["env"] = {**extra, "FLASHPORT_DEVICE": free[0]}
            return {free[0]: spec}

    cluster = GpuCluster(
        n_workers=0, threads_per_worker=threads_per_worker, processes=True, **kwargs
    )
    try:
        cluster.scale(len(names))
        cluster.wait_for_workers(len(names))
    except BaseException:
        cluster.close()
        raise
    return cluster
