"""flashport.dask: exact attention over sequences split into chunks, on
Dask's schedulers (the local threaded one by default, or a
``dask.distributed`` cluster).

>>> import dask.array as da, numpy as np, flashport.dask as fpd
>>> rng = np.random.default_rng(0)
>>> q, k, v = (da.from_array(rng.standard_normal((1, 8, 4096, 64), dtype=np.float32),
...                          chunks=(1, 8, 1024, 64)) for _ in range(3))
>>> o, lse = fpd.attention(q, k, v, causal=True, return_lse=True)   # lazy
>>> dq, dk, dv = fpd.attention_backward(da.ones_like(o), q, k, v, o, lse, causal=True)

Each (query chunk, key chunk) block that causal or the window leave
visible is one task calling :func:`flashport.attention` at the block's
global positions; each query chunk's partial results merge by
:func:`flashport.merge_states`. The backward's blocks use the merged ``o``
and ``lse``. docs/dask.md describes the graph, the zig-zag order and a
scaling model.

On a machine with several GPUs, :func:`gpu_cluster` makes a
``distributed.LocalCluster`` with one worker per GPU (``FLASHPORT_DEVICE``
set per worker, dask-cuda's convention): the blocks then run on every GPU.

Needs Dask: ``pip install 'flashport[dask]'`` (plain flashport does not
import it; ``gpu_cluster`` also needs ``distributed``).
"""

from __future__ import annotations

try:
    import dask.array  # noqa: F401
except ImportError as error:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        "flashport.dask needs Dask (dask[array]); install it with: pip install 'flashport[dask]'"
    ) from error

from ._api import attention, attention_backward
from ._cluster import gpu_cluster
from ._layout import zigzag_index
from ._zigzag import unzigzag, zigzag

__all__ = ["attention", "attention_backward", "gpu_cluster", "unzigzag", "zigzag", "zigzag_index"]
