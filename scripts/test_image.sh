#!/usr/bin/env bash
# Builds the kvserve image with no network and checks it in running containers.
#
#   make test-image                      # or: PYTHON=.venv/bin/python bash scripts/test_image.sh
#
# 1. A Docker engine: the one DOCKER_HOST (or the default socket) answers on, else Debian's docker.io,
#    installed if missing and started here with no bridge and no iptables (needs root); containers use
#    the host network and never publish ports.
# 2. The base images: the Dockerfile's pinned ones when a registry gives them, else local stand-ins of the
#    same Debian bookworm + Python 3.11 made with debootstrap + docker import (a slim runtime base, and a
#    build base that adds gcc and make).
# 3. `make wheelhouse`, then `docker build --network none --build-arg WHEELHOUSE=1`: every package comes
#    from deploy/wheelhouse, so the build is hermetic. Then a rebuild after a one-line source edit, timed,
#    with the layers it changed.
# 4. scripts/image_checks.py: the API, the user, the prebuilt kernels, HEALTHCHECK, read-only root,
#    --network none, docker stop mid-stream and while loading, and the image size.
#
# KVSERVE_IMAGE_TEST_DIR (default /tmp/kvserve-image-test) keeps the engine's data and the stand-in
# rootfs between runs, so a second run reuses the base images and the build cache.
#
# --ray also builds the `EXTRAS=ray` image (its wheelhouse from deploy/requirements-ray.lock) and checks
# `kvserve serve --replicas 2` in a container; CI leaves it out for time (a second venv layer to build).
set -euo pipefail
cd "$(dirname "$0")/.."

WITH_RAY=0
for arg in "$@"; do
  case "$arg" in
    --ray) WITH_RAY=1 ;;
    *) echo "unknown argument: $arg (known: --ray)" >&2; exit 2 ;;
  esac
done

PYTHON=${PYTHON:-.venv/bin/python}
IMAGE=${IMAGE:-kvserve:test}
WORK=${KVSERVE_IMAGE_TEST_DIR:-/tmp/kvserve-image-test}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
STANDIN_RUNTIME=kvserve-base:bookworm-python3.11-slim
STANDIN_BUILD=kvserve-base:bookworm-python3.11-build

log() { echo "[test_image $(date +%H:%M:%S)] $*"; }
seconds_since() { echo $(($(date +%s) - $1)); }
mkdir -p "$WORK"
started_all=$(date +%s)

# ------------------------------------------------------------------ 1. a Docker engine
DOCKERD_PID=
stop_dockerd() {
  if [ -n "$DOCKERD_PID" ]; then
    kill "$DOCKERD_PID" 2>/dev/null || true
    wait "$DOCKERD_PID" 2>/dev/null || true
  fi
}
trap stop_dockerd EXIT

if docker info >/dev/null 2>&1; then
  log "using the running Docker engine ($(docker info --format '{{.ServerVersion}}'))"
else
  if [ "$(id -u)" != 0 ]; then
    echo "no Docker engine answers, and starting one needs root" >&2
    exit 1
  fi
  if ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null; then
    log "installing Debian's docker.io and debootstrap"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      docker.io debootstrap ca-certificates >/dev/null
  fi
  export DOCKER_HOST="unix://$WORK/docker.sock"
  dockerd --iptables=false --ip6tables=false --bridge=none \
    --data-root "$WORK/docker" --exec-root "$WORK/exec" --pidfile "$WORK/dockerd.pid" \
    -H "$DOCKER_HOST" >"$WORK/dockerd.log" 2>&1 &
  DOCKERD_PID=$!
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 0.5; done
  docker info >/dev/null 2>&1 || { tail -20 "$WORK/dockerd.log" >&2; exit 1; }
  log "started dockerd $(docker info --format '{{.ServerVersion}}') at $DOCKER_HOST"
fi

# ------------------------------------------------------------------ 2. base images
BUILD_ARGS=()
pinned() { sed -n "s/^ARG $1=//p" Dockerfile; }
if docker image inspect "$(pinned BUILD_IMAGE)" "$(pinned PYTHON_IMAGE)" >/dev/null 2>&1 \
   || { docker pull -q "$(pinned BUILD_IMAGE)" && docker pull -q "$(pinned PYTHON_IMAGE)"; } >/dev/null 2>&1; then
  log "base images: the pinned $(pinned PYTHON_IMAGE) and $(pinned BUILD_IMAGE)"
else
  if ! docker image inspect "$STANDIN_RUNTIME" >/dev/null 2>&1; then
    log "no registry: making a Debian bookworm + Python 3.11 stand-in base with debootstrap"
    command -v debootstrap >/dev/null || {
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null; }
    t=$(date +%s)
    rm -rf "$WORK/rootfs"
    debootstrap --variant=minbase --include=python3,python3-venv,python-is-python3,ca-certificates \
      bookworm "$WORK/rootfs" "$DEBIAN_MIRROR" >"$WORK/debootstrap.log" 2>&1 \
      || { tail -20 "$WORK/debootstrap.log" >&2; exit 1; }
    rm -rf "$WORK/rootfs/var/cache/apt/archives/"*.deb "$WORK/rootfs/var/lib/apt/lists/"*
    tar -C "$WORK/rootfs" -c . | docker import -c 'ENV LANG=C.UTF-8' -c 'CMD ["python3"]' - "$STANDIN_RUNTIME" >/dev/null
    rm -rf "$WORK/rootfs"
    log "stand-in runtime base $STANDIN_RUNTIME in $(seconds_since "$t") s"
  fi
  if ! docker image inspect "$STANDIN_BUILD" >/dev/null 2>&1; then
    t=$(date +%s)
    printf '%s\n' "FROM $STANDIN_RUNTIME" \
      "RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev make && rm -rf /var/lib/apt/lists/*" \
      | docker build -q --network host -t "$STANDIN_BUILD" - >/dev/null
    log "stand-in build base $STANDIN_BUILD (adds gcc, make) in $(seconds_since "$t") s"
  fi
  BUILD_ARGS+=(--build-arg "BUILD_IMAGE=$STANDIN_BUILD" --build-arg "PYTHON_IMAGE=$STANDIN_RUNTIME")
fi

# ------------------------------------------------------------------ 3. a hermetic build, then a rebuild
t=$(date +%s)
wheelhouse_lock=deploy/requirements.lock
[ "$WITH_RAY" = 1 ] && wheelhouse_lock=deploy/requirements-ray.lock  # a superset: serves both builds
make --no-print-directory wheelhouse PYTHON="$PYTHON" WHEELHOUSE_LOCK="$wheelhouse_lock" >"$WORK/wheelhouse.log" 2>&1 \
  || { tail -20 "$WORK/wheelhouse.log" >&2; exit 1; }
log "wheelhouse: $(find deploy/wheelhouse -name '*.whl' | wc -l) wheels, $(du -sh deploy/wheelhouse | cut -f1) ($(seconds_since "$t") s)"

build() {  # build <context> <tag> [docker build arguments]
  local context=$1 tag=$2
  shift 2
  docker build --network none --build-arg WHEELHOUSE=1 "${BUILD_ARGS[@]}" "$@" -t "$tag" "$context" \
    >"$WORK/build.log" 2>&1 || { tail -40 "$WORK/build.log" >&2; exit 1; }
}
t=$(date +%s)
build . "$IMAGE"
log "built $IMAGE with --network none in $(seconds_since "$t") s"
CHECK_ARGS=()
if [ "$WITH_RAY" = 1 ]; then
  t=$(date +%s)
  build . "$IMAGE-ray" --build-arg EXTRAS=ray
  log "built $IMAGE-ray (EXTRAS=ray) with --network none in $(seconds_since "$t") s"
  CHECK_ARGS+=(--ray-image "$IMAGE-ray")
fi

# A copy of the build context with one comment changed in server/app.py: only the source layers may change.
context="$WORK/edited-context"
rm -rf "$context" && mkdir -p "$context"
cp -al Dockerfile .dockerignore pyproject.toml README.md engine server clients deploy "$context/"
sed -i '1s/^/# an edited comment\n/' "$context/server/app.py"  # sed -i writes a new file: the link breaks
t=$(date +%s)
build "$context" "$IMAGE-edited"
took=$(seconds_since "$t")
rm -rf "$context"
"$PYTHON" - "$IMAGE" "$IMAGE-edited" "$took" <<'EOF'
import json, subprocess, sys
image, edited, took = sys.argv[1:]
def layers(tag):
    return json.loads(subprocess.check_output(["docker", "image", "inspect", "--format", "{{json .RootFS.Layers}}", tag]))
def sizes(tag):  # newest first in docker history; RootFS.Layers is oldest first
    out = subprocess.check_output(["docker", "history", "--no-trunc", "--format", "{{.Size}}\t{{.CreatedBy}}", tag], text=True)
    return out.splitlines()
old, new = layers(image), layers(edited)
same = next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))
changed = len(new) - same
print(f"[test_image] rebuild after a one-line edit of server/app.py: {took} s; {changed} of {len(new)} layers changed")
if changed > 4:
    sys.exit(f"the edit rebuilt {changed} layers: the dependency, model or kernel layers are not cached")
EOF
docker rmi -f "$IMAGE-edited" >/dev/null

# ------------------------------------------------------------------ 4. the image in containers
"$PYTHON" scripts/image_checks.py --image "$IMAGE" "${CHECK_ARGS[@]}"
log "all image checks passed in $(seconds_since "$started_all") s"
