"""RMSNorm: the native kernel (rms_norm.c) for float32 CPU tensors, torch.rms_norm otherwise.

torch.rms_norm is the reference; tests/unit/test_rms_norm_kernel.py holds the two equal.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from engine.ops.loader import load_function


@functools.cache
def rms_norm_kernel():
    """The ctypes function kv_rms_norm, or None when torch.rms_norm must run."""
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    return load_function("rms_norm", "kv_rms_norm", [ptr, ptr, ptr, i64, i64, ctypes.c_float], None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] -> normalised over D and scaled by weight [D]."""
    kernel = rms_norm_kernel() if x.dtype == torch.float32 and x.device.type == "cpu" else None
    if kernel is None or weight.dtype != torch.float32:
        # One fused op on GPUs; it accumulates in float32 whatever the activations' dtype.
        return torch.rms_norm(x, weight.shape, weight, eps)
    x = x.contiguous()
    out = torch.empty_like(x)
    dim = x.shape[-1]
    kernel(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // dim, dim, eps)
    return out
