# The command surface of flashport: CI, pre-commit habits and the README
# all go through these targets.
.PHONY: setup run test lint test-rust test-python test-wheel bench clean

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
# as the release wheel builds the extension, without them.
lint:
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets --all-features --quiet -- -D warnings
	cargo clippy -p flashport-py --quiet -- -D warnings
	.venv/bin/ruff check python tests benchmarks examples shaders/gen scripts
	.venv/bin/ruff format --check python tests benchmarks examples shaders/gen scripts
	scripts/cm2.sh --check

test-rust:
	FLASHPORT_REQUIRE_GPU=1 cargo test --workspace --all-features --quiet

test-python:
	FLASHPORT_REQUIRE_GPU=1 $(PY) -m pytest

# The wheel a user installs: the release build without the test hooks, in a
# fresh virtual environment with only its declared dependencies (NumPy, at
# the version pinned for development, so pip takes it from its cache), run
# from outside the source tree. It shares target/ with the development
# build: only the two flashport crates are compiled again.
WHEEL_CHECK := target/wheel-check
test-wheel: setup
	rm -rf $(WHEEL_CHECK)
	.venv/bin/maturin build --release --quiet --out $(WHEEL_CHECK)/dist
	$(PYTHON) -m venv $(WHEEL_CHECK)/venv
	$(WHEEL_CHECK)/venv/bin/python -m pip install -q --disable-pip-version-check \
		-c requirements-dev.txt $(WHEEL_CHECK)/dist/*.whl
	cd $(WHEEL_CHECK) && FLASHPORT_REQUIRE_GPU=1 venv/bin/python $(CURDIR)/scripts/wheel_smoke.py

## Opt-in: installs matplotlib and compares the CPU path with PyTorch (which
## setup installs, pinned in requirements-dev.txt).
bench: setup
	.venv/bin/python -m pip install -q -r requirements-bench.txt
	$(PY) -m flashport bench --json bench.json --plot bench.png

clean:
	cargo clean
	rm -rf .venv .pytest_cache .hypothesis .ruff_cache
