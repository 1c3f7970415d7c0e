"""Whether this machine must build the native kernels (engine/ops/): gcc on PATH and an AVX2 CPU.

Where it must, the tests assert each kernel loads, so a broken build cannot fall back unnoticed.
"""

from __future__ import annotations

import shutil

import pytest
import torch

KERNELS_EXPECTED = shutil.which("gcc") is not None and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
needs_kernels = pytest.mark.skipif(not KERNELS_EXPECTED, reason="needs gcc and an AVX2 CPU")
