"""Peak memory of one attention call, for the demo and the benchmark."""

from __future__ import annotations

import json
import subprocess
import sys

# Run in a fresh interpreter: in a process that already computed something,
# the allocator reuses freed pages and a call's temporaries do not raise the
# resident set at all, so the measure would read low.
_PROBE = r"""
import json, sys
import numpy as np
import flashport

def kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)

shape, causal, device = json.loads(sys.argv[1])
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal(shape, dtype=np.float32) for _ in range(3))
# A tiny call first, so that starting the thread pool or the GPU context
# (driver allocations, shader compilation) is not charged to the call.
tiny = np.ones((1, 1, 4, shape[-1]), dtype=np.float32)
flashport.attention(tiny, tiny, tiny, causal=causal, device=device)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets VmHWM to the current resident set
before = kib("VmRSS")
out, lse = flashport.attention(q, k, v, causal=causal, return_lse=True, device=device)
peak = kib("VmHWM")
print(json.dumps({"peak_extra": (peak - before) * 1024, "outputs": out.nbytes + lse.nbytes}))
"""


def forward_peak_bytes(shape, causal: bool, device: str) -> dict | None:
    """How far a float32 forward of ``shape`` raised the peak resident memory
    of a fresh process above its level with the inputs allocated and the
    device warmed up (``peak_extra``, outputs and host staging included;
    ``outputs`` is their size), or ``None`` where ``/proc/self/clear_refs``
    is unavailable (not Linux)."""
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps([list(shape), causal, device])],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])
