"""scripts/gpu_check.sh --dry-run: the GPU check's steps on the CPU in tiny sizes, so the program a lent GPU runs
is known to work before the GPU is there (about 45 s: Triton's interpreter and the default model)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_the_dry_run_checks_every_kernel_case_and_measures_every_stream_count():
    env = {**os.environ, "PYTHON": sys.executable}
    result = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--dry-run"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    kernel_rows = [line for line in lines if line.startswith(("| decode |", "| prefill |"))]
    assert len(kernel_rows) == 8  # 2 kernels x float16 / bfloat16 queries x 16-bit / int8 caches
    assert all(row.endswith(("| ok |", "| not checkable in the interpreter |")) for row in kernel_rows)
    assert sum("| ok |" in row for row in kernel_rows) == 6  # all but the interpreter's bfloat16 tl.dot
    assert any(line.startswith("| decode, 2 streams |") for line in lines)
    assert any(line.startswith("| prefill, 16 tokens |") for line in lines)
