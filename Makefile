# Two commands do all the set-up on a fresh machine:
#   make demo   create .venv, install genq, run the end-to-end demo on simulated GPUs
#   make test   install the test extras and run the tests against a real Redis
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test test-llamacpp bench bench-eta install clean

$(BIN)/genq: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e .
	touch $@

$(VENV)/.test-extras: $(BIN)/genq
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

install: $(BIN)/genq

demo: $(BIN)/genq
	scripts/ensure-redis
	$(BIN)/genq demo

test: $(VENV)/.test-extras
	$(BIN)/python -m pytest

bench: $(BIN)/genq
	scripts/ensure-redis
	$(BIN)/python bench/saturation.py

bench-eta: $(BIN)/genq
	scripts/ensure-redis
	$(BIN)/python bench/eta_bench.py

clean:
	rm -rf $(VENV) *.egg-info demo-out

# genq against a real llama.cpp llama-server on CPU (tiny random model): builds
# llama-server once from the llama-cpp-python sdist into ~/.cache/genq-llamacpp,
# then runs 300 prompts with several settings (minutes; not part of `make test`).
# make_model.py needs numpy in python3. See README "Real engines".
test-llamacpp: $(BIN)/genq
	scripts/llamacpp/build.sh
	$(BIN)/python scripts/llamacpp/bench.py
