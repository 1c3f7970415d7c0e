# kvserve: the two commands a newcomer needs are `make serve` and `make test`.
# Every target is idempotent: `install` re-runs pip only when pyproject.toml changed,
# `models` only verifies the cached models (a fresh fetch happens once, or after corruption).

PYTHON ?= python3
VENV ?= .venv
# torch first and pinned: this exact version installs the CPU wheel that lies on disk here;
# an unpinned torch would pull a multi-GB CUDA build. The Dockerfile overrides these two.
TORCH_SPEC ?= torch==2.13.0
TORCH_PIP_ARGS ?=
EXTRAS ?= dev
DEFAULT_MODELS ?= smollm2-135m-instruct all-minilm-l6-v2
ARGS ?=
PYTEST_ARGS ?=

BIN := $(VENV)/bin
STAMP := $(VENV)/.kvserve-installed$(if $(EXTRAS),-$(EXTRAS))

.DEFAULT_GOAL := help
.PHONY: help install models serve test bench soak lint clean

help:
	@echo "make serve   install, pull the default models, run the server (ARGS='--port 8001 ...')"
	@echo "make test    install, pull the default models, run the test suite (PYTEST_ARGS='-k ...')"
	@echo "make install create $(VENV) with torch ($(TORCH_SPEC)) and kvserve[$(EXTRAS)]"
	@echo "make models  pull the default models into the cache (\$$KVSERVE_HOME or ~/.cache/kvserve)"
	@echo "make bench   run the benchmark suite against a server it starts"
	@echo "make soak    a mixed load against a server it starts, then a leak check (ARGS='--requests 300 ...')"
	@echo "make lint    ruff check"

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --disable-pip-version-check $(TORCH_PIP_ARGS) '$(TORCH_SPEC)'
	$(BIN)/python -m pip install --disable-pip-version-check -e '.$(if $(EXTRAS),[$(EXTRAS)])'
	touch $@

models: install
	$(BIN)/kvserve pull $(DEFAULT_MODELS)

serve: install models
	$(BIN)/kvserve serve $(ARGS)

test: install models
	$(BIN)/python -m pytest $(PYTEST_ARGS)

bench: install models
	$(BIN)/python -m clients.bench_suite $(ARGS)

soak: install models
	$(BIN)/python -m clients.soak $(ARGS)

lint: install
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
