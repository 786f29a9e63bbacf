# The command surface of flashport: CI, pre-commit habits and the README
# all go through these targets.
.PHONY: setup run test lint test-rust test-python test-wheel test-old-glibc test-sdist bench clean

# Mesa's WSI layer warns on every instance creation when this is unset.
export XDG_RUNTIME_DIR ?= /tmp/flashport-xdg-runtime
PY := .venv/bin/python
PYTHON ?= python3

setup:
	@mkdir -p -m 700 $(XDG_RUNTIME_DIR)
	@scripts/setup.sh

## Sets everything up and runs the main job.
run: setup
	$(PY) -m flashport

## Sets everything up and runs every test: lints, Rust tests (the shaders
## validated by naga, the GPU kernels on the Vulkan adapter), and the Python
## suites on the CPU and on the GPU, then the release wheel on its own. A
## missing GPU adapter is a failure here.
test: setup lint test-rust test-python test-wheel

# Clippy twice: with the test hooks (what the tests and tools build) and
# as the release wheel builds the extension, without them. actionlint checks
# the release workflow, which runs on GitHub only; shellcheck and pyflakes
# are left out of it so that its verdict does not hang on what else a
# machine has installed.
lint:
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets --all-features --quiet -- -D warnings
	cargo clippy -p flashport-py --quiet -- -D warnings
	.venv/bin/ruff check python tests benchmarks examples shaders/gen scripts
	.venv/bin/ruff format --check python tests benchmarks examples shaders/gen scripts
	scripts/cm2.sh --check
	.venv/bin/actionlint -shellcheck= -pyflakes=

test-rust:
	FLASHPORT_REQUIRE_GPU=1 cargo test --workspace --all-features --quiet

test-python:
	FLASHPORT_REQUIRE_GPU=1 $(PY) -m pytest

# The wheel a user installs, built as the release workflow builds it for
# Linux (.github/workflows/release.yml): without the test hooks, linked by
# zig (the ziglang package) against glibc 2.17's symbols, so that pip takes it
# on every Linux since RHEL 7 (manylinux2014). Nothing ties it to a newer
# policy: the extension needs only libc, libm, libdl and libpthread, and wgpu
# opens the Vulkan loader at run time. check_wheel.py fails unless auditwheel
# agrees, nothing is bundled and the loader is not linked, then (--self-test)
# that it fails on copies made wrong on purpose. Then the wheel in a fresh
# virtual environment with only its declared dependencies (NumPy, pinned as
# for development, so pip takes it from its cache), run from outside the
# source tree. zig's build has a target directory of its own
# (target/x86_64-unknown-linux-gnu): the dependencies compile once more there.
MANYLINUX := manylinux2014
WHEEL_CHECK := target/wheel-check
# maturin runs zig as `python -m ziglang` with the first Python on PATH.
ZIG_ENV := PATH="$(CURDIR)/.venv/bin:$$PATH"
define manylinux-wheel
	$(ZIG_ENV) .venv/bin/maturin build --release --quiet --zig --compatibility $(MANYLINUX) --out $(1)
endef

test-wheel: setup
	rm -rf $(WHEEL_CHECK)
	$(call manylinux-wheel,$(WHEEL_CHECK)/dist)
	$(PY) scripts/check_wheel.py --policy $(MANYLINUX) --self-test $(WHEEL_CHECK)/dist/*.whl
	$(PYTHON) -m venv $(WHEEL_CHECK)/venv
	$(WHEEL_CHECK)/venv/bin/python -m pip install -q --disable-pip-version-check \
		-c requirements-dev.txt $(WHEEL_CHECK)/dist/*.whl
	cd $(WHEEL_CHECK) && FLASHPORT_REQUIRE_GPU=1 venv/bin/python $(CURDIR)/scripts/wheel_smoke.py

## Opt-in (root; about 3 minutes the first time here, 1.3 GiB in target/old-glibc):
## the manylinux wheel installed and smoke-tested on Debian 11 (glibc 2.31,
## older than this machine's), without a Vulkan loader: CPU only. A plain
## `maturin build` wheel goes along, which pip there must refuse.
OLD_GLIBC := target/old-glibc
test-old-glibc: setup
	rm -rf $(OLD_GLIBC)/dist $(OLD_GLIBC)/plain
	$(call manylinux-wheel,$(OLD_GLIBC)/dist)
	.venv/bin/maturin build --release --quiet --out $(OLD_GLIBC)/plain
	scripts/old_glibc.sh $(OLD_GLIBC)/dist/*.whl $(OLD_GLIBC)/plain/*.whl

## Opt-in (about 3.5 minutes here: everything compiles from the sdist): the source
## distribution holds what a build needs (check_sdist.py), and pip builds and
## installs it in a fresh virtual environment, as where no wheel fits, then
## the smoke test. maturin, the build backend, comes from PyPI at the
## version pinned in requirements-dev.txt.
SDIST_CHECK := target/sdist-check
test-sdist: setup
	rm -rf $(SDIST_CHECK)
	.venv/bin/maturin sdist --out $(SDIST_CHECK)/dist
	$(PY) scripts/check_sdist.py $(SDIST_CHECK)/dist/*.tar.gz
	$(PYTHON) -m venv $(SDIST_CHECK)/venv
	PIP_CONSTRAINT=$(CURDIR)/requirements-dev.txt CARGO_TARGET_DIR=$(CURDIR)/$(SDIST_CHECK)/target \
		$(SDIST_CHECK)/venv/bin/python -m pip install --disable-pip-version-check \
		$(SDIST_CHECK)/dist/*.tar.gz
	cd $(SDIST_CHECK) && FLASHPORT_REQUIRE_GPU=1 venv/bin/python $(CURDIR)/scripts/wheel_smoke.py

## Opt-in: installs matplotlib and compares the CPU path with PyTorch (which
## setup installs, pinned in requirements-dev.txt).
bench: setup
	.venv/bin/python -m pip install -q -r requirements-bench.txt
	$(PY) -m flashport bench --json bench.json --plot bench.png

clean:
	cargo clean
	rm -rf .venv .pytest_cache .hypothesis .ruff_cache
