"""Error of every attention variant against the float64 reference, forward
and backward, on each backend: one fixed problem with GQA, seq_q != seq_k,
d != d_v and sizes that are not tile multiples.

    python benchmarks/variant_errors.py [--device cpu gpu] [--dtype float32]

Cells: max |flashport - reference| / max |reference| per output.
"""

from __future__ import annotations

import argparse

import flashport
import numpy as np
from flashport import reference

SHAPE = {"batch": 2, "heads_q": 4, "heads_kv": 2, "seq_q": 70, "seq_k": 93, "d": 40, "d_v": 24}


def problem(dtype):
    rng = np.random.default_rng(11)
    s = SHAPE
    q = rng.standard_normal((s["batch"], s["heads_q"], s["seq_q"], s["d"])).astype(dtype)
    k = rng.standard_normal((s["batch"], s["heads_kv"], s["seq_k"], s["d"])).astype(dtype)
    v = rng.standard_normal((s["batch"], s["heads_kv"], s["seq_k"], s["d_v"])).astype(dtype)
    do = rng.standard_normal((s["batch"], s["heads_q"], s["seq_q"], s["d_v"])).astype(dtype)
    bool_mask = rng.random((s["seq_q"], s["seq_k"])) < 0.7
    bool_mask[5] = False  # a row that sees nothing
    float_mask = rng.standard_normal((s["batch"], 1, s["seq_q"], s["seq_k"])).astype(dtype)
    float_mask[:, :, :, ::7] = -np.inf
    variants = {
        "window (8, 3)": {"window": (8, 3)},
        "causal + window (16, 0)": {"causal": True, "window": (16, 0)},
        "bool mask (seq_q, seq_k)": {"mask": bool_mask},
        "float mask (b, 1, sq, sk) + dmask": {"mask": float_mask, "return_dmask": True},
        "alibi (batch, heads_q)": {
            "alibi_slopes": rng.uniform(0.01, 0.5, (s["batch"], s["heads_q"])).astype(dtype)
        },
        "softcap 2.5": {"softcap": 2.5},
        "sinks": {"sinks": rng.standard_normal(s["heads_q"]).astype(dtype)},
        "dropout 0.2": {"dropout_p": 0.2, "seed": 1234},
        "all combined + causal": {
            "causal": True,
            "window": (40, -1),
            "mask": float_mask,
            "return_dmask": True,
            "alibi_slopes": rng.uniform(0.01, 0.5, s["heads_q"]).astype(dtype),
            "softcap": 4.0,
            "sinks": rng.standard_normal(s["heads_q"]).astype(dtype),
            "dropout_p": 0.1,
            "seed": 99,
        },
    }
    return (q, k, v, do), variants


def rel(got, want):
    want = np.asarray(want, np.float64)
    scale = np.abs(want[np.isfinite(want)]).max() if np.isfinite(want).any() else 1.0
    got = np.asarray(got, np.float64)
    # A row that sees no key has lse -inf in both: no error, not inf - inf.
    both_inf = np.isinf(want) & (got == want)
    with np.errstate(invalid="ignore"):
        diff = np.abs(got - want)
    return float(np.where(both_inf, 0.0, diff).max() / scale)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", nargs="+", default=["cpu", "gpu"])
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    (q, k, v, do), variants = problem(np.dtype(args.dtype))
    names = ["o", "lse", "dq", "dk", "dv", "dsinks", "dmask"]
    print(f"shape {SHAPE}, {args.dtype}; max |error| / max |reference|")
    print(f"{'variant':<36}{'device':<7}" + "".join(f"{n:>10}" for n in names))
    for name, kw in variants.items():
        kw = dict(kw)
        return_dmask = kw.pop("return_dmask", False)
        want_o, want_lse = reference.attention(q, k, v, return_lse=True, **kw)
        want_g = reference.attention_backward(do, q, k, v, return_dmask=return_dmask, **kw)
        for device in args.device:
            o, lse = flashport.attention(q, k, v, return_lse=True, device=device, **kw)
            grads = flashport.attention_backward(
                do, q, k, v, o, lse, device=device, return_dmask=return_dmask, **kw
            )
            errs = {"o": rel(o, want_o), "lse": rel(lse, want_lse)}
            grad_names = ["dq", "dk", "dv"] + (["dsinks"] if "sinks" in kw else [])
            grad_names += ["dmask"] if return_dmask else []
            for gname, g, w in zip(grad_names, grads, want_g, strict=True):
                errs[gname] = rel(g, w)
            cells = "".join(f"{errs[n]:10.1e}" if n in errs else f"{'-':>10}" for n in names)
            print(f"{name:<36}{device:<7}{cells}", flush=True)


if __name__ == "__main__":
    main()
