"""Whether this machine must build the native kernels (engine/ops/): gcc on PATH, an AVX2 CPU,
and KVSERVE_NATIVE_KERNELS not set to 0.

Where it must, the tests assert each kernel loads, so a broken build cannot fall back unnoticed.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

KERNELS_EXPECTED = (
    shutil.which("gcc") is not None
    and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    and os.environ.get("KVSERVE_NATIVE_KERNELS", "1") != "0"
)
needs_kernels = pytest.mark.skipif(not KERNELS_EXPECTED, reason="needs gcc, an AVX2 CPU and native kernels on")
