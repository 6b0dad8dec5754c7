# Two commands do all the set-up on a fresh machine:
#   make demo   create .venv, install genq, run the end-to-end demo on simulated GPUs
#   make test   install the test extras and run the tests against a real Redis
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test bench bench-eta install clean mutation

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

# Mutation testing of the result commit path (worker/results.py) with mutmut, run against the fast
# tests that drive it (tests/test_commit.py), then the Lua commit script's own mutants
# (tests/lua_mutants.py: mutmut does not look inside the string); config in pyproject.toml [tool.mutmut], survivors
# explained in docs/mutation.md. Runs in a copy of the tree (.genq-mutation/, git-ignored) in which
# worker/ is moved into genq/worker, because mutmut copies the genq/worker symlink as a plain folder.
MUTATION_DIR := .genq-mutation

$(VENV)/.mutation-extras: $(VENV)/.test-extras
	$(BIN)/pip install --quiet -e '.[test,mutation]'
	touch $@

mutation: $(VENV)/.mutation-extras
	rm -rf $(MUTATION_DIR) && mkdir -p $(MUTATION_DIR)
	git ls-files -co --exclude-standard | tar cf - -T - | tar xf - -C $(MUTATION_DIR)
	cd $(MUTATION_DIR) && rm genq/worker && mv worker genq/worker && \
	  ../$(BIN)/mutmut run --max-children $${MUTATION_JOBS:-2} > mutmut-run.log 2>&1; \
	  ../$(BIN)/mutmut export-cicd-stats > /dev/null && ../$(BIN)/python -c \
	  "import json; s = json.load(open('mutants/mutmut-cicd-stats.json')); \
	  dead = s['killed'] + s['timeout'] + s['suspicious'] + s['segfault']; \
	  print(f\"mutation score {dead}/{s['total']} ({100 * dead / max(s['total'], 1):.0f}%): {s}\")"; \
	  ../$(BIN)/mutmut results; \
	  ../$(BIN)/python tests/lua_mutants.py .
