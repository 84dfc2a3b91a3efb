# `make test` / `make demo` work on a fresh machine: they create .venv, install the project, then run.

VENV ?= .venv
PYTHON ?= $(shell python3.11 -c "" >/dev/null 2>&1 && echo python3.11 || echo python3)
# Pinned and installed before the project: a bare `torch` requirement would resolve to a multi-GB CUDA build;
# this machine's pip config finds the CPU wheel for the pinned version.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
# Test files run on one pytest-xdist worker per core (a file's tests stay together, so its module fixtures run
# once): most of the suite is 2-rank launches whose ranks wait on each other or on a planning rank, which leaves
# a core idle when the files run one after the other. PYTEST_WORKERS=0 runs them in this process.
PYTEST_WORKERS ?= auto

PY := $(VENV)/bin/python
STAMP := $(VENV)/.hf-colossal-auto-installed

.PHONY: install test demo lint bench clean

install: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	@$(PY) -c "import torch" >/dev/null 2>&1 || $(PY) -m pip install "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	@touch $@

test: install
	$(PY) -m pytest -q -ra -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

demo: install
	$(VENV)/bin/hf-colossal-auto demo

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: install
	@set -e; found=0; for script in scripts/bench_*.py; do \
		[ -e "$$script" ] || continue; found=1; \
		echo "== $$script"; $(PY) "$$script"; \
	done; [ $$found = 1 ] || echo "no scripts/bench_*.py yet"

clean:
	rm -rf build dist *.egg-info .pytest_cache .ruff_cache
