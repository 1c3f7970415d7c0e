"""RMSNorm: torch.rms_norm (the reference) and the native kernel rms_norm.c for float32 CPU tensors.

tests/unit/test_rms_norm_kernel.py holds the two equal.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from engine.ops.loader import I64, PTR, bind


@functools.cache
def _kernel():
    """kv_rms_norm(x, weight, out, rows, dim, eps), or None when the library cannot be used."""
    return bind("rms_norm", "kv_rms_norm", [PTR, PTR, PTR, I64, I64, ctypes.c_float], None)


def available() -> bool:
    """Whether rms_norm_native can run on this machine."""
    return _kernel() is not None


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] -> normalised over D and scaled by weight [D].

    One fused op on GPUs; it accumulates in float32 whatever the activations' dtype.
    """
    return torch.rms_norm(x, weight.shape, weight, eps)


def rms_norm_native(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm_torch for float32 CPU x and weight, through the native kernel."""
    x, weight = x.contiguous(), weight.contiguous()
    out = torch.empty_like(x)
    dim = x.shape[-1]
    _kernel()(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // dim, dim, eps)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The native kernel for float32 CPU tensors where it loads, torch otherwise."""
    on_cpu_float32 = x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32
    if on_cpu_float32 and available():
        return rms_norm_native(x, weight, eps)
    return rms_norm_torch(x, weight, eps)
