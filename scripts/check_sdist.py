"""Checks that flashport's source distribution holds what building and
redistributing it needs (`make test-sdist`):

    check_sdist.py SDIST    exit 1, naming the files, unless every file git tracks
                            under the paths below is in SDIST.

The Rust core embeds its shaders from outside its crate (`include_str!`, and
`include_bytes!` for the checked-in SPIR-V of shaders/cm2), where cargo's
packaging does not look; pyproject.toml's `include` must bring them, and the
licence texts the package's licence expression names.
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NEEDED = [
    "LICENSE-MIT",
    "LICENSE-APACHE",
    "README.md",
    "pyproject.toml",
    "Cargo.toml",
    "Cargo.lock",
    "shaders",
    "python/flashport",
    "rust/flashport-core/src",
    "rust/flashport-core/Cargo.toml",
    "rust/flashport-py/src",
    "rust/flashport-py/Cargo.toml",
]


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} SDIST")
    sdist = Path(sys.argv[1])
    tracked = subprocess.run(
        ["git", "ls-files", "--", *NEEDED], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    with tarfile.open(sdist) as archive:
        # Members are flashport-VERSION/PATH.
        held = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    missing = sorted(set(tracked) - held)
    if missing or not tracked:
        sys.exit(f"check_sdist: {sdist.name} lacks {len(missing)} files: {missing}")
    print(f"check_sdist: {sdist.name} holds all {len(tracked)} files git tracks under {NEEDED}")


if __name__ == "__main__":
    main()
