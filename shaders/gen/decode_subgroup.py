# ruff: noqa: E501  (emits long WGSL lines verbatim)
"""Writes shaders/decode/subgroup.wgsl, decoding's subgroup kernel, from
decode_subgroup.wgsl.in (see _template.py).

Its registers are named variables, one statement each, unrolled here (see
forward_tiled.py for why): the rows' q and accumulators, the keys' and
values' loads, and the pairs (row, key) of a pass, each guarded by the
override that switches it off (RB rows, KPI keys, NO quads per lane).
The pair layout of a pass depends on RB and KPI, so each (RB, KPI) gets
a block of its own; the driver keeps the one the overrides pick.
Run: python3 shaders/gen/decode_subgroup.py
"""

from _template import fill, write

ROWS = (1, 2, 4, 8)
KEYS = (4, 8)
# Quads (vec4 registers) per lane and row: four at most.
UNITS = range(4)
# The butterfly's offsets: walkers of up to 32 lanes.
OFFSETS = (1, 2, 4, 8, 16)
# Walkers have 4 to 32 lanes, and at least RB.
LANES = (4, 8, 16, 32)


def row_guard(r):
    return [] if r == 0 else [f"RB > {1 if r == 1 else 2 if r < 4 else 4}u"]


def key_guard(j):
    return [] if j < 4 else ["KPI > 4u"]


def unit_guard(n):
    return [] if n == 0 else [f"NO > {n}u"]


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


def unit_of(n):
    """The index (vec4 column of the row) of the lane's quad n."""
    return "lane" if n == 0 else ("lane + LPK" if n == 1 else f"lane + {n}u * LPK")


def q_regs():
    out = []
    pad = "    "
    for r in range(8):
        out.append(pad + " ".join(f"var q{r}_{n} = vec4(0.0);" for n in UNITS))
    for r in range(8):
        lines = [f"let qr = q_first + min(row0 + {r}u, last);"]
        for n in UNITS:
            lines += guarded("", unit_guard(n), [f"q{r}_{n} = load_q(qr, {unit_of(n)});"])
        out += block(pad, row_guard(r), lines)
    return "\n".join(out)


def acc_regs():
    pad = "    "
    return "\n".join(
        pad + " ".join(f"var acc{r}_{n} = vec4(0.0);" for n in UNITS) for r in range(8)
    )


def raw_regs():
    """The loads of a pass as they arrive (Raw4: two words a quad of
    halves, four floats otherwise), and which keys were loaded (bit j of
    ok_n)."""
    pad = "    "
    out = [pad + "var ok_n = 0u;"]
    for j in range(8):
        out.append(
            pad
            + " ".join(f"var kr{j}_{n} = raw_zero(); var vr{j}_{n} = raw_zero();" for n in UNITS)
        )
    return "\n".join(out)


def loads(j, row):
    """Key j's quads of its key and value rows, cache row `row`."""
    out = []
    for n in UNITS:
        out += guarded(
            "",
            unit_guard(n),
            [
                f"kr{j}_{n} = load_k_raw({row}, {unit_of(n)});",
                f"vr{j}_{n} = load_v_raw({row}, {unit_of(n)});",
            ],
        )
    return out


def fetch(pad, kb, entry=None):
    """The loads of the pass whose walker starts at key `kb`: zeros past
    key_end and for blocks not bound, each key tested only where the pass
    is not whole. `entry`: the table entry of the
    pass's block, read a pass before (run_entry), else read here."""
    out = [pad + "ok_n = 0u;", pad + "{"]
    pad += "    "
    if entry is None:
        out.append(pad + f"let run = run_row(b, h, {kb}, key_end, KPI);")
    else:
        out.append(pad + f"let run = entry_row({entry}, h, {kb});")
    # A pass whose KPI keys all lie below key_end in one block bound here
    # loads them with no test of a key or quad: with a test in front of
    # each, the float16 kernel took 1.6x the time on an H200 (docs/gpu.md,
    # "The subgroup decode kernel"); the others test each key.
    whole = []
    for j in range(8):
        whole += guarded("", key_guard(j), loads(j, f"run + {j}u"))
    out.append(pad + f"if !SKIPS && run != NONE && {kb} + KPI <= key_end {{")
    out.append(pad + "    ok_n = (1u << KPI) - 1u;")
    out += [pad + "    " + x for x in whole]
    out.append(pad + "} else {")
    for j in range(8):
        inner = [
            f"ok_n |= {1 << j}u;",
            f"var row = run + {j}u;",
            "if run == NONE {",
            "    row = cache_row(b, h, key);",
            "}",
        ]
        zero = []
        for n in UNITS:
            zero += guarded(
                "", unit_guard(n), [f"kr{j}_{n} = raw_zero();", f"vr{j}_{n} = raw_zero();"]
            )
        inner += loads(j, "row")
        body = [f"let key = {kb} + {j}u;", *zero, "if key < key_end && bound(b, key) {"]
        body += ["    " + x for x in inner] + ["}"]
        out += block(pad + "    ", key_guard(j), body)
    out.append(pad + "}")
    out.append(pad[:-4] + "}")
    return "\n".join(out)


def take():
    """This pass's loads, out of the registers the next pass loads into."""
    pad = " " * 8
    out = [pad + "let ok = ok_n;"]
    for j in range(8):
        out.append(
            pad + " ".join(f"let kc{j}_{n} = kr{j}_{n}; var vc{j}_{n} = vr{j}_{n};" for n in UNITS)
        )
    return "\n".join(out)


def values():
    """docs/design.md#non-finite-inputs: a value row holding a NaN or an
    infinity is used as 0 and flagged for the walker (bit j of vbad),
    tested only where some lane of the subgroup loaded one."""
    pad = " " * 12
    raws = [f"vc{j}_{n}" for j in range(8) for n in UNITS]
    out = [pad + "var vbad = 0u;"]
    out.append(pad + "let flags = " + " | ".join(f"raw_flags({v})" for v in raws) + ";")
    out.append(pad + "let lane_bad = (flags & NONFINITE_FLAGS) != 0u;")
    slow = []
    for j in range(8):
        row = " && ".join(f"raw_finite(vc{j}_{n})" for n in UNITS)
        slow.append(f"if !({row}) {{")
        slow.append(f"    vbad |= {1 << j}u;")
        slow.append("}")
        slow += [f"vc{j}_{n} = raw_clean(vc{j}_{n});" for n in UNITS]
    for off in OFFSETS:
        slow += guarded("", [f"LPK > {off}u"], [f"vbad |= subgroupShuffleXor(vbad, {off}u);"])
    out += guarded(pad, ["subgroupAny(lane_bad)"], slow)
    return "\n".join(out)


def pass_block(rb, kpi):
    """Steps 2 to 5 of a pass for RB = rb rows and KPI = kpi keys."""
    pairs = rb * kpi
    out = ["// 2. Partial dot products of pair i = r * KPI + j, key by key."]
    out.append(" ".join(f"var x{i} = 0.0;" for i in range(pairs)))
    for j in range(kpi):
        for n in UNITS:
            unit = [f"let k = widen4(kc{j}_{n});"]
            unit += [f"x{r * kpi + j} += dot(q{r}_{n}, k);" for r in range(rb)]
            out += block("", unit_guard(n), unit)
    out.append("// 3. The reduce-scatter over the walker's lanes.")
    for s, off in enumerate(OFFSETS):
        count = pairs >> s
        if count >= 2:
            half = count // 2
            body = [f"let up = (lane & {off}u) != 0u;"]
            for i in range(half):
                body.append(
                    f"x{i} = select(x{i}, x{i + half}, up) + subgroupShuffleXor(select(x{i + half}, x{i}, up), {off}u);"
                )
        else:
            body = [f"x0 += subgroupShuffleXor(x0, {off}u);"]
        out += guarded("", [f"LPK > {off}u"], body)
    # The lane's pairs: at most KPI (LPK >= RB).
    most = min(kpi, pairs // 4)
    out.append("// 4. The scores of the lane's pairs and the row's maximum.")
    out.append("var mt = NEG_BIG;")
    for e in range(most):
        body = [
            f"let j = my_j + {e}u;",
            "let key = kb + j;",
            "if ((ok >> j) & 1u) != 0u && key >= lo && key < hi {",
            f"    let y = variant_score(x{e}, u.softcap, slope, abs(pos - i32(key)));",
            "    if finite_f32(y) {",
            f"        sc{e} = y;",
            "    } else {",
            "        code = max(code, nonfinite_code(y));",
            "    }",
            "    // A key the row sees whose value was not finite: o = NaN.",
            "    if ((vbad >> j) & 1u) != 0u {",
            "        code = max(code, CODE_VALUE);",
            "    }",
            "}",
            f"mt = max(mt, sc{e});",
        ]
        out.append(f"var sc{e} = NEG_BIG;")
        out += guarded("", [] if e == 0 else [f"EPL > {e}u"], body)
    for off in OFFSETS:
        if off >= rb:
            out += guarded(
                "", [f"SLOTS > {off}u"], [f"mt = max(mt, subgroupShuffleXor(mt, {off}u));"]
            )
    out += [
        "let m_new = max(m, mt);",
        "// 1 while the row has seen nothing (NEG_BIG - NEG_BIG), 0 at its",
        "// first visible key.",
        "let rescale = exp(m - m_new);",
        "// Hidden keys get 0 by this test, never by exp(NEG_BIG - m).",
    ]
    total = []
    for e in range(most):
        out.append(f"var p{e} = 0.0;")
        out += guarded(
            "",
            [] if e == 0 else [f"EPL > {e}u"],
            [f"p{e} = select(0.0, exp(sc{e} - m_new), sc{e} != NEG_BIG);"],
        )
        total.append(f"p{e}")
    out += [f"l = l * rescale + {' + '.join(total)};", "m = m_new;"]
    out.append("// 5. Each pair's probability and each row's rescale, from the")
    out.append("// lanes that hold them; acc = acc * rescale + p * v.")
    out.append(" ".join(f"var pp{i} = 0.0;" for i in range(pairs)))
    out.append(" ".join(f"var rs{r} = 0.0;" for r in range(rb)))
    for epl in sorted({max(1, pairs // min(pairs, lanes)) for lanes in LANES if lanes >= rb}):
        body = [
            f"pp{i} = subgroupShuffle(p{i % epl}, base + slot_lane({i // epl}u));"
            for i in range(pairs)
        ]
        body += [
            f"rs{r} = subgroupShuffle(rescale, base + slot_lane({r * kpi // epl}u));"
            for r in range(rb)
        ]
        out += guarded("", [f"EPL == {epl}u"], body)
    for j in range(kpi):
        for n in UNITS:
            unit = [f"let v = widen4(vc{j}_{n});"]
            for r in range(rb):
                p = f"pp{r * kpi + j}"
                if j == 0:
                    unit.append(f"acc{r}_{n} = acc{r}_{n} * rs{r} + {p} * v;")
                else:
                    unit.append(f"acc{r}_{n} += {p} * v;")
            out += block("", unit_guard(n), unit)
    return out


def passes():
    pad = " " * 12
    out = []
    for rb in ROWS:
        for kpi in KEYS:
            out += guarded(pad, [f"RB == {rb}u", f"KPI == {kpi}u"], pass_block(rb, kpi))
    return "\n".join(out)


def gather():
    pad = "    "
    out = []
    for off in OFFSETS:
        out += guarded(
            pad,
            [f"RB <= {off}u", f"SLOTS > {off}u"],
            [
                f"l += subgroupShuffleXor(l, {off}u);",
                f"code = max(code, subgroupShuffleXor(code, {off}u));",
            ],
        )
    return "\n".join(out)


def spill():
    pad = "    "
    out = []
    for r in range(8):
        stores = []
        for n in UNITS:
            stores += guarded(
                "", unit_guard(n), [f"part[(at + {r}u) * DP4 + {unit_of(n)}] = acc{r}_{n};"]
            )
        out += guarded(pad, row_guard(r), stores)
    return "\n".join(out)


write(
    "subgroup.wgsl",
    fill(
        "decode_subgroup.wgsl.in",
        {
            "Q": q_regs(),
            "ACC": acc_regs(),
            "RAW": raw_regs(),
            "FETCH_FIRST": fetch(" " * 8, "key_start + walker * KPI"),
            "FETCH_NOW": fetch(" " * 12, "kb"),
            "TAKE": take(),
            "FETCH_NEXT": fetch(" " * 12, "kb + STEP", entry="entry"),
            "VALUES": values(),
            "PASS": passes(),
            "GATHER": gather(),
            "SPILL": spill(),
        },
    ),
    folder="decode",
)
