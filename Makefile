# The workshop in two commands: `make demo` (run every notebook offline on the tiny profile)
# and `make test` (the whole test suite). Both create the environment first if needed.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# `make lab` decides by itself unless HF_HUB_OFFLINE was given (before the default below sets it).
LAB_OFFLINE := $(if $(HF_HUB_OFFLINE),$(HF_HUB_OFFLINE),auto)
export HF_HUB_OFFLINE ?= 1
export AZURE_CORE_COLLECT_TELEMETRY ?= false
export PIP_DISABLE_PIP_VERSION_CHECK := 1
# Python caches the bytecode of what it imports (its default; a shell may turn it off): pip compiles
# nothing at install (below), so every process would otherwise compile its imports afresh.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: setup setup-ipex system-packages demo lab handouts test test-fast test-ipex coverage lint format bench toyworld toyworld-xl clean distclean

setup: $(VENV)/.setup-done

# Re-runs only when a requirement file or pyproject.toml changed (idempotent, fast otherwise).
$(VENV)/.setup-done: requirements.txt requirements-nodeps.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@# --no-compile: pip would compile all 33,000 files of the environment (95 s of a 150 s install on 2
	@# cores); the environment check's --import_all below compiles the 5,000 that helpers imports (about 20 s).
	$(PY) -m pip install -q --no-compile -r requirements.txt
	@# optimum-intel requires an unpinned torchvision that breaks the CPU torch: no dependencies.
	$(PY) -m pip install -q --no-compile --no-deps -r requirements-nodeps.txt
	$(PY) -m pip install -q --no-compile --no-deps --no-build-isolation -e .
	$(PY) -m helpers.core.environment --import_all
	@# The ccl backend for torch.distributed (helpers.ranks.oneccl, about a minute, once); if it cannot be built, gloo is used and its tests skip saying why.
	$(PY) -m helpers.ranks.oneccl build || echo "note: the ccl backend was not built (the line above says why); the rest works with gloo"
	touch $@

# The optional second environment for Intel Extension for PyTorch: torch 2.8 (a CUDA build on the
# registry, about 3.8 GB to download and 7 GB on disk) and IPEX 2.8, with helpers installed editable.
IPEX_VENV ?= .venv-ipex
IPEX_PY := $(IPEX_VENV)/bin/python
setup-ipex: $(IPEX_VENV)/.setup-done

$(IPEX_VENV)/.setup-done: requirements-ipex.txt pyproject.toml
	test -x $(IPEX_PY) || $(PYTHON) -m venv $(IPEX_VENV)
	$(IPEX_PY) -m pip install -q --upgrade pip
	@# --no-compile, as make setup: CI installs this beside make test's run, whose cores pip's compiling took.
	$(IPEX_PY) -m pip install -q --no-compile -r requirements-ipex.txt
	$(IPEX_PY) -m pip install -q --no-compile --no-deps --no-build-isolation -e .
	-$(IPEX_PY) -c "import intel_extension_for_pytorch, helpers.train, pytest"  # their bytecode, once (a cache: not fatal)
	touch $@

# Debian programs some tests need: Open MPI and MPICH (the launcher with each MPI flavour),
# Chromium (handouts opened in a real browser, PDF handouts), Graphviz (the diagrams' sources),
# sshd and ip (two "hosts" made of network namespaces, tests/launching/test_netns.py).
# Installed when missing if this is root with apt-get; otherwise those tests skip and say why.
DEBIAN_PACKAGES := openmpi-bin mpich chromium chromium-driver graphviz openssh-server iproute2
system-packages:
	@missing=$$(for p in $(DEBIAN_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	  echo "installing" $$missing; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null) \
	    || echo "note: could not install" $$missing "- the tests that need them will be skipped"; \
	else echo "note: missing" $$missing "(install them as root) - the tests that need them will be skipped"; fi

demo: setup
	$(PY) -m helpers.workshop.notebooks --out build
	$(PY) -m helpers.workshop.handouts build

# JupyterLab on the notebooks in lab/ (kept between runs): prepared with the offline profile (the toy
# world, Pip) when the Hub cannot be reached, with the real defaults when it can; HF_HUB_OFFLINE=1 or 0 decides.
lab: setup
	$(PY) -m helpers.workshop.jupyter --folder lab --offline $(LAB_OFFLINE)

# PDF handouts too (headless Chromium), from the notebooks `make demo` executed into build/.
handouts: demo system-packages
	$(PY) -m helpers.workshop.handouts build --pdf

# --durations: the slowest tests, so a CI log shows where its time goes (CI's limit is 90 min).
# -n 2 --dist loadscope: two workers, a module's tests on one (its module fixtures are computed once;
# three workers on 2 cores ran every module about 1.5x slower and the whole suite slower: it is CPU-bound);
# the notebooks run once (tests/conftest.py's notebook_records), and every check of their records is in
# tests/workshop/test_notebooks.py, on the worker that runs them: a test elsewhere would wait idle.
test: setup system-packages
	$(PY) -m pytest -q -n 2 --dist loadscope --durations=30

test-fast: setup
	$(PY) -m pytest -q -n 2 --dist loadscope -m "not slow and not notebooks"

# The IPEX path, really run (tests/test_ipex.py); WORKSHOP_REQUIRE_IPEX turns "not installed" into a failure.
test-ipex: setup-ipex
	WORKSHOP_REQUIRE_IPEX=1 $(IPEX_PY) -m pytest -q tests/test_ipex.py

# Line coverage of helpers/ over `make test`'s run, the processes it starts included ([tool.coverage]
# in pyproject.toml): the total is the last line, per file in build/coverage.txt. Not part of CI
# (slower than make test); processes ended by a signal (the signal tests' ranks) save nothing.
COVERAGE := COVERAGE_FILE=$(CURDIR)/build/coverage/data $(PY) -m coverage
coverage: setup system-packages
	rm -rf build/coverage && mkdir -p build/coverage
	$(COVERAGE) run -m pytest -q -n 2 --dist loadscope -p no:cacheprovider; status=$$?; \
	$(COVERAGE) combine -q && $(COVERAGE) report > build/coverage.txt; tail -n 1 build/coverage.txt; exit $$status

lint: setup
	$(VENV)/bin/ruff check helpers tests bench
	$(VENV)/bin/ruff format --check helpers tests bench
	$(VENV)/bin/lint-imports

format: setup
	$(VENV)/bin/ruff format helpers tests bench
	$(VENV)/bin/ruff check --fix helpers tests bench

bench: setup
	$(PY) -m bench.train_step --model tiny
	$(PY) -m bench.inference --model tiny

# Rebuild the shipped toy-world model (about an hour on 2 cores; resumable if interrupted).
toyworld: setup
	$(PY) -m helpers.toyworld build --output_dir helpers/assets/toyworld

# Rebuild its SDXL twin, grafted from it (about 11 min on 2 cores; resumable).
toyworld-xl: setup
	$(PY) -m helpers.toyworld build --family sdxl --output_dir helpers/assets/toyworld-xl

clean:
	rm -rf build .pytest_cache .ruff_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV) $(IPEX_VENV)
