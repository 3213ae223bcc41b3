# The two quickstart commands: `make run` (main job) and `make test` (the suite). Both set up .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: setup run lint test bench clean-venv

# Idempotent: re-runs only when pyproject.toml changes. torch is pinned to the CPU build that this
# machine kind keeps on disk; an unpinned torch would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "torch==2.13.0"
	$(BIN)/python -m pip install -q -e ".[test,torch]"
	touch $(STAMP)

setup: $(STAMP)

run: setup
	$(BIN)/k3conf run

# ruff (style, import order, imports at the top) and mypy (types) over the packages, the tests and the tools
lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/python -m pytest benchmarks -q -p no:randomly --benchmark-columns=min,median,max,rounds

clean-venv:
	rm -rf $(VENV)
