# The two commands of the README:  make demo  and  make test.  Both create .venv themselves.
VENV ?= .venv
PY := $(VENV)/bin/python
# Both install from a lock (scripts/locks/, one per Python version): the exact versions the suite and the
# conformance run last passed with, so that a library's new release changes nothing until `make upgrade`
# has tested it. pyproject.toml keeps ranges, for users who pip install the package into their own
# environment.
PYVER := $(shell if test -x $(PY); then $(PY) -V; else python3 -V; fi | sed -E 's/Python ([0-9]+\.[0-9]+).*/\1/')
LOCK := scripts/locks/py$(PYVER).txt
TORCH_LOCK := scripts/locks/torch-py$(PYVER).txt
# A CPU build of torch lies on these machines' disk; with CUDA, install your own torch into .venv first
# (it is kept, and the lock names neither torch nor what only torch needs), or run e.g.
#   make test TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cu124"
TORCH_SPEC ?= torch==2.13.0 $(if $(wildcard $(TORCH_LOCK)),-c $(TORCH_LOCK))
PYTEST_ARGS ?=
# The suite's tests mostly wait (kernels, servers, browsers, daemons): one worker more than the cores (at
# most 4) keeps both cores busy. Each takes whole files (--dist loadfile), so a file's module fixtures are
# built once.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); echo $$(( n + 1 < 4 ? n + 1 : 4 )))
BUILD_DEPS := hatchling jupyter-builder hatch-jupyter-builder

.PHONY: setup lint test demo demo-headless clean chromium upgrade

# pip writes the bytecode of what it installs one file at a time; compileall writes the same files on every
# core (18 s less of a fresh setup on two cores). As with pip, a file written for another Python (torch
# ships one for 3.12 only) gets none, and is no error.
$(VENV)/.installed: pyproject.toml $(wildcard $(LOCK))
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --no-compile $(TORCH_SPEC)
	@test -f $(LOCK) || echo "No lock for Python $(PYVER) ($(LOCK)): installing the newest versions pyproject.toml allows, untested; make upgrade tests them and writes one."
	$(if $(wildcard $(LOCK)),PIP_CONSTRAINT=$(abspath $(LOCK))) $(PY) -m pip install --no-compile -e ".[test]"
	$(PY) -m compileall -qq -j 0 "$$($(PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" || true
	touch $@

# Debian's chromium for the browser tests (Playwright drives it; it never downloads a browser of its own).
# Installed when missing and running as root (CI); elsewhere the browser tests skip and say why.
chromium:
	@if command -v chromium >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	else echo "chromium is missing and this is not root: the browser tests will be skipped"; fi

# On a fresh machine apt's download and unpacking of chromium mostly waits, as pip's install does: they run
# side by side (make -j2 of the two), each failing the setup if it fails.
setup:
	$(MAKE) --no-print-directory -j2 $(VENV)/.installed chromium

# ruff's rules and mypy --strict are set in pyproject.toml; a finding fails the test command.
RUFF := $(PY) -m ruff check kernel_server overmind_jupyter tests benchmarks notebooks scripts
lint: setup
	$(RUFF)
	$(PY) -m mypy

# The suite starts hundreds of interpreters (kernels, daemons, snippets); each would compile this package's
# sources again where bytecode is not written (PYTHONDONTWRITEBYTECODE=1): compiled once here, as pip's
# install compiles them for a user, they start 0.2 s of CPU sooner each.
# mypy runs beside the suite, which leaves part of the cores idle while it waits on kernels and servers
# (a fresh check is 24 s of CPU); its findings print after the suite's, and either failing fails the command.
test: setup
	$(RUFF)
	$(PY) -m compileall -qq -j 0 overmind_jupyter kernel_server tests
	$(PY) -m mypy > $(VENV)/mypy.out 2>&1 & mypy=$$!; \
	$(if $(wildcard $(LOCK)),OVERMIND_LOCK=$(LOCK)) $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS); \
	suite=$$?; wait $$mypy; types=$$?; echo "$(PY) -m mypy:"; cat $(VENV)/mypy.out; \
	test $$suite = 0 && test $$types = 0

# The newest versions pyproject.toml's ranges allow (torch stays the one installed): install them, write
# the lock, run the linters, the suite and the conformance run, and re-record the conformance outcomes.
# Commit scripts/locks/ and tests/conformance/expected.json if it passes; if not, `git checkout
# scripts/locks tests/conformance/expected.json` goes back to the versions that passed.
upgrade: chromium
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install torch==2.13.0
	$(PY) -m pip install --upgrade --upgrade-strategy eager -e ".[test]" $(BUILD_DEPS) \
		"torch==$$($(PY) -c 'import importlib.metadata as m; print(m.version("torch"))')"
	$(PY) scripts/lock.py
	touch $(VENV)/.installed
	$(MAKE) test
	$(PY) tests/conformance/fetch.py
	$(PY) tests/conformance/run.py record

# The libraries' own tests (peft, transformers, diffusers; from their sdists at the installed versions) with
# the cache on, against their outcomes without it (tests/conformance/expected.json): fails on a regression.
# After a library upgrade:  $(PY) tests/conformance/run.py record  and commit expected.json.
.PHONY: conformance
conformance: setup
	$(PY) tests/conformance/fetch.py
	$(PY) tests/conformance/run.py check

# The demo needs no browser of ours (you bring yours), so no chromium: only the tests' setup installs it.
demo: $(VENV)/.installed
	$(PY) scripts/demo.py

demo-headless: $(VENV)/.installed
	$(PY) scripts/demo.py --headless

clean:
	rm -rf $(VENV) benchmarks/out
