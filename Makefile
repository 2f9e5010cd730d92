# The two commands of the README:  make demo  and  make test.  Both create .venv themselves.
VENV ?= .venv
PY := $(VENV)/bin/python
# A CPU build of torch lies on these machines' disk; with CUDA, install your own torch into .venv first
# (it is kept), or run e.g.  make test TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cu124"
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: setup lint test demo demo-headless clean chromium

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install $(TORCH_SPEC)
	$(PY) -m pip install -e ".[test]"
	touch $@

# Debian's chromium for the browser tests (Playwright drives it; it never downloads a browser of its own).
# Installed when missing and running as root (CI); elsewhere the browser tests skip and say why.
chromium:
	@if command -v chromium >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	else echo "chromium is missing and this is not root: the browser tests will be skipped"; fi

setup: $(VENV)/.installed chromium

# ruff's rules and mypy --strict are set in pyproject.toml; a finding fails the test command.
lint: setup
	$(PY) -m ruff check kernel_server overmind_jupyter tests benchmarks notebooks scripts
	$(PY) -m mypy

test: lint
	$(PY) -m pytest $(PYTEST_ARGS)

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
