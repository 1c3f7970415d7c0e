#!/usr/bin/env bash
# What a newcomer waits for: a clean clone's `make serve`, from nothing to the first chat answer, with an empty
# model cache; then the virtualenv's size on disk. Prints one line per phase.
#
#   bash scripts/fresh_serve.sh            # this checkout's HEAD
#   bash scripts/fresh_serve.sh ff1af92    # any commit, to compare
#
# pip's own cache is left as it is (a second run on one machine downloads less than a fresh machine would).
set -euo pipefail
REV=${1:-HEAD}
PORT=${PORT:-8199}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=$(mktemp -d)
trap 'kill -- -$SERVER_PGID 2>/dev/null || true; rm -rf "$WORK"' EXIT
SERVER_PGID=

git -C "$ROOT" worktree add -q --detach "$WORK/clone" "$REV"
trap 'kill -- -$SERVER_PGID 2>/dev/null || true; git -C "$ROOT" worktree remove --force "$WORK/clone"; rm -rf "$WORK"' EXIT
cd "$WORK/clone"
SECONDS=0
set -m
KVSERVE_HOME="$WORK/home" make serve ARGS="--port $PORT" >"$WORK/serve.log" 2>&1 &
SERVER_PGID=$!
set +m
phase() { printf '%-28s %5d s\n' "$1" "$SECONDS"; }

until [ -x .venv/bin/kvserve ] && ls .venv/.kvserve-* >/dev/null 2>&1; do sleep 1; done
phase "installed"
until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do
    kill -0 "$SERVER_PGID" 2>/dev/null || { tail -20 "$WORK/serve.log"; exit 1; }
    sleep 1
done
phase "models pulled and loaded"
curl -sf "http://127.0.0.1:$PORT/v1/chat/completions" -H 'Content-Type: application/json' \
    -d '{"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}' >/dev/null
phase "first chat answer"
echo "virtualenv: $(du -sh .venv | cut -f1) ($(.venv/bin/python -m pip list --disable-pip-version-check 2>/dev/null | tail -n +3 | wc -l) distributions)"
echo "models: $(du -sh "$WORK/home" | cut -f1)"
