"""Decode attention over the paged cache: the native kernel (decode_attention.c).

engine/runner/attention.py calls it for decode-only steps on float32 CPU tensors; its
torch path is the reference, and tests/unit/test_paged_attention.py holds them equal.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from engine.ops.loader import load_function


@functools.cache
def decode_attention_kernel():
    """The ctypes function kv_decode_attention, or None when the torch path must run."""
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, ctypes.c_float, ctypes.c_int]
    return load_function("decode_attention", "kv_decode_attention", argtypes, ctypes.c_int)


def can_run(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    on_cpu_float32 = query.device.type == "cpu" and query.dtype == key_cache.dtype == torch.float32
    return on_cpu_float32 and decode_attention_kernel() is not None


def decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key_blocks: torch.Tensor,
    visible: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """query [B, H_q, D] (one token per sequence) -> [B, H_q, D].

    key_blocks: int64 [B, N]; visible: bool [B, N * block_size] or None (all visible).
    """
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    query = query.contiguous()
    key_blocks = key_blocks.contiguous()
    mask = visible.contiguous().view(torch.uint8) if visible is not None else None
    out = torch.empty_like(query)
    status = decode_attention_kernel()(
        query.data_ptr(),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        key_blocks.data_ptr(),
        mask.data_ptr() if mask is not None else None,
        out.data_ptr(),
        num_seqs,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        key_blocks.shape[1],
        scale,
        torch.get_num_threads(),
    )
    if status != 0:
        raise MemoryError("the decode attention kernel could not allocate its score buffer")
    return out
