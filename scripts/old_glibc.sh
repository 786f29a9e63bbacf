#!/usr/bin/env bash
# Installs a Linux wheel of flashport on a system older than the build
# machine and runs the smoke test there (`make test-old-glibc`).
#
# The system: a Debian 11 (bullseye, glibc 2.31) root made by debootstrap
# from Debian's mirror, entered with chroot. Bullseye's own Python is 3.9,
# older than flashport's requires-python (>=3.10), and no other Python is
# reachable here (python.org and python-build-standalone's downloads are
# not), so CPython 3.11 is built inside the root, by bullseye's compiler
# against bullseye's glibc, from the pristine upstream tarball of Debian 12's
# python3.11 source package (apt-get source checks it against the signed
# archive). NumPy: the PyPI wheel for the root's Python and glibc, which
# the host's pip downloads and the root's pip installs offline (--no-index),
# so the root needs no PyPI access. The root has no Vulkan loader: flashport
# computes on the CPU there, and the smoke test checks that it says so.
#
# Usage (as root, Linux x86-64): scripts/old_glibc.sh WHEEL [PLAIN_WHEEL]
#   PLAIN_WHEEL: optionally a wheel pip must refuse there (the manylinux_2_35
#   one a plain `maturin build` makes on Debian 12), to show the root tells
#   the two apart.
# The root stays in target/old-glibc (about 1.3 GiB, kept between runs so that
# later runs skip debootstrap and the Python build); OLD_GLIBC_DIR moves it.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf '\033[1m[old-glibc]\033[0m %s\n' "$*"; }
die() {
    printf '\033[1m[old-glibc]\033[0m %s\n' "$*" >&2
    exit 1
}

if [ $# -lt 1 ] || [ ! -f "$1" ]; then
    die "usage: $0 WHEEL [PLAIN_WHEEL]"
fi
WHEEL=$(realpath "$1")
PLAIN=${2:+$(realpath "$2")}
[ "$(id -u)" -eq 0 ] || die "needs root: debootstrap and chroot"
[ "$(uname -m)" = x86_64 ] || die "made for x86-64 hosts"

DIR=${OLD_GLIBC_DIR:-target/old-glibc}
ROOT=$(realpath -m "$DIR/root")
SUITE=bullseye
MIRROR=http://deb.debian.org/debian
# Where the Python source comes from, and what the root needs to build it
# (ssl, zlib and ctypes: pip's and NumPy's needs).
PYTHON_SOURCE=python3.11
PYTHON_SUITE=bookworm
PACKAGES=build-essential,zlib1g-dev,libffi-dev,libssl-dev,ca-certificates,xz-utils
PYTHON=/opt/python/bin/python3.11
NUMPY=$(grep -E '^numpy==' requirements-dev.txt)

in_root() { chroot "$ROOT" env -i PATH=/opt/python/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root "$@"; }

if [ ! -f "$DIR/.debootstrap-done" ]; then
    if ! command -v debootstrap >/dev/null; then
        say "installing debootstrap"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
    fi
    say "debootstrap $SUITE into $ROOT"
    rm -rf "$ROOT"
    mkdir -p "$ROOT"
    debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$ROOT" "$MIRROR" >"$DIR/debootstrap.log"
    touch "$DIR/.debootstrap-done"
fi

if [ ! -x "$ROOT$PYTHON" ]; then
    say "building CPython from Debian $PYTHON_SUITE's $PYTHON_SOURCE source, in the root"
    cp /etc/resolv.conf "$ROOT/etc/resolv.conf"
    echo "deb-src $MIRROR $PYTHON_SUITE main" >"$ROOT/etc/apt/sources.list.d/python-source.list"
    rm -rf "$ROOT/build" && mkdir -p "$ROOT/build"
    in_root sh -ec "apt-get update -qq
        cd /build && apt-get source --download-only -qq $PYTHON_SOURCE 2>/dev/null
        tar xf ${PYTHON_SOURCE}_*.orig.tar.*
        cd Python-*/
        ./configure -q --prefix=/opt/python >/build/configure.log
        make -s -j$(nproc) >/build/make.log 2>&1 || { tail -30 /build/make.log; exit 1; }
        make -s install >/build/install.log 2>&1"
    rm -rf "$ROOT/build"
fi

# shellcheck disable=SC2016 # $PRETTY_NAME is the root's, expanded there
say "the root: $(in_root sh -c '. /etc/os-release; echo "$PRETTY_NAME"'), $(in_root ldd --version | head -1)"
say "its Python: $(in_root $PYTHON -c 'import platform, sys; print(sys.version.split()[0], "linked against", *platform.libc_ver())')"
say "its Vulkan loader: $(in_root sh -c 'ldconfig -p | grep libvulkan || echo none')"

# A fresh venv and wheelhouse each run: only what the host hands over.
rm -rf "$ROOT/work" && mkdir -p "$ROOT/work/wheels"
cp "$WHEEL" scripts/wheel_smoke.py "$ROOT/work/"
if [ -n "$PLAIN" ]; then
    mkdir -p "$ROOT/work/plain" && cp "$PLAIN" "$ROOT/work/plain/"
fi
TAGS=$(in_root $PYTHON -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')
# The NumPy wheel pip would pick there: its Python and glibc 2.31.
.venv/bin/python -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version "$TAGS" --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_27_x86_64 --platform manylinux2014_x86_64 \
    -d "$ROOT/work/wheels" "$NUMPY"
in_root $PYTHON -m venv /work/venv

if [ -n "$PLAIN" ]; then
    say "pip install $(basename "$PLAIN") (must be refused)"
    if in_root /work/venv/bin/pip install --disable-pip-version-check --no-index \
        --find-links /work/wheels "/work/plain/$(basename "$PLAIN")"; then
        die "pip installed a wheel tagged for a newer glibc than the root's"
    fi
fi

say "pip install $(basename "$WHEEL")"
in_root /work/venv/bin/pip install --disable-pip-version-check --no-index \
    --find-links /work/wheels "/work/$(basename "$WHEEL")"
say "smoke test (no Vulkan loader: CPU only)"
in_root sh -c "cd /work && venv/bin/python wheel_smoke.py"
