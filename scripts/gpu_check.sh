#!/usr/bin/env bash
# The GPU checks in one run (about 5 minutes on one H200): the GPU-marked tests, then the Triton kernels in
# float16 and bfloat16 (16-bit and int8 caches) against the torch path and a throughput table beside the
# memory-bandwidth roofline (python -m engine.bench.gpu_check).
#
#   bash scripts/gpu_check.sh [--dry-run] [gpu_check's other flags, e.g. --model NAME --bandwidth 3.35e12]
#
# --dry-run runs the same steps on a CPU in tiny sizes (Triton's interpreter); CI runs it.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
status=0
echo "## GPU-marked tests"
if [[ " $* " == *" --dry-run "* ]]; then
    # No CUDA here: the GPU tests are collected and skip, which checks that they still import.
    "$PYTHON" -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_gpu.py || status=$?
else
    "$PYTHON" -m pytest -q -p no:cacheprovider -m gpu || status=$?
fi
echo "## Kernels and throughput"
"$PYTHON" -m engine.bench.gpu_check "$@" || status=$?
exit "$status"
