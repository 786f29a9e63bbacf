#!/usr/bin/env bash
# Sets up everything flashport's development needs, idempotently:
#   - a Vulkan driver for the GPU backend (Mesa's lavapipe when none is present),
#   - a virtual environment in .venv with the pinned Python dependencies,
#   - the Rust extension built in release mode, with the `testing` feature
#     that the test suite and the benchmark tools use, into that environment.
# A second run changes nothing that is already in place: it installs no
# system package, asks for no password, and needs no network unless
# requirements-dev.txt changed.
# Usage: scripts/setup.sh   (then use .venv/bin/python)
#
# For testing this script: SETUP_SYSROOT=/some/dir looks for the Vulkan
# driver under that directory instead of / (an empty one means "none").
set -euo pipefail
shopt -s nullglob
cd "$(dirname "$0")/.."

say() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }
die() {
    printf '\033[1m[setup]\033[0m %s\n' "$1" >&2
    shift
    [ $# -eq 0 ] || printf '        %s\n' "$@" >&2
    exit 1
}

SYSROOT=${SETUP_SYSROOT:-}
# Where the Vulkan loader looks for drivers (ICD manifests) on Linux.
ICD_DIRS=(/usr/share/vulkan/icd.d /etc/vulkan/icd.d /usr/local/share/vulkan/icd.d)
PACKAGES=(mesa-vulkan-drivers libvulkan1)

# A driver manifest: a JSON file in one of ICD_DIRS, or named (as a file,
# or a directory of them) by $VK_DRIVER_FILES or $VK_ICD_FILENAMES.
have_vulkan_icd() {
    local entry dir
    local -a entries=() found=()
    IFS=: read -ra entries <<<"${VK_DRIVER_FILES:-}:${VK_ICD_FILENAMES:-}"
    for entry in "${entries[@]}"; do
        [ -n "$entry" ] || continue
        [ -f "$entry" ] && return 0
        if [ -d "$entry" ]; then
            found=("$entry"/*.json)
            [ ${#found[@]} -gt 0 ] && return 0
        fi
    done
    for dir in "${ICD_DIRS[@]}"; do
        found=("$SYSROOT$dir"/*.json) # empty when the directory is missing
        [ ${#found[@]} -gt 0 ] && return 0
    done
    return 1
}

# The Vulkan loader, libvulkan.so.1, where the dynamic linker finds it.
have_vulkan_loader() {
    local dir entry
    local -a found=()
    found=("$SYSROOT"/lib/*/libvulkan.so.1 "$SYSROOT"/usr/lib/*/libvulkan.so.1
        "$SYSROOT"/lib64/libvulkan.so.1 "$SYSROOT"/usr/lib64/libvulkan.so.1
        "$SYSROOT"/usr/lib/libvulkan.so.1 "$SYSROOT"/usr/local/lib/libvulkan.so.1
        "$SYSROOT"/usr/local/lib/*/libvulkan.so.1)
    for entry in "${found[@]}"; do
        [ -e "$entry" ] && return 0
    done
    [ -z "$SYSROOT" ] || return 1
    local -a lib_dirs=()
    IFS=: read -ra lib_dirs <<<"${LD_LIBRARY_PATH:-}"
    for dir in "${lib_dirs[@]}"; do
        [ -n "$dir" ] && [ -e "$dir/libvulkan.so.1" ] && return 0
    done
    local cache
    cache=$(PATH="$PATH:/sbin:/usr/sbin" ldconfig -p 2>/dev/null) || cache=""
    [[ $cache == *libvulkan.so.1* ]]
}

have_vulkan_driver() { have_vulkan_icd && have_vulkan_loader; }

# How to run a command as root without a prompt: directly when root, with
# `sudo -n` when sudo needs no password; fails otherwise.
as_root_prefix() {
    if [ "$(id -u)" -eq 0 ]; then
        return 0
    fi
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        echo "sudo -n"
        return 0
    fi
    return 1
}

install_lavapipe() {
    local missing="no driver manifest (ICD JSON) in ${ICD_DIRS[*]}, \$VK_DRIVER_FILES or \$VK_ICD_FILENAMES"
    have_vulkan_icd && missing="no Vulkan loader (libvulkan.so.1)"
    local how="On Debian/Ubuntu, install Mesa's software driver (lavapipe) and the loader as root:"
    local prefix
    if ! prefix=$(as_root_prefix); then
        die "no Vulkan driver found: $missing." \
            "The GPU backend and its tests need one, and this script installs packages only" \
            "as root or through sudo without a password prompt." \
            "$how" \
            "    sudo apt-get install ${PACKAGES[*]}" \
            "(or your GPU vendor's Vulkan driver; elsewhere, Mesa's Vulkan drivers and the" \
            "Vulkan loader), then run make again."
    fi
    if ! command -v apt-get >/dev/null 2>&1; then
        die "no Vulkan driver found: $missing, and no apt-get to install one." \
            "Install Mesa's Vulkan drivers (lavapipe) and the Vulkan loader, or your GPU" \
            "vendor's Vulkan driver, with this system's package manager, then run make again."
    fi
    say "no Vulkan driver found ($missing): installing ${PACKAGES[*]}${prefix:+ with $prefix}"
    # shellcheck disable=SC2086 # $prefix is empty or "sudo -n"
    $prefix env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    # shellcheck disable=SC2086
    $prefix env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >/dev/null
    have_vulkan_driver || die "installed ${PACKAGES[*]}, yet still no Vulkan driver found."
}

if [ "$(uname -s)" = "Linux" ] && ! have_vulkan_driver; then
    install_lavapipe
fi

if ! command -v cargo >/dev/null; then
    die "cargo not found: install Rust from https://rustup.rs (1.85 or newer)"
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

say "building the extension (release, --features testing)"
VIRTUAL_ENV="$PWD/.venv" PATH="$PWD/.venv/bin:$PATH" \
    .venv/bin/maturin develop --release --features testing --quiet
say "ready: $(.venv/bin/python -c 'import flashport; print("flashport", flashport.__version__)')"
