"""Decode attention over the paged cache: one query per sequence, in torch and in decode_attention.c.

engine/attention/ routes decode-only steps here. The native kernel
reads the cache in place (float32 CPU tensors); the torch path gathers whole
blocks and runs SDPA (explicit scores with a softcap). Both take an optional
attention-logit softcap (scores s -> softcap * tanh(s / softcap) before the
softmax). tests/unit/test_paged_attention.py holds both equal to the dense reference.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from engine.ops.loader import I64, PTR, bind
from engine.ops.sdpa import sdpa


@functools.cache
def _kernel():
    """kv_decode_attention(...) -> status, or None when the library cannot be used."""
    # query, caches, blocks, mask, out; B, H_q, H_kv, D, block_size, N; scale, softcap (0: off), threads
    argtypes = [PTR] * 6 + [I64] * 6 + [ctypes.c_float, ctypes.c_float, ctypes.c_int]
    return bind("decode_attention", "kv_decode_attention", argtypes, ctypes.c_int)


def available() -> bool:
    """Whether decode_attention_native can run on this machine."""
    return _kernel() is not None


def gather_blocks(cache: torch.Tensor, key_blocks: torch.Tensor) -> torch.Tensor:
    """cache [num_blocks, block_size, H_kv, D], key_blocks int64 [B, N] -> [B, H_kv, N * block_size, D].

    Whole blocks are gathered as 2-D rows, the fastest gather on CPU.
    """
    num_seqs, num_blocks = key_blocks.shape
    _, block_size, num_kv_heads, head_dim = cache.shape
    rows = cache.view(cache.shape[0], -1).index_select(0, key_blocks.reshape(-1))
    return rows.view(num_seqs, num_blocks * block_size, num_kv_heads, head_dim).transpose(1, 2)


def decode_attention_torch(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key_blocks: torch.Tensor,
    visible: torch.Tensor | None,
    scale: float,
    *,
    softcap: float | None = None,
) -> torch.Tensor:
    """query [B, H_q, D] (one token per sequence) -> [B, H_q, D], in torch ops (any device and dtype).

    key_blocks: int64 [B, N]; visible: bool [B, N * block_size] or None (all visible); softcap: None or > 0.
    """
    out = sdpa(
        query.unsqueeze(2),  # [B, H_q, 1, D]
        gather_blocks(key_cache, key_blocks),
        gather_blocks(value_cache, key_blocks),
        visible[:, None, None, :] if visible is not None else None,
        scale,
        softcap=softcap,
    )
    return out.squeeze(2)


def decode_attention_native(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key_blocks: torch.Tensor,
    visible: torch.Tensor | None,
    scale: float,
    *,
    softcap: float | None = None,
) -> torch.Tensor:
    """decode_attention_torch for float32 CPU tensors through the native kernel."""
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    query = query.contiguous()
    key_blocks = key_blocks.contiguous()
    mask = visible.contiguous().view(torch.uint8) if visible is not None else None
    out = torch.empty_like(query)
    status = _kernel()(
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
        softcap if softcap is not None else 0.0,  # the kernel's "off"
        torch.get_num_threads(),
    )
    if status != 0:
        raise MemoryError("the decode attention kernel could not allocate its score buffer")
    return out


def decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key_blocks: torch.Tensor,
    visible: torch.Tensor | None,
    scale: float,
    *,
    softcap: float | None = None,
) -> torch.Tensor:
    """The native kernel for float32 CPU tensors where it loads, torch otherwise."""
    on_cpu_float32 = query.device.type == "cpu" and query.dtype == key_cache.dtype == torch.float32
    if on_cpu_float32 and available():
        return decode_attention_native(query, key_cache, value_cache, key_blocks, visible, scale, softcap=softcap)
    return decode_attention_torch(query, key_cache, value_cache, key_blocks, visible, scale, softcap=softcap)
