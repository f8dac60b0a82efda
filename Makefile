# Two entry points: `make demo` (the main job) and `make test` (ruff, mypy --strict, pytest).
# Both set up .venv on first use. torch is pinned to the CPU build first so that pip never
# resolves a bare `torch` requirement to a multi-GB CUDA build.
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check torch==$(TORCH_VERSION)
	$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[dev]'
	# LMCache (the reference) for the differential test and benchmarks; --no-deps keeps torch as is.
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-deps lmcache==0.4.1
	touch $@

.PHONY: setup demo test bench redis-server
setup: $(VENV)/.installed

# The Redis tier is tested against a real server: Debian's redis-server package (a maintained
# build of a current Redis, one apt-get on the Debian machines this project runs on; Valkey is
# used instead when it is installed).
redis-server:
	@command -v valkey-server >/dev/null || command -v redis-server >/dev/null || \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null)

demo: $(VENV)/.installed
	$(BIN)/kvgroups inspect qwen3-next-80b-a3b-thinking --tp 2 --memory 8 --tokens 131072 --seqs 8

test: $(VENV)/.installed redis-server
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/pytest

bench: $(VENV)/.installed
	$(BIN)/python benchmarks/groups.py
	$(BIN)/python benchmarks/transfer.py
	$(BIN)/python benchmarks/store.py
	$(BIN)/python benchmarks/reuse.py
