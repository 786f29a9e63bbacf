"""The register-tiled shaders are generated (WGSL has no macros, and the
register tiles must be named variables): the committed WGSL in
shaders/tiled (and decoding's subgroup kernel in shaders/decode) must be
exactly what the generators in shaders/gen write, so neither can drift."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SHADERS = Path(__file__).resolve().parents[1] / "shaders"
# Modules whose names start with "_" are the generators' shared helpers.
GENERATORS = sorted(p for p in (SHADERS / "gen").glob("*.py") if not p.name.startswith("_"))


@pytest.mark.parametrize("generator", GENERATORS, ids=lambda p: p.name)
def test_committed_wgsl_matches_its_generator(generator, tmp_path):
    copy = tmp_path / "shaders"
    shutil.copytree(SHADERS / "gen", copy / "gen")
    subprocess.run([sys.executable, str(copy / "gen" / generator.name)], check=True)
    written = sorted(
        path for folder in ("tiled", "decode") for path in (copy / folder).glob("*.wgsl")
    )
    assert written, f"{generator.name} wrote no shader"
    for path in written:
        name = path.relative_to(copy).as_posix()
        assert path.read_text() == (SHADERS / name).read_text(), (
            f"shaders/{name} differs from what {generator.name} writes: "
            f"run python3 shaders/gen/{generator.name}"
        )
