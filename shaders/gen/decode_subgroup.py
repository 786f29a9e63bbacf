# ruff: noqa: E501  (emits long WGSL lines verbatim)
"""Writes shaders/decode/subgroup.wgsl, decoding's subgroup kernel, from
decode_subgroup.wgsl.in (see _template.py).

Its registers are named variables, one statement each, unrolled here (see
forward_tiled.py for why): the rows' q, accumulators and scores, and the
keys' and values' loads, each guarded by the override that switches it
off (RB rows, KPI keys, VPL columns per lane). Run:
python3 shaders/gen/decode_subgroup.py
"""

from _template import fill, write

ROWS = range(8)
# Keys per pass (KPI), in quads of four: one vec4 of scores per row and quad.
KEYS = range(8)
QUADS = range(2)
# vec4 columns per lane (VPL).
COLS = range(4)
# The butterfly's offsets: walkers of up to 32 lanes.
OFFSETS = (1, 2, 4, 8, 16)


def row_guard(r):
    return [] if r == 0 else [f"RB > {1 if r == 1 else 2 if r < 4 else 4}u"]


def key_guard(j):
    return [] if j < 4 else ["KPI > 4u"]


def quad_guard(q):
    return [] if q == 0 else ["KPI > 4u"]


def col_guard(i):
    return [] if i == 0 else [f"VPL > {i}u"]


def guarded(pad, conds, body):
    """`body` (lines) under `if` the conditions, at indent `pad`."""
    if not conds:
        return [pad + line for line in body]
    return (
        [pad + f"if {' && '.join(conds)} {{"] + [pad + "    " + line for line in body] + [pad + "}"]
    )


def block(pad, conds, body):
    """`body` in a scope of its own: under `if` the conditions, else in
    braces."""
    if conds:
        return guarded(pad, conds, body)
    return [pad + "{"] + [pad + "    " + line for line in body] + [pad + "}"]


def col(i):
    return "lane" if i == 0 else ("lane + LPK" if i == 1 else f"lane + {i}u * LPK")


def rows():
    out = []
    pad = "    "
    for r in ROWS:
        out.append(pad + f"var lo{r} = 0u; var hi{r} = 0u; var slope{r} = 0.0; var pos{r} = 0;")
    out.append(pad + "// The keys all the block's rows see.")
    out.append(pad + "var full_lo = 0u; var full_hi = key_end;")
    for r in ROWS:
        body = [
            f"let gr = row0 + {r}u;",
            "if gr < u.rows {",
            "    let i = gr % u.seq_q;",
            "    let seen = visible(len, i);",
            f"    lo{r} = seen.x;",
            f"    hi{r} = min(seen.y, key_end);",
            f"    full_lo = max(full_lo, lo{r});",
            f"    full_hi = min(full_hi, hi{r});",
            f"    pos{r} = i32(len) - i32(u.seq_q) + i32(i);",
            "    if ALIBI {",
            f"        slope{r} = bitcast<f32>(seq_data[u.slopes_off + b * u.heads_q + h * u.group + gr / u.seq_q]);",
            "    }",
            "}",
        ]
        out += block(pad, row_guard(r), body)
    return "\n".join(out)


def q_regs():
    out = []
    pad = "    "
    for r in ROWS:
        out.append(pad + " ".join(f"var q{r}_{i} = vec4(0.0);" for i in COLS))
    for r in ROWS:
        body = []
        for i in COLS:
            body += guarded(
                "",
                col_guard(i),
                [f"q{r}_{i} = load_q(q_first + min(row0 + {r}u, last), {col(i)});"],
            )
        out += guarded(pad, row_guard(r), body)
    return "\n".join(out)


def state():
    pad = "    "
    out = []
    for r in ROWS:
        out.append(pad + f"var m{r} = NEG_BIG; var l{r} = 0.0; var c{r} = 0.0;")
        out.append(pad + " ".join(f"var acc{r}_{i} = vec4(0.0);" for i in COLS))
    return "\n".join(out)


def loads():
    pad = " " * 12
    out = []
    for j in KEYS:
        out.append(
            pad
            + f"var ok{j} = false; "
            + " ".join(f"var k{j}_{i} = vec4(0.0);" for i in COLS)
            + " "
            + " ".join(f"var v{j}_{i} = vec4(0.0);" for i in COLS)
        )
    for j in KEYS:
        inner = [f"ok{j} = true;", "let row = cache_row(b, h, key);"]
        for i in COLS:
            inner += guarded(
                "",
                col_guard(i),
                [f"k{j}_{i} = load_k(row, {col(i)});", f"v{j}_{i} = load_v(row, {col(i)});"],
            )
        body = [f"let key = kb + {j}u;", "if key < key_end && bound(b, key) {"]
        body += ["    " + x for x in inner] + ["}"]
        out += block(pad, key_guard(j), body)
    # docs/design.md#non-finite-inputs: a value row holding a NaN or an
    # infinity is used as 0 and flagged for the walker (vbad), tested only
    # where some lane of the subgroup loaded one.
    values = [f"v{j}_{i}" for j in KEYS for i in COLS]
    out.append(pad + "var vbad0 = vec4(false); var vbad1 = vec4(false);")
    out.append(pad + "let lane_bad = !(" + " && ".join(f"all(finite4({v}))" for v in values) + ");")
    slow = []
    for j in KEYS:
        row = " && ".join(f"all(finite4(v{j}_{i}))" for i in COLS)
        slow.append(f"var bad{j} = select(1u, 0u, {row});")
        for off in OFFSETS:
            slow += guarded(
                "",
                [f"LPK > {off}u"],
                [f"bad{j} = max(bad{j}, subgroupShuffleXor(bad{j}, {off}u));"],
            )
        slow += [f"v{j}_{i} = clean4(v{j}_{i});" for i in COLS]
    slow.append("vbad0 = vec4(bad0, bad1, bad2, bad3) > vec4(0u);")
    slow.append("vbad1 = vec4(bad4, bad5, bad6, bad7) > vec4(0u);")
    out += guarded(pad, ["subgroupAny(lane_bad)"], slow)
    return "\n".join(out)


def dots():
    pad = " " * 12
    out = []
    for r in ROWS:
        out.append(pad + " ".join(f"var s{r}_{q} = vec4(0.0);" for q in QUADS))
    for r in ROWS:
        body = []
        for q in QUADS:
            per_quad = []
            for i in COLS:
                terms = ", ".join(f"dot(q{r}_{i}, k{4 * q + n}_{i})" for n in range(4))
                op = "=" if i == 0 else "+="
                per_quad += guarded("", col_guard(i), [f"s{r}_{q} {op} vec4({terms});"])
            body += guarded("", quad_guard(q), per_quad)
        out += guarded(pad, row_guard(r), body)
    return "\n".join(out)


def reduce():
    pad = " " * 12
    out = []
    for off in OFFSETS:
        body = []
        for r in ROWS:
            per_row = []
            for q in QUADS:
                per_row += guarded(
                    "", quad_guard(q), [f"s{r}_{q} += subgroupShuffleXor(s{r}_{q}, {off}u);"]
                )
            body += guarded("", row_guard(r), per_row)
        out += guarded(pad, [f"LPK > {off}u"], body)
    return "\n".join(out)


def softmax():
    pad = " " * 12
    out = []
    for q in QUADS:
        keys = ", ".join(f"ok{4 * q + n}" for n in range(4))
        out.append(pad + f"let kq{q} = vec4(kb + {4 * q}u) + vec4(0u, 1u, 2u, 3u);")
        out.append(pad + f"let okq{q} = vec4({keys});")
    out.append(pad + "// Every row sees every key of the pass, all of them loaded: no")
    out.append(pad + "// test per (row, key).")
    out.append(
        pad
        + "let full = kb >= full_lo && kb + KPI <= full_hi && all(okq0) && (KPI <= 4u || all(okq1));"
    )
    for full in (True, False):
        rows_out = []
        for r in ROWS:

            def seen(q, r=r, full=full):
                if full:
                    return f"okq{q}"
                return f"okq{q} & (kq{q} >= vec4(lo{r})) & (kq{q} < vec4(hi{r}))"

            def scores(q, r=r, full=full):
                if full:
                    return f"variants4(s{r}_{q}, kq{q}, slope{r}, pos{r})"
                return f"select(vec4(NEG_BIG), variants4(s{r}_{q}, kq{q}, slope{r}, pos{r}), {seen(q)})"

            # Hidden keys are NEG_BIG by now, and weigh 0 by probs4's test
            # (so do the non-finite scores set to NEG_BIG below).
            probs = "probs4(x{q}, m_new)"
            body = [
                f"var x0 = {scores(0)};",
                "var x1 = vec4(NEG_BIG);",
                *guarded("", quad_guard(1), [f"x1 = {scores(1)};"]),
                "// NaN and infinite scores weigh 0; the row's code keeps them.",
                "if !(all(finite4(x0)) && all(finite4(x1))) {",
                f"    c{r} = max(c{r}, max(nonfinite_code4(x0), nonfinite_code4(x1)));",
                "    x0 = select(vec4(NEG_BIG), x0, finite4(x0));",
                "    x1 = select(vec4(NEG_BIG), x1, finite4(x1));",
                "}",
                "// A key the row sees whose value was not finite: o = NaN.",
                "if any(vbad0) || any(vbad1) {",
                f"    var hit = any(vbad0 & ({seen(0)}));",
                *guarded("    ", quad_guard(1), [f"hit = hit || any(vbad1 & ({seen(1)}));"]),
                "    if hit {",
                f"        c{r} = max(c{r}, CODE_VALUE);",
                "    }",
                "}",
                f"let m_new = max(m{r}, max(max4(x0), max4(x1)));",
            ]
            if not full:
                body += [
                    "// 1 while the row has seen nothing (NEG_BIG - NEG_BIG), 0 at its",
                    "// first visible key.",
                ]
            body += [
                f"let rescale = exp(m{r} - m_new);",
                f"let p0 = {probs.format(q=0)};",
                "var p1 = vec4(0.0);",
                *guarded("", quad_guard(1), [f"p1 = {probs.format(q=1)};"]),
                f"l{r} = l{r} * rescale + sum4(p0) + sum4(p1);",
                f"m{r} = m_new;",
            ]
            for i in COLS:
                body += guarded(
                    "",
                    col_guard(i),
                    [
                        f"acc{r}_{i} = acc{r}_{i} * rescale + p0.x * v0_{i} + p0.y * v1_{i} + p0.z * v2_{i} + p0.w * v3_{i};",
                        *guarded(
                            "",
                            quad_guard(1),
                            [
                                f"acc{r}_{i} += p1.x * v4_{i} + p1.y * v5_{i} + p1.z * v6_{i} + p1.w * v7_{i};"
                            ],
                        ),
                    ],
                )
            rows_out += block("    ", row_guard(r), body)
        if full:
            out.append(pad + "if full {")
        else:
            out.append(pad + "} else {")
        out += [pad + line for line in rows_out]
    out.append(pad + "}")
    return "\n".join(out)


def spill():
    pad = "    "
    out = []
    for r in ROWS:
        body = [
            "if lane == 0u {",
            f"    stat[at + {r}u] = m{r};",
            f"    stat[W * RB + at + {r}u] = l{r};",
            f"    stat[CODES + at + {r}u] = c{r};",
            "}",
        ]
        for i in COLS:
            body += guarded("", col_guard(i), [f"part[(at + {r}u) * DP4 + {col(i)}] = acc{r}_{i};"])
        out += guarded(pad, row_guard(r), body)
    return "\n".join(out)


write(
    "subgroup.wgsl",
    fill(
        "decode_subgroup.wgsl.in",
        {
            "ROWS": rows(),
            "Q": q_regs(),
            "STATE": state(),
            "LOADS": loads(),
            "DOTS": dots(),
            "REDUCE": reduce(),
            "SOFTMAX": softmax(),
            "SPILL": spill(),
        },
    ),
    folder="decode",
)
