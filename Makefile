# Two entry points: `make demo` (prefix reuse end to end) and `make test` (ruff, mypy --strict,
# pytest). Both set up .venv on first use, the demo with only what it needs. torch is pinned to the
# CPU build first so that pip never resolves a bare `torch` requirement to a multi-GB CUDA build.
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0

PIP := $(BIN)/python -m pip install -q --disable-pip-version-check

# What the demo needs: torch, then the package with its transformers extra.
$(VENV)/.installed-demo: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) torch==$(TORCH_VERSION)
	$(PIP) -e '.[transformers]'
	touch $@

# What the tests need on top: the dev tools, and LMCache (the reference) for the differential test
# and benchmarks; --no-deps keeps torch as it is.
$(VENV)/.installed: $(VENV)/.installed-demo
	$(PIP) -e '.[dev]'
	$(PIP) --no-deps lmcache==0.4.1
	touch $@

.PHONY: setup demo test bench redis-server
setup: $(VENV)/.installed

# The Redis tier is tested against a real server: Debian's redis-server package (a maintained
# build of a current Redis, one apt-get on the Debian machines this project runs on; Valkey is
# used instead when it is installed).
redis-server:
	@command -v valkey-server >/dev/null || command -v redis-server >/dev/null || \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null)

demo: $(VENV)/.installed-demo
	$(BIN)/python examples/prefix_reuse_demo.py

test: $(VENV)/.installed redis-server
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/pytest

bench: $(VENV)/.installed
	$(BIN)/python benchmarks/groups.py
	$(BIN)/python benchmarks/transfer.py
	$(BIN)/python benchmarks/store.py
	$(BIN)/python benchmarks/reuse.py
