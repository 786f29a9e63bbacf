#!/usr/bin/env python3
"""Counts the imports of the Rust core that run back up, and its import
circles, from the `use` lines and paths alone (no compiler, no tool).

    python3 scripts/layers.py               # rust/flashport-core/src
    python3 scripts/layers.py --arrows      # and every arrow, floor to floor
    python3 scripts/layers.py --files gpu   # inside gpu/, a file a room

A *room* is a file directly under `src/`, or one of its folders taken whole
(`gpu/`, `cpu/`, ..., with `x.rs` beside a folder `x/` in `x/`); `--files
FOLDER` looks inside one folder, a file a room. An *arrow* A -> B: a file
of A names a path into B, in a `use` line or in the code (`crate::x`,
`super::x`, or a module in scope, such as `cpu::forward` in `lib.rs`). A
path points at the file of its longest module prefix, not where the
compiler finds the name: `crate::Error` is `lib.rs` even though `lib.rs`
only re-exports it, as a reader takes it. A `mod` line is no arrow, and
neither are comments, strings, test files (`tests.rs`, `*_tests.rs`) and
`#[cfg(test)]` items: tests may import what they check against.

The *floors*: a room stands one floor above the highest room it imports;
floor 1 imports none. Rooms that import each other around a loop cannot all
stand above what they import: the loop is stacked in the order that leaves
the fewest of its arrows running back up (an exact search; loops are
small), and those are the arrows counted as running back up. A *circle* is
a set of files that import each other around a loop; the imports of a
`lib.rs`, `mod.rs` or `x.rs` (of `x/`) from the files under it (the names
it re-exports) close none, since a module owns its files.
"""

from __future__ import annotations

import argparse
import itertools
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SRC = ROOT / "rust" / "flashport-core" / "src"
IDENT = r"[A-Za-z_][A-Za-z0-9_]*"


def strip(text: str) -> str:
    """The code without comments, string and character literals (each
    replaced by spaces, newlines kept), so that no path is read from them."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if text.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif text.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    out.append("\n" if text[i] == "\n" else " ")
                    i += 1
        elif m := re.compile(r'b?r(#*)"').match(text, i):
            if i > 0 and (text[i - 1].isalnum() or text[i - 1] == "_"):
                out.append(c)
                i += 1
                continue
            end = text.find('"' + m.group(1), m.end())
            end = n if end < 0 else end + 1 + len(m.group(1))
            out.append(" " + "\n" * text.count("\n", i, end))
            i = end
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append(" " + "\n" * text.count("\n", i, j))
            i = j + 1
        elif c == "'" and (m := re.compile(r"'(\\.[^']*|[^\\'])'").match(text, i)):
            out.append(" ")
            i = m.end()
        else:
            out.append(c)
            i += 1
    return "".join(out)


def drop_test_modules(code: str) -> str:
    """The code without its `#[cfg(test)]` (or `all(test, ...)`) items: a
    unit test may import anything it checks against, and it is no part of
    the layering."""
    out, i = [], 0
    for m in re.finditer(r"#\[cfg\((?:test|all\([^\]]*\btest\b[^\]]*\))\)\]", code):
        if m.start() < i:
            continue
        out.append(code[i : m.start()])
        j = m.end()
        # The item ends at its closing brace, or at a `;` before any brace.
        while j < len(code) and code[j] not in "{;":
            j += 1
        if j < len(code) and code[j] == "{":
            depth = 0
            while j < len(code):
                depth += {"{": 1, "}": -1}.get(code[j], 0)
                j += 1
                if depth == 0:
                    break
        else:
            j += 1
        i = j
    out.append(code[i:])
    return "".join(out)


def inline_modules(code: str) -> list[tuple[int, int, str]]:
    """The `mod name { ... }` blocks of a file: start, end and name."""
    blocks = []
    for m in re.finditer(r"\bmod\s+(" + IDENT + r")\s*\{", code):
        depth, j = 0, m.end() - 1
        while j < len(code):
            depth += {"{": 1, "}": -1}.get(code[j], 0)
            j += 1
            if depth == 0:
                break
        blocks.append((m.start(), j, m.group(1)))
    return blocks


def inline_at(blocks: list[tuple[int, int, str]], pos: int) -> tuple[str, ...]:
    """The inline modules around a position, outermost first."""
    return tuple(name for start, end, name in blocks if start < pos < end)


def expand_use(tree: str) -> list[list[str]]:
    """`a::{b, c::{d as e, self}}` -> [[a, b], [a, c, d], [a, c]]."""
    tokens = re.findall(IDENT + r"|::|[{},*]", tree)
    paths: list[list[str]] = []

    def group(k: int, prefix: list[str]) -> int:
        # One path of a list: names joined by `::`, then `{...}` or an end.
        segs = list(prefix)
        while k < len(tokens):
            t = tokens[k]
            if t == "{":
                k += 1
                while k < len(tokens) and tokens[k] != "}":
                    k = group(k, segs)
                    if k < len(tokens) and tokens[k] == ",":
                        k += 1
                return k + 1
            if t in (",", "}"):
                break
            if t == "as":
                k += 2  # the new name is this file's, not the path's
                continue
            if t not in ("::", "*"):
                segs.append(t)
            k += 1
        if segs and segs[-1] == "self":
            segs.pop()
        if len(segs) > len(prefix) or segs == prefix:
            paths.append(segs)
        return k

    group(0, [])
    return paths


class Crate:
    def __init__(self, src: Path):
        self.src = src
        self.files = sorted(
            p for p in src.rglob("*.rs") if not (p.name == "tests.rs" or p.stem.endswith("_tests"))
        )
        self.by_module = {self.module(p): p for p in self.files}

    def module(self, path: Path) -> tuple[str, ...]:
        parts = path.relative_to(self.src).with_suffix("").parts
        if parts[-1] in ("lib", "main", "mod"):
            parts = parts[:-1]
        return tuple(parts)

    def resolve(self, segs: tuple[str, ...]) -> Path | None:
        """The file of the longest module prefix of an absolute path."""
        for k in range(len(segs), -1, -1):
            if segs[:k] in self.by_module:
                return self.by_module[segs[:k]]
        return None

    def imports(self, path: Path) -> dict[Path, set[str]]:
        """The files this one names, each with the paths that name it."""
        code = drop_test_modules(strip(path.read_text()))
        inline = inline_modules(code)
        children = {m.group(1) for m in re.finditer(r"\bmod\s+(" + IDENT + r")\s*;", code)}
        uses = [
            (self.module(path) + inline_at(inline, m.start()), segs)
            for m in re.finditer(r"\buse\s+([^;]+);", code)
            for segs in expand_use(m.group(1))
        ]
        # Names a `use` brings into scope that are modules of this crate,
        # so that `parallel::install` after `use crate::runtime::parallel`
        # is read as the path it is.
        aliases: dict[str, tuple[str, ...]] = {}
        for here, segs in uses:
            full = self.absolute(here, children, aliases, segs)
            if full and full in self.by_module:
                aliases[full[-1]] = full
        paths = list(uses)
        # Paths in the code, `use` lines blanked out (their braces would
        # read as paths of their own).
        body = re.sub(r"\buse\s+[^;]+;", lambda m: " " * len(m.group(0)), code)
        for m in re.finditer(r"(?<![\w:])(" + IDENT + r"(?:\s*::\s*" + IDENT + r")+)", body):
            here = self.module(path) + inline_at(inline, m.start())
            paths.append((here, re.split(r"\s*::\s*", m.group(1))))
        found: dict[Path, set[str]] = {}
        for here, segs in paths:
            full = self.absolute(here, children, aliases, segs)
            if full is None:
                continue
            target = self.resolve(full)
            if target is not None and target != path:
                found.setdefault(target, set()).add("::".join(segs))
        return found

    def absolute(self, here, children, aliases, segs) -> tuple[str, ...] | None:
        segs = list(segs)
        if not segs:
            return None
        head = segs[0]
        if head == "crate":
            return tuple(segs[1:])
        if head in ("self", "super"):
            base = list(here)
            while segs and segs[0] in ("self", "super"):
                if segs.pop(0) == "super":
                    if not base:
                        return None
                    base.pop()
            return tuple(base + segs)
        if head in children:
            return tuple(list(here) + segs)
        if head in aliases:
            return tuple(list(aliases[head]) + segs[1:])
        return None  # another crate, std, or a local name


def room_of(inside: Path, path: Path) -> str:
    """A file's room: the folder under `inside` it lies in, or the file,
    which is its folder's room where it is the module of one (`x.rs` of
    `x/`)."""
    rel = path.relative_to(inside)
    if len(rel.parts) > 1 or (inside / path.stem).is_dir():
        return rel.parts[0].removesuffix(".rs") + "/"
    return rel.as_posix()


def strongly_connected(nodes, edges):
    """Tarjan's components, each a sorted list."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = itertools.count()

    def visit(v):
        index[v] = low[v] = next(counter)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out


def fewest_back(loop, edges):
    """The arrows of a loop of rooms that run back up when its rooms are
    stacked in the order that leaves the fewest (dynamic programming over
    the sets of rooms stacked so far, lowest first; exact)."""
    n = len(loop)
    if n > 20:
        raise SystemExit(f"a loop of {n} rooms is too large to lay out exactly")
    pos = {v: i for i, v in enumerate(loop)}
    imports = [0] * n  # bit set of the loop's rooms that room i imports
    for v in loop:
        for w in edges.get(v, ()):
            if w in pos:
                imports[pos[v]] |= 1 << pos[w]
    best = {0: (0, -1)}  # rooms stacked -> (arrows up so far, the top one)
    for below in range(1 << n):
        if below not in best:
            continue
        cost = best[below][0]
        for i in range(n):
            if below >> i & 1:
                continue
            # Room i on top of `below`: what it imports from the rest of
            # the loop (still to be stacked above it) runs back up.
            up = cost + bin(imports[i] & ~below).count("1")
            stacked = below | 1 << i
            if stacked not in best or up < best[stacked][0]:
                best[stacked] = (up, i)
    rank, stacked = {}, (1 << n) - 1
    while stacked:
        i = best[stacked][1]
        rank[loop[i]] = stacked.bit_count()
        stacked &= ~(1 << i)
    return {(v, w) for v in loop for w in edges.get(v, ()) if w in rank and rank[w] > rank[v]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", type=Path, default=DEFAULT_SRC, help="the crate's src folder")
    ap.add_argument("--files", metavar="FOLDER", help="one folder of src, a file a room")
    ap.add_argument("--arrows", action="store_true", help="print every arrow")
    args = ap.parse_args()

    crate = Crate(args.src.resolve())
    inside = crate.src / args.files if args.files else crate.src
    files = [p for p in crate.files if p.is_relative_to(inside)]
    file_edges = {
        p: {t: n for t, n in crate.imports(p).items() if t.is_relative_to(inside)} for p in files
    }

    # Rooms and arrows, each arrow with the file imports that make it.
    rooms = {room_of(inside, p) for p in files}
    edges: dict[str, dict[str, list[str]]] = {}
    for p, targets in file_edges.items():
        a = room_of(inside, p)
        for t, names in targets.items():
            b = room_of(inside, t)
            if a != b:
                paths = ", ".join(sorted(names))
                why = f"{p.relative_to(inside)} -> {t.relative_to(inside)} ({paths})"
                edges.setdefault(a, {}).setdefault(b, []).append(why)

    back = set()
    for loop in strongly_connected(rooms, edges):
        if len(loop) > 1:
            back |= fewest_back(loop, edges)
    down = {a: [b for b in bs if (a, b) not in back] for a, bs in edges.items()}
    floor: dict[str, int] = {}

    def floor_of(r: str) -> int:
        if r not in floor:
            floor[r] = 1 + max((floor_of(b) for b in down.get(r, ())), default=0)
        return floor[r]

    for r in rooms:
        floor_of(r)

    # A module file owns the files under it: its imports of them (the
    # names it re-exports) close no circle.
    def owns(a: Path, b: Path) -> bool:
        if a.name in ("lib.rs", "mod.rs"):
            return b.is_relative_to(a.parent)
        return b.is_relative_to(a.with_suffix(""))

    circles = [
        c
        for c in strongly_connected(
            files, {p: {t for t in ts if not owns(p, t)} for p, ts in file_edges.items()}
        )
        if len(c) > 1
    ]

    where = inside.relative_to(ROOT) if inside.is_relative_to(ROOT) else inside
    print(
        f"{where}: {len(rooms)} rooms on {max(floor.values(), default=0)} floors, "
        f"{sum(map(len, edges.values()))} arrows, {len(back)} that run back up, "
        f"{len(circles)} circles"
    )
    for f in sorted(set(floor.values()), reverse=True):
        print(f"floor {f:2d}  " + "  ".join(sorted(r for r in rooms if floor[r] == f)))
    for a, b in sorted(back):
        print(f"back up: {a} (floor {floor[a]}) -> {b} (floor {floor[b]})")
        for why in sorted(edges[a][b]):
            print(f"    {why}")
    for c in circles:
        print("circle: " + ", ".join(p.relative_to(inside).as_posix() for p in c))
    if args.arrows:
        for a in sorted(edges, key=lambda r: (-floor[r], r)):
            for b in sorted(edges[a], key=lambda r: (-floor[r], r)):
                print(f"arrow: {a} (floor {floor[a]}) -> {b} (floor {floor[b]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
