"""The portable CPU kernels, which every machine without AVX2 and FMA runs,
forced on here with the `portable_cpu` test override (in a child process,
which sets it before its first call): the same checks against the float64 oracle as the property
suites, on fixed cases, plain and with variants."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import flashport
import numpy as np
from cases import Case

TESTS = Path(__file__).resolve().parent

CASES = [
    # GQA, d != d_v, lengths off the tile grid.
    Case(2, 2, 2, 97, 131, 40, 24, True, None, 4, 1),
    Case(1, 1, 3, 300, 300, 64, 64, False, 0.3, 4, 2),
    # seq_q > seq_k: causal rows that see no key.
    Case(1, 2, 1, 65, 17, 128, 96, True, None, 3, 3),
]

CHILD = r"""
import sys
import numpy as np
from flashport import _core
_core._testing_set_overrides(portable_cpu=True)
from cases import Case, Variants
from test_properties import check_backward, check_forward
from test_variants import check_variants

cases = [Case(*c) for c in eval(sys.argv[1])]
for case in cases:
    for dtype in (np.float32, np.float16):
        check_forward(case, dtype, "cpu")
        check_backward(case, dtype, "cpu")
shape = (cases[0].seq_q, cases[0].seq_k)
for spec in (
    Variants(window=(20, 3), mask="float", mask_shape=shape, alibi="heads", softcap=30.0,
             sinks=True, seed=5),
    Variants(mask="bool", mask_shape=shape, mask_dead_row=True, dropout_p=0.3,
             dropout_seed=7, seed=6),
):
    check_variants(cases[0], spec, np.float32, "cpu")
# The raw float32 results, for the parent to compare with the AVX2 kernels'.
q, k, v, do = cases[0].arrays(np.float32)
out, lse = flashport.attention(q, k, v, causal=True, return_lse=True, device="cpu")
grads = flashport.attention_backward(do, q, k, v, out, lse, causal=True, device="cpu")
np.savez(sys.argv[2], out=out, lse=lse, dq=grads[0], dk=grads[1], dv=grads[2])
"""


def _as_tuple(case: Case) -> tuple:
    return (
        case.batch,
        case.heads_kv,
        case.group,
        case.seq_q,
        case.seq_k,
        case.d,
        case.dv,
        case.causal,
        case.scale,
        case.ndim,
        case.seed,
    )


def test_portable_kernels_match_the_reference(tmp_path):
    saved = tmp_path / "portable.npz"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))
    code = "import flashport\n" + CHILD
    proc = subprocess.run(
        [sys.executable, "-c", code, repr([_as_tuple(c) for c in CASES]), str(saved)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # The switch took effect: this process (AVX2 kernels where the CPU has
    # them) sums in another order, so the bits differ somewhere.
    portable = np.load(saved)
    q, k, v, do = CASES[0].arrays(np.float32)
    out, lse = flashport.attention(q, k, v, causal=True, return_lse=True, device="cpu")
    grads = flashport.attention_backward(do, q, k, v, out, lse, causal=True, device="cpu")
    here = {"out": out, "lse": lse, "dq": grads[0], "dk": grads[1], "dv": grads[2]}
    if _has_avx2_fma():
        assert any(portable[name].tobytes() != here[name].tobytes() for name in here), (
            "the portable_cpu override did not change the kernels"
        )


def _has_avx2_fma() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx2" in flags and " fma" in flags
