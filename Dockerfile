# syntax=docker/dockerfile:1
# kvserve in a container: serves both default models offline (they are pulled at build time).
#
#   docker build -t kvserve .                                   # CPU image (default)
#   docker build -t kvserve:cuda --build-arg VARIANT=cuda .     # NVIDIA GPUs (run with --gpus all)
#   docker run -p 8000:8000 kvserve
#   docker run -p 8000:8000 -e KVSERVE_API_KEY=secret -e KVSERVE_MAX_NUM_SEQS=32 kvserve
#
# The build runs the same commands as a developer machine: `make install` and `make models`
# (which is `kvserve pull`); tests/packaging/test_dockerfile.py checks that it does.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---------------------------------------------------------------- build: venv + models
FROM ${PYTHON_IMAGE} AS build

# cpu or cuda: which PyTorch wheel index the pinned torch comes from
ARG VARIANT=cpu
ARG TORCH_VERSION=2.13.0
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
ARG TORCH_CUDA_INDEX=https://download.pytorch.org/whl/cu128

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    KVSERVE_HOME=/opt/kvserve/home

RUN apt-get update \
 && apt-get install -y --no-install-recommends make gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/kvserve
COPY pyproject.toml Makefile README.md ./
COPY engine ./engine
COPY server ./server
COPY clients ./clients

# No dev extras in the image; torch from the index that matches VARIANT (PyPI for everything else).
RUN case "$VARIANT" in \
      cpu) index="$TORCH_CPU_INDEX" ;; \
      cuda) index="$TORCH_CUDA_INDEX" ;; \
      *) echo "VARIANT must be cpu or cuda, not $VARIANT" >&2; exit 1 ;; \
    esac \
 && make install VENV=/opt/kvserve/.venv EXTRAS= TORCH_SPEC="torch==$TORCH_VERSION" \
      TORCH_PIP_ARGS="--index-url $index --extra-index-url https://pypi.org/simple"

# The default models, RECORD-verified, into $KVSERVE_HOME: the container needs no network to serve.
RUN make models VENV=/opt/kvserve/.venv EXTRAS= \
 && /opt/kvserve/.venv/bin/kvserve models

# Every native CPU kernel (engine/ops/*.c), built into $KVSERVE_HOME/kernels so the runtime image needs
# no compiler (on a CPU without AVX2, or in the cuda variant, they are skipped and the torch paths run).
RUN /opt/kvserve/.venv/bin/python -c "from engine.ops.loader import SOURCE_DIR, load_library; \
[load_library(p.stem) for p in sorted(SOURCE_DIR.glob('*.c'))]"

# ---------------------------------------------------------------- runtime
FROM ${PYTHON_IMAGE} AS runtime

RUN groupadd --system --gid 10001 kvserve \
 && useradd --system --uid 10001 --gid kvserve --create-home --home-dir /home/kvserve kvserve

# Same path as in the build stage: the venv's scripts and the editable install point there.
COPY --from=build /opt/kvserve /opt/kvserve

ENV PATH=/opt/kvserve/.venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    KVSERVE_HOME=/opt/kvserve/home \
    KVSERVE_HOST=0.0.0.0 \
    KVSERVE_PORT=8000 \
    HF_HOME=/home/kvserve/.cache/huggingface \
    HF_HUB_OFFLINE=1

USER kvserve
WORKDIR /home/kvserve
EXPOSE 8000

# /health answers 503 while the models load and 200 once serving; python, because the slim image has no curl.
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('KVSERVE_PORT', '8000'), timeout=4)"]

CMD ["kvserve", "serve"]
