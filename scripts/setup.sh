#!/usr/bin/env bash
# Sets up everything flashport's development needs, idempotently:
#   - a Vulkan driver for the GPU backend (Mesa's lavapipe when none is present),
#   - a virtual environment in .venv with the pinned Python dependencies,
#   - the Rust extension built in release mode into that environment.
# Usage: scripts/setup.sh   (then use .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }

have_vulkan_driver() {
    ls /usr/share/vulkan/icd.d/*.json /etc/vulkan/icd.d/*.json 2>/dev/null | grep -q . &&
        { ldconfig -p 2>/dev/null | grep -q 'libvulkan\.so\.1' || [ -e /usr/lib/x86_64-linux-gnu/libvulkan.so.1 ]; }
}

if [ "$(uname -s)" = "Linux" ] && ! have_vulkan_driver; then
    say "no Vulkan driver found: installing Mesa's lavapipe (mesa-vulkan-drivers, libvulkan1)"
    sudo_cmd=""
    [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
    export DEBIAN_FRONTEND=noninteractive
    $sudo_cmd apt-get update -qq
    $sudo_cmd apt-get install -y -qq --no-install-recommends mesa-vulkan-drivers libvulkan1 >/dev/null
fi

if ! command -v cargo >/dev/null; then
    echo "cargo not found: install Rust from https://rustup.rs (1.85 or newer)" >&2
    exit 1
fi

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    say "creating .venv with $($PYTHON --version)"
    "$PYTHON" -m venv .venv
fi
stamp=.venv/.requirements-dev.txt
if ! cmp -s requirements-dev.txt "$stamp"; then
    say "installing pinned Python dependencies"
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -r requirements-dev.txt
    cp requirements-dev.txt "$stamp"
fi

say "building the extension (release)"
VIRTUAL_ENV="$PWD/.venv" PATH="$PWD/.venv/bin:$PATH" .venv/bin/maturin develop --release --quiet
say "ready: $(.venv/bin/python -c 'import flashport; print("flashport", flashport.__version__)')"
