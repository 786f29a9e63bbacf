# ruff: noqa: E501  (emits long WGSL lines verbatim)
"""Writes shaders/tiled/backward_dq.wgsl and backward_dkdv.wgsl, the
register-tiled float32 backward, from backward_dq_tiled.wgsl.in and
backward_dkdv_tiled.wgsl.in (see _template.py), built like the forward
(see forward_tiled.py for why the tiles are named variables, generated
here).

Both kernels: a workgroup owns BR = 4*RG rows (query rows for dQ, key rows
for dK/dV) and streams tiles of 32 rows of the other side. Invocation
(rg, cg) owns rows rg + i*RG and streamed rows cg + 8*j (i, j < 4) of the
two 4x4 score tiles (S = A B0^T, dP = A1 B1^T), and columns 4*(cg + 8*n)
of its accumulators. No cross-invocation reduction is needed at all, so
there is no subgroup variant. Run: python3 shaders/gen/backward_tiled.py
"""

from _template import PF, R, fill, indent, write


def dots(out, a, sa, boff, sb, n4):
    """out{i}{j} += a[row i] . bs[boff + col j] over n4 vec4s."""
    lines = [f"        for (var c = 0u; c < {n4}; c++) {{"]
    for i in R:
        lines.append(f"            let a{i} = {a}[(rg + {i}u * RG) * {sa} + c];")
    for j in R:
        lines.append(f"            let b{j} = bs[{boff}(cg + {8 * j}u) * {sb} + c];")
    for i in R:
        lines.append(
            "            " + " ".join(f"{out}{i}{j} = dot_acc({out}{i}{j}, a{i}, b{j});" for j in R)
        )
    lines.append("        }")
    return "\n".join(lines)


def accumulate(specs):
    """specs: list of (acc, weights array, source name, source offset in bs,
    stride, n_guard). acc{i}{n} += sum over the 32 streamed rows r of
    w[row i][r] * source[r][cg + 8n]."""
    lines = ["        for (var c = 0u; c < 8u; c++) {"]
    for _acc, w, _src, _off, _stride, _ng in specs:
        for i in R:
            lines.append(f"            let {w}_{i} = {w}[(rg + {i}u * RG) * 9u + c];")
    for comp, off in zip("xyzw", (0, 8, 16, 24), strict=True):
        lines.append("            {")
        for acc, w, src, boff, stride, ng in specs:
            lines.append(f"                let r_{src} = {boff}(c + {off}u) * {stride} + cg;")
            for n in R:
                body = f"let x = bs[r_{src} + {8 * n}u]; " + " ".join(
                    f"{acc}{i}{n} = fma(vec4({w}_{i}.{comp}), x, {acc}{i}{n});" for i in R
                )
                if n == 0:
                    lines.append(f"                {{ {body} }}")
                else:
                    lines.append(f"                if {ng} > {n}u {{ {body} }}")
        lines.append("            }")
    lines.append("        }")
    return "\n".join(lines)


def decl_tile(name):
    return "\n".join("        " + " ".join(f"var {name}{i}{j} = 0.0;" for j in R) for i in R)


def decl_acc(name):
    return "\n".join("    " + " ".join(f"var {name}{i}{n} = vec4(0.0);" for n in R) for i in R)


def row_vec(name, i):
    return f"vec4({name}{i}0, {name}{i}1, {name}{i}2, {name}{i}3)"


def store(acc, dst, width4, base, valid, scale):
    lines = []
    for i in R:
        lines.append(f"    if rg + {i}u * RG < {valid} {{")
        lines.append(f"        let at = ({base} + rg + {i}u * RG) * {width4} + cg;")
        for n in R:
            lines.append(
                f"        if cg + {8 * n}u < {width4} {{ {dst}[at + {8 * n}u] = {acc}{i}{n}{scale}; }}"
            )
        lines.append("    }")
    return "\n".join(lines)


def ds_dq():
    lines = []
    for i in R:
        c = "xyzw"[i]
        lines.append(f"        var vis{i} = (kk < vec4(vend.{c})) & vec4(ok.{c});")
        lines.append(f"        var e{i} = {row_vec('s', i)};")
        lines.append(f"        var u{i} = vec4(0.0);")
        lines.append("        if MODIFIES || WINDOW {")
        lines.append(f"            u{i} = {row_vec('s', i)};")
        lines.append(f"            let sc = score4(u{i}, bh, vec4(row0 + rv.{c}), kk);")
        lines.append(
            f"            vis{i} = vis{i} & (sc != vec4(NEG_BIG)) & (kk >= vec4(vstart.{c}));"
        )
        lines.append(f"            e{i} = sc;")
        lines.append("        }")
        lines.append(
            f"        let p{i} = select(vec4(0.0), exp2((e{i} - lse.{c}) * LOG2E), vis{i});"
        )
        lines.append(f"        var dp{i} = {row_vec('t', i)};")
        lines.append("        if DROPOUT {")
        lines.append(f"            dp{i} *= dropout4(bh, vec4(row0 + rv.{c}), kk);")
        lines.append("        }")
        lines.append(f"        let ds{i} = p{i} * (dp{i} - delta.{c});")
        lines.append(f"        if DMASK && rv.{c} < rows {{")
        lines.append(f"            let at = (head * p.seq_q + row0 + rv.{c}) * p.seq_k + k0;")
        for comp in "xyzw":
            lines.append(
                f"            if keys.{comp} < nk {{ dmask[at + keys.{comp}] = ds{i}.{comp}; }}"
            )
        lines.append("        }")
        lines.append(f"        ws[rv.{c} * 9u + cg] = softcap_grad4(ds{i}, u{i});")
    return "\n".join(lines)


def ds_dkdv():
    lines = []
    for i in R:
        c = "xyzw"[i]
        lines.append(f"            var vis{i} = (vec4(krow.{c}) < vend) & ok;")
        lines.append(f"            var e{i} = {row_vec('s', i)};")
        lines.append(f"            var u{i} = vec4(0.0);")
        lines.append("            if MODIFIES || WINDOW {")
        lines.append(f"                u{i} = {row_vec('s', i)};")
        lines.append(f"                let sc = score4(u{i}, bh, vec4(r0) + cols, vec4(krow.{c}));")
        lines.append(
            f"                vis{i} = vis{i} & (sc != vec4(NEG_BIG)) & (vec4(krow.{c}) >= vstart);"
        )
        lines.append(f"                e{i} = sc;")
        lines.append("            }")
        lines.append(
            f"            let p{i} = select(vec4(0.0), exp2((e{i} - lse) * LOG2E), vis{i});"
        )
        # The weights of dV (P, times the dropout mask) and of dK (dS).
        lines.append(f"            var pz{i} = p{i};")
        lines.append(f"            var dsv{i} = vec4(0.0);")
        lines.append("            if DROPOUT {")
        lines.append(f"                let z = dropout4(bh, vec4(r0) + cols, vec4(krow.{c}));")
        lines.append(f"                pz{i} = p{i} * z;")
        lines.append(
            f"                dsv{i} = softcap_grad4(p{i} * ({row_vec('t', i)} * z - delta), u{i});"
        )
        lines.append("            } else {")
        lines.append(
            f"                dsv{i} = softcap_grad4(p{i} * ({row_vec('t', i)} - delta), u{i});"
        )
        lines.append("            }")
        # Shared tiles: one weight array, dS now and P after the dK update.
        lines.append("            if SHARED {")
        lines.append(f"                ws[(rg + {i}u * RG) * 9u + cg] = dsv{i};")
        lines.append("            } else {")
        lines.append(f"                ws[(rg + {i}u * RG) * 9u + cg] = pz{i};")
        lines.append(f"                ws2[(rg + {i}u * RG) * 9u + cg] = dsv{i};")
        lines.append("            }")
    return "\n".join(lines)


def stats(idx, bound, base, row, pad):
    """Unrolled: a vector component indexed in a loop is what spilled."""
    out = []
    for c in "xyzw":
        out.append(f"{pad}if {idx}.{c} < {bound} {{")
        out.append(f"{pad}    let st = stats[{base} + {idx}.{c}];")
        out.append(f"{pad}    let lse_i = st.x;")
        out.append(f"{pad}    ok.{c} = is_finite(lse_i);")
        out.append(f"{pad}    lse.{c} = select(0.0, lse_i, ok.{c});")
        out.append(f"{pad}    delta.{c} = st.y;")
        out.append(f"{pad}    vend.{c} = visible_end({row} + {idx}.{c});")
        out.append(f"{pad}    vstart.{c} = visible_start({row} + {idx}.{c});")
        out.append(f"{pad}}}")
    return "\n".join(out)


def pf_decl(pad="    "):
    return "\n".join(f"{pad}var pa{u} = vec4(0.0); var pb{u} = vec4(0.0);" for u in PF)


def pf_load(specs, n, pad):
    """specs: two (reg, global, width, col_bound, row0) for the two streamed
    tiles; row0 is the global row of the tile's first row."""
    out = []
    for u in PF:
        out.append(f"{pad}if PF_N > {u}u {{")
        out.append(f"{pad}    let e = lid + {u}u * RG * CG;")
        for reg, glob, width, bound, gw, row0 in specs:
            out.append(f"{pad}    {{")
            out.append(f"{pad}        let j = e / {width};")
            out.append(f"{pad}        let c = e % {width};")
            out.append(f"{pad}        {reg}{u} = vec4(0.0);")
            out.append(
                f"{pad}        if e < BC * {width} && j < {n} && c < {bound} {{ {reg}{u} = widen({glob}[({row0} + j) * {gw} + c]); }}"
            )
            out.append(f"{pad}    }}")
        out.append(f"{pad}}}")
    return "\n".join(out)


def pf_store(reg, boff, width, stride, pad, factor=""):
    """Stores the prefetched registers {reg}0.. of one streamed tile into
    bs from `boff`, multiplied by `factor` ("" for nothing): here, not as
    they are loaded, where a use of the load would wait for it and undo
    the prefetch."""
    out = []
    for u in PF:
        out.append(f"{pad}if PF_N > {u}u {{")
        out.append(f"{pad}    let e = lid + {u}u * RG * CG;")
        out.append(
            f"{pad}    if e < BC * {width} {{ bs[{boff}(e / {width}) * {stride} + e % {width}] = {reg}{u}{factor}; }}"
        )
        out.append(f"{pad}}}")
    return "\n".join(out)


DQ_PF = [
    ("pa", "k", "(8u * ND)", "D4", "D4", "kv_row0 + {T0}"),
    ("pb", "v", "DV4", "DV4", "DV4", "kv_row0 + {T0}"),
]
KV_PF = [
    ("pa", "q", "(8u * ND)", "D4", "D4", "head * p.seq_q + r0"),
    ("pb", "d_out", "(8u * NV)", "DV4", "DV4", "head * p.seq_q + r0"),
]

write(
    "backward_dq.wgsl",
    fill(
        "backward_dq_tiled.wgsl.in",
        {
            "DECL_ACC": decl_acc("a"),
            "STATS_DQ": stats("rv", "rows", "head * p.seq_q + row0", "row0", "    "),
            "PF_DECL": pf_decl(),
            "PF_FIRST": pf_load(DQ_PF, "min(BC, key_end - first)", "        ").replace(
                "{T0}", "first"
            ),
            "PF_NEXT": pf_load(DQ_PF, "min(BC, key_end - next)", "            ").replace(
                "{T0}", "next"
            ),
            "PF_STORE_B0": pf_store("pa", "", "(8u * ND)", "SB0", "                "),
            "PF_STORE_B1": pf_store("pb", "B1_OFF + ", "DV4", "SB1", "            "),
            "DECL_S": decl_tile("s"),
            "DECL_T": decl_tile("t"),
            "DOT_S": dots("s", "qs", "SA0", "", "SB0", "D4"),
            "DOT_T": dots("t", "dos", "SA1", "B1_OFF + ", "SB1", "DV4"),
            "DS": ds_dq(),
            "ACC": accumulate([("a", "ws", "ks", "", "SB0", "ND")]),
            "STORE": store("a", "dq", "D4", "head * p.seq_q + row0", "rows", " * p.scale"),
        },
    ),
)
write(
    "backward_dkdv.wgsl",
    fill(
        "backward_dkdv_tiled.wgsl.in",
        {
            "DECL_ACC": decl_acc("gv") + "\n" + decl_acc("gk"),
            "STATS_DKDV": stats("cols", "nr", "head * p.seq_q + r0", "r0", "            "),
            "PF_DECL": pf_decl(),
            "PF_FIRST": pf_load(KV_PF, "min(BC, row_end - r0)", "        "),
            "PF_NEXT": pf_load(KV_PF, "min(BC, row_end - r0)", "                "),
            "PF_NEXT_SHARED": pf_load(KV_PF, "min(BC, row_end - r0)", "                    "),
            "PF_STORE_B0": pf_store(
                "pa", "", "(8u * ND)", "SB0", "                    ", " * p.scale"
            ),
            "PF_STORE_B1": pf_store("pb", "B1_OFF + ", "(8u * NV)", "SB1", "                "),
            "DECL_S": indent(decl_tile("s"), 4),
            "DECL_T": indent(decl_tile("t"), 4),
            "DOT_S": indent(dots("s", "ks", "SA0", "", "SB0", "D4"), 4),
            "DOT_T": indent(dots("t", "vs", "SA1", "B1_OFF + ", "SB1", "DV4"), 4),
            "DS": ds_dkdv(),
            "ACC": indent(
                accumulate(
                    [
                        ("gv", "ws", "dos", "B1_OFF + ", "SB1", "NV"),
                        ("gk", "ws2", "qs", "", "SB0", "ND"),
                    ]
                ),
                8,
            ),
            "ACC_K": indent(accumulate([("gk", "ws", "qs", "", "SB0", "ND")]), 8),
            "STORE_P": "\n".join(
                f"                ws[(rg + {i}u * RG) * 9u + cg] = pz{i};" for i in R
            ),
            "ACC_V": indent(accumulate([("gv", "ws", "dos", "B1_OFF + ", "SB1", "NV")]), 8),
            "STORE": store("gv", "dv", "DV4", "kvh * p.seq_k + k0", "nk", "")
            + "\n"
            + store("gk", "dk", "D4", "kvh * p.seq_k + k0", "nk", ""),
        },
    ),
)
