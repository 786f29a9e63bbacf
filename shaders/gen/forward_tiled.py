# ruff: noqa: E501  (emits long WGSL lines verbatim)
"""Writes shaders/tiled/forward.wgsl, the register-tiled float32 forward,
from forward_tiled.wgsl.in (see _template.py).

The kernel's register tiles are separate named variables (s00..s33,
acc00..acc33), hand-unrolled: through naga and NVIDIA's Vulkan compiler a
private array indexed in a loop was spilled to memory and ran 5x slower
(see docs/gpu.md#named-register-variables). WGSL has no macros, so the unrolled statements are
generated here once and the output is committed; sizes stay `override`
constants. Run: python3 shaders/gen/forward_tiled.py
"""

from _template import PF, R, fill, write


def scores():
    out = []
    for i in R:
        out.append(f"            let q{i} = qs[(rg + {i}u * RG) * QS4 + c];")
    for j in R:
        out.append(f"            let k{j} = kvs[(cg + {8 * j}u) * QS4 + c];")
    for i in R:
        for j in R:
            out.append(f"            s{i}{j} = dot_acc(s{i}{j}, q{i}, k{j});")
    return "\n".join(out)


def pv():
    out = []
    for i in R:
        out.append(f"            let p{i} = ps[(rg + {i}u * RG) * PS4 + c];")
    for comp, key in zip("xyzw", (0, 8, 16, 24), strict=True):
        out.append(f"            // key c + {key}")
        out.append("            {")
        out.append(f"                let vrow = V_OFF + (c + {key}u) * VS4 + cg;")
        for n in R:
            guard = "" if n == 0 else f"if NV > {n}u "
            if n == 0:
                out.append("                let v0 = kvs[vrow];")
                out.append(
                    "                "
                    + " ".join(f"acc{i}0 = fma(vec4(p{i}.{comp}), v0, acc{i}0);" for i in R)
                )
            else:
                out.append(f"                {guard}{{")
                out.append(f"                    let v{n} = kvs[vrow + {8 * n}u];")
                out.append(
                    "                    "
                    + " ".join(f"acc{i}{n} = fma(vec4(p{i}.{comp}), v{n}, acc{i}{n});" for i in R)
                )
                out.append("                }")
        out.append("            }")
    return "\n".join(out)


def decl(kind):
    if kind == "s":
        return "\n".join("        " + " ".join(f"var s{i}{j} = 0.0;" for j in R) for i in R)
    return "\n".join("    " + " ".join(f"var acc{i}{n} = vec4(0.0);" for n in R) for i in R)


def rescale():
    return "\n".join(
        "        " + " ".join(f"acc{i}{n} *= rescale.{'xyzw'[i]};" for n in R) for i in R
    )


def store():
    out = []
    for i in R:
        c = "xyzw"[i]
        out.append(f"    if rg + {i}u * RG < rows {{")
        out.append(f"        let at = (head * p.seq_q + row0 + rg + {i}u * RG) * DV4 + cg;")
        out.append(f"        let sum = row_sum.{c};")
        out.append("        if SINKS || DROPOUT {")
        out.append(f"            let fin = finish_row(bh, row_max.{c}, sum);")
        for n in R:
            guard = f"cg + {8 * n}u < DV4"
            out.append(
                f"            if {guard} {{ out[at + {8 * n}u] = select(vec4(0.0), acc{i}{n} / fin.x, fin.x > 0.0); }}"
            )
        out.append(
            f"            if cg == 0u {{ lse[head * p.seq_q + row0 + rg + {i}u * RG] = fin.y; }}"
        )
        out.append("        } else {")
        for n in R:
            guard = f"cg + {8 * n}u < DV4"
            out.append(
                f"            if {guard} {{ out[at + {8 * n}u] = select(vec4(0.0), acc{i}{n} / sum, sum > 0.0); }}"
            )
        out.append(
            f"            if cg == 0u {{ lse[head * p.seq_q + row0 + rg + {i}u * RG] = select(neg_inf, row_max.{c} + log(sum), sum > 0.0); }}"
        )
        out.append("        }")
        out.append("    }")
    return "\n".join(out)


def variant_scores():
    """The variants' scores, and the keys they hide."""
    out = ["        if MODIFIES || WINDOW {"]
    for i in R:
        c = "xyzw"[i]
        out.append("            {")
        out.append(f"                let r = row0 + rv.{c};")
        out.append(
            f"                let sc = score4(vec4(s{i}0, s{i}1, s{i}2, s{i}3), bh, vec4(r), kk);"
        )
        out.append(
            f"                vis{i} = vis{i} & (sc != vec4(NEG_BIG)) & (kk >= vec4(visible_start(r)));"
        )
        out.append(f"                u{i} = sc;")
        out.append("            }")
    out.append("        }")
    return "\n".join(out)


def prefetch_load(t0, n, pad):
    """Issues the loads of the K and V tile at key `t0` (n rows valid) into
    the named registers pk*/pv*; PF_N (an override) of them are live."""
    out = []
    for u in PF:
        out.append(f"{pad}if PF_N > {u}u {{")
        out.append(f"{pad}    let e = lid + {u}u * RG * CG;")
        out.append(f"{pad}    pk{u} = vec4(0.0);")
        out.append(
            f"{pad}    if e < BK * D4 && e / D4 < {n} {{ pk{u} = widen(k[(kv_row0 + {t0}) * D4 + e]); }}"
        )
        out.append(f"{pad}    pv{u} = vec4(0.0);")
        out.append(f"{pad}    let j = e / (8u * NV);")
        out.append(f"{pad}    let c = e % (8u * NV);")
        out.append(
            f"{pad}    if e < BK * 8u * NV && j < {n} && c < DV4 {{ pv{u} = widen(v[(kv_row0 + {t0} + j) * DV4 + c]); }}"
        )
        out.append(f"{pad}}}")
    return "\n".join(out)


def prefetch_store(pad):
    out = []
    for u in PF:
        out.append(f"{pad}if PF_N > {u}u {{")
        out.append(f"{pad}    let e = lid + {u}u * RG * CG;")
        out.append(f"{pad}    if e < BK * D4 {{ kvs[(e / D4) * QS4 + e % D4] = pk{u}; }}")
        out.append(
            f"{pad}    if e < BK * 8u * NV {{ kvs[V_OFF + (e / (8u * NV)) * VS4 + e % (8u * NV)] = pv{u}; }}"
        )
        out.append(f"{pad}}}")
    return "\n".join(out)


write(
    "forward.wgsl",
    fill(
        "forward_tiled.wgsl.in",
        {
            "SCORES": scores(),
            "PV": pv(),
            "DECL_S": decl("s"),
            "DECL_ACC": decl("acc"),
            "RESCALE": rescale(),
            "STORE": store(),
            "VARIANT_SCORES": variant_scores(),
            "PF_DECL": "\n".join(
                "    " + f"var pk{u} = vec4(0.0); var pv{u} = vec4(0.0);" for u in PF
            ),
            "PF_FIRST": prefetch_load("first", "min(BK, key_end - first)", "        "),
            "PF_NEXT": prefetch_load("next", "min(BK, key_end - next)", "                "),
            "PF_STORE": prefetch_store("            "),
        },
    ),
)
