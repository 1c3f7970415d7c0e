# kvserve in a container: serves both default models offline (they are baked in at build time).
#
#   docker build -t kvserve .                                   # CPU image (default)
#   docker build -t kvserve:cuda --build-arg VARIANT=cuda .     # NVIDIA GPUs (run with --gpus all)
#   make wheelhouse && docker build --build-arg WHEELHOUSE=1 -t kvserve .   # no network at all
#   docker run -p 8000:8000 kvserve
#   docker run -p 8000:8000 -e KVSERVE_API_KEY=secret -e KVSERVE_MAX_NUM_SEQS=32 kvserve
#
# Layers, from the least to the most often changed: the Python dependencies (deploy/requirements.lock),
# the models, the native kernels, then the source. Editing the source rebuilds only the last, small layer.
# scripts/test_image.sh builds this image and checks it in running containers.

# Base images pinned by digest (Docker Hub's python:3.11-bookworm and python:3.11-slim-bookworm; refresh with
# `docker buildx imagetools inspect python:3.11-slim-bookworm`). The build stages need gcc, which the full
# image has and the slim one does not: the runtime image has no compiler.
ARG BUILD_IMAGE=python:3.11-bookworm@sha256:a8f8fbe1a0edc9e4dddafa64ba73f7e04be7be5ebc23f332362e779e0a2e4e52
ARG PYTHON_IMAGE=python:3.11-slim-bookworm@sha256:d29f48a31a8b408ed19272ca1e7b10ebae13b240a27e862d3d4217c528e2e0c3

# ---------------------------------------------------------------- deps: the venv, from the lock only
FROM ${BUILD_IMAGE} AS deps

# cpu or cuda: which PyTorch wheel index the pinned torch comes from
ARG VARIANT=cpu
ARG TORCH_VERSION=2.13.0
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
ARG TORCH_CUDA_INDEX=https://download.pytorch.org/whl/cu128
# A PyPI mirror (pip reads these build arguments from the environment): --build-arg PIP_INDEX_URL=https://...
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_TRUSTED_HOST
# Extra CA certificates (a TLS-intercepting proxy): a folder or file of PEM `*.crt` in the build context.
ARG CA_CERTIFICATES=deploy/ca-certificates
# 1: install only from deploy/wheelhouse (`make wheelhouse`), with no network.
ARG WHEELHOUSE=0
# "ray": with the Ray Serve extra (deploy/requirements-ray.lock), for `kvserve serve --replicas` and KubeRay.
ARG EXTRAS=

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
    SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt

COPY ${CA_CERTIFICATES} /usr/local/share/ca-certificates/kvserve/
RUN update-ca-certificates

WORKDIR /opt/kvserve
COPY deploy/wheelhouse/ /opt/wheelhouse/
COPY deploy/requirements*.lock ./deploy/

# torch first, from the index that matches VARIANT (its shared dependencies held to the lock), then the lock.
RUN set -e; \
    case "$VARIANT" in \
      cpu) index="$TORCH_CPU_INDEX" ;; \
      cuda) index="$TORCH_CUDA_INDEX" ;; \
      *) echo "VARIANT must be cpu or cuda, not $VARIANT" >&2; exit 1 ;; \
    esac; \
    if [ "$WHEELHOUSE" = 1 ]; then \
      export PIP_NO_INDEX=1 PIP_FIND_LINKS=/opt/wheelhouse; torch_index=""; \
    else \
      torch_index="--index-url $index --extra-index-url ${PIP_INDEX_URL:-https://pypi.org/simple}"; \
    fi; \
    locks="-r deploy/requirements.lock"; \
    case "$EXTRAS" in \
      "") ;; \
      ray) locks="-r deploy/requirements-ray.lock" ;; \
      *) echo "EXTRAS must be empty or ray, not $EXTRAS" >&2; exit 1 ;; \
    esac; \
    python -m venv /opt/kvserve/.venv; \
    /opt/kvserve/.venv/bin/pip install -c deploy/requirements.lock $torch_index "torch==$TORCH_VERSION"; \
    /opt/kvserve/.venv/bin/pip install $locks

# ---------------------------------------------------------------- models: `kvserve pull`, RECORD-verified
FROM deps AS models
ARG WHEELHOUSE=0
ENV KVSERVE_HOME=/opt/kvserve/home
# Only what `kvserve pull` runs on (no torch), so a source edit elsewhere never fetches the models again.
COPY engine/__init__.py engine/errors.py ./engine/
COPY engine/hub ./engine/hub
COPY server/__init__.py server/__main__.py ./server/
RUN if [ "$WHEELHOUSE" = 1 ]; then export KVSERVE_PULL_PIP_ARGS="--no-index --find-links /opt/wheelhouse"; fi; \
    /opt/kvserve/.venv/bin/python -m server pull \
 && /opt/kvserve/.venv/bin/python -m server models

# ---------------------------------------------------------------- kernels: every engine/ops/*.c, prebuilt
FROM deps AS kernels
ENV KVSERVE_HOME=/opt/kvserve/home
COPY engine/__init__.py engine/errors.py ./engine/
COPY engine/hub ./engine/hub
COPY engine/ops/__init__.py engine/ops/loader.py engine/ops/cpu_features.py engine/ops/*.c ./engine/ops/
# Built into $KVSERVE_HOME/kernels, keyed by the sources' hash, so the runtime image needs no compiler: every
# instruction-set build (AVX2, and with VNNI), whatever the build machine's CPU; the machine that runs the
# image loads the best one it has, and the log says which at start-up.
RUN /opt/kvserve/.venv/bin/python -c "from engine.ops.loader import SOURCE_DIR, prebuild; \
[prebuild(p.stem) for p in sorted(SOURCE_DIR.glob('*.c'))]" \
 && ls /opt/kvserve/home/kernels

# ---------------------------------------------------------------- runtime
FROM ${PYTHON_IMAGE} AS runtime

RUN groupadd --system --gid 10001 kvserve \
 && useradd --system --uid 10001 --gid kvserve --create-home --home-dir /home/kvserve kvserve

# Same paths as in the build stages: the venv's scripts point at /opt/kvserve/.venv/bin/python.
COPY --from=deps /opt/kvserve/.venv /opt/kvserve/.venv
COPY --from=models /opt/kvserve/home/models /opt/kvserve/home/models
COPY --from=kernels /opt/kvserve/home/kernels /opt/kvserve/home/kernels

WORKDIR /opt/kvserve
COPY pyproject.toml README.md ./
COPY engine ./engine
COPY server ./server
COPY clients ./clients
# kvserve itself, editable (a few files in the venv), from the setuptools the lock pinned: no network.
RUN /opt/kvserve/.venv/bin/pip install --no-cache-dir --no-index --no-deps --no-build-isolation \
      --disable-pip-version-check --quiet -e /opt/kvserve \
 && rm -rf /opt/kvserve/kvserve.egg-info \
 && mkdir -p /opt/kvserve/cache/torchinductor && chmod 1777 /opt/kvserve/cache/torchinductor

ENV PATH=/opt/kvserve/.venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    KVSERVE_HOME=/opt/kvserve/home \
    KVSERVE_HOST=0.0.0.0 \
    KVSERVE_PORT=8000 \
    HF_HOME=/home/kvserve/.cache/huggingface \
    HF_HUB_OFFLINE=1 \
    # torch creates its compile cache folder on import (under tempfile.gettempdir(), which fails when no folder
    # is writable): one made at build time lets `docker run --read-only` work without a tmpfs.
    TORCHINDUCTOR_CACHE_DIR=/opt/kvserve/cache/torchinductor

USER kvserve
WORKDIR /home/kvserve
EXPOSE 8000

# /health answers 503 while the models load and 200 once serving. The check finds the port the server was
# started with (`--port`, else KVSERVE_PORT, else 8000) from the server's own command line.
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
  CMD ["python", "-m", "server.healthcheck"]

CMD ["kvserve", "serve"]
