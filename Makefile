# The workshop in two commands: `make demo` (run every notebook offline on the tiny profile)
# and `make test` (the whole test suite). Both create the environment first if needed.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE ?= 1
export AZURE_CORE_COLLECT_TELEMETRY ?= false
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: setup demo test test-fast lint format bench toyworld clean distclean

setup: $(VENV)/.setup-done

# Re-runs only when a requirement file or pyproject.toml changed (idempotent, fast otherwise).
$(VENV)/.setup-done: requirements.txt requirements-nodeps.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	@# optimum-intel requires an unpinned torchvision that breaks the CPU torch: no dependencies.
	$(PY) -m pip install -q --no-deps -r requirements-nodeps.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	$(PY) -m helpers.environment
	touch $@

demo: setup
	$(PY) -m helpers.notebooks --out build --html

test: setup
	$(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m "not slow and not notebooks"

lint: setup
	$(VENV)/bin/ruff check helpers tests bench
	$(VENV)/bin/ruff format --check helpers tests bench

format: setup
	$(VENV)/bin/ruff format helpers tests bench
	$(VENV)/bin/ruff check --fix helpers tests bench

bench: setup
	$(PY) -m bench.train_step --model tiny
	$(PY) -m bench.inference --model tiny

# Rebuild the shipped toy-world model (about an hour on 2 cores; resumable if interrupted).
toyworld: setup
	$(PY) -m helpers.toyworld build --output_dir helpers/assets/toyworld

clean:
	rm -rf build .pytest_cache .ruff_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
