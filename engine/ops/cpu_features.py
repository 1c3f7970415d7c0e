"""The CPU's SIMD features that decide which kernels and which product dtype run, read once per process.

Linux names them in /proc/cpuinfo's `flags` line; elsewhere (macOS, Windows) torch's own capability check
stands in (`AVX512` / `AVX2`), which says nothing of VNNI, BF16 or AMX, so those paths stay off there.
The names are the kernel's (`avx512_vnni`, `avx512_bf16`, `amx_bf16`), so a log line or a benchmark table
can be compared with `grep flags /proc/cpuinfo` on the machine it came from.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

# The features any kernel or product choice here depends on, in the order they are logged.
KNOWN = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx_vnni",
    "avx512_bf16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)
# What torch's capability check implies where /proc/cpuinfo cannot be read.
_FROM_TORCH = {
    "AVX2": ("avx2", "fma", "f16c"),
    "AVX512": ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl"),
}


def parse_cpuinfo(text: str) -> tuple[str, ...]:
    """The KNOWN features named by the first `flags` line of /proc/cpuinfo's text, in KNOWN order."""
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return tuple(f for f in KNOWN if f in flags)
    return ()


@functools.cache
def cpu_features() -> tuple[str, ...]:
    """This machine's KNOWN features (from /proc/cpuinfo, else from torch's capability check)."""
    try:
        found = parse_cpuinfo(Path("/proc/cpuinfo").read_text())
    except OSError:
        found = ()
    return found or _FROM_TORCH.get(torch.backends.cpu.get_cpu_capability(), ())


def has_bf16_products(features: tuple[str, ...] | None = None) -> bool:
    """Whether bfloat16 matrix products run in hardware (AVX-512 BF16 or AMX), several times float32's rate."""
    present = cpu_features() if features is None else features
    return "avx512_bf16" in present or "amx_bf16" in present
