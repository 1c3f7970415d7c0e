"""Decode attention over the paged cache: one query per sequence, in torch and in decode_attention.c.

engine/attention/ routes decode-only steps here. The native kernel
reads the cache in place (float32 queries on CPU, a cache in any format of
engine/ops/kv_format.py); the torch path gathers whole blocks, turns them
into the query's dtype and runs SDPA (explicit scores with a softcap). Both take an optional
attention-logit softcap (scores s -> softcap * tanh(s / softcap) before the
softmax). tests/unit/test_paged_attention.py holds both equal to the dense reference.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from engine.ops import kv_format
from engine.ops.loader import I64, PTR, avx512_kernels_allowed, bind
from engine.ops.sdpa import sdpa

# Head sizes the native kernel attends in 512-bit registers where the CPU has AVX-512 (decode_attention_wide.c).
WIDE_HEAD_SIZES = (96, 128, 256)


@functools.cache
def _kernel():
    """kv_decode_attention(...) -> status, or None when the library cannot be used."""
    # query, caches, blocks, mask, out; B, H_q, H_kv, D, block_size, N; scale, softcap (0: off), cache format, threads
    argtypes = [PTR] * 6 + [I64] * 6 + [ctypes.c_float, ctypes.c_float, ctypes.c_int, ctypes.c_int]
    kernel = bind("decode_attention", "kv_decode_attention", argtypes, ctypes.c_int)
    if kernel is not None:
        use_wide_attention("decode_attention", avx512_kernels_allowed())
    return kernel


def use_wide_attention(library: str, on: bool | None) -> bool:
    """Turns on (where the CPU has AVX-512 F, BW and VL) or off the 512-bit key-by-key way for heads of 96, 128 or
    256 values in `library`'s copy of the decode attention (decode_attention, or fused_decode, which includes it),
    or with `on` None leaves it; returns whether it is on. Each library turns it on when it loads, unless
    KVSERVE_NATIVE_ISA names a 256-bit build; other head sizes and CPUs take the 8-wide way."""
    setter = bind(library, "kv_decode_attention_use_wide", [ctypes.c_int], ctypes.c_int)
    return setter is not None and bool(setter(-1 if on is None else int(on)))


def wide_attention() -> bool:
    """Whether decode steps of heads of WIDE_HEAD_SIZES values run the 512-bit way on this machine."""
    return available() and use_wide_attention("decode_attention", None)


def takes_wide(head_dim: int) -> bool:
    """Whether this machine's decode steps attend heads of `head_dim` values in 512-bit registers."""
    return head_dim in WIDE_HEAD_SIZES and wide_attention()


def available() -> bool:
    """Whether decode_attention_native can run on this machine."""
    return _kernel() is not None


@functools.cache
def _store_kernel():
    """kv_store_rows(values, cache, slot_mapping, T, H_kv, D, cache format), or None when it cannot be used."""
    return bind("decode_attention", "kv_store_rows", [PTR] * 3 + [I64] * 3 + [ctypes.c_int], None)


def store_rows_native(cache: torch.Tensor, values: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """kv_format.store for float32 CPU values [T, H_kv, D] through the native kernel (one call, no temporaries)."""
    values, slot_mapping = values.contiguous(), slot_mapping.contiguous()
    num_tokens, num_kv_heads, head_dim = values.shape
    pointers = (values.data_ptr(), cache.data_ptr(), slot_mapping.data_ptr())
    _store_kernel()(*pointers, num_tokens, num_kv_heads, head_dim, kv_format.NATIVE_FORMAT_IDS[cache.dtype])


def store_rows(cache: torch.Tensor, values: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write new keys or values [T, H_kv, D] into their slots in the cache's format: natively for float32 CPU
    values and a contiguous cache where the kernel loads, through kv_format.store otherwise."""
    native = values.device.type == "cpu" and values.dtype == torch.float32 and cache.is_contiguous()
    if native and _store_kernel() is not None:
        store_rows_native(cache, values, slot_mapping)
    else:
        kv_format.store(cache, values, slot_mapping)


def gather_blocks(cache: torch.Tensor, key_blocks: torch.Tensor) -> torch.Tensor:
    """cache [num_blocks, block_size, H_kv, row], key_blocks int64 [B, N] -> [B, H_kv, N * block_size, row]
    (the rows as stored: kv_format.read turns them into values).

    Whole blocks are gathered as 2-D rows, the fastest gather on CPU.
    """
    num_seqs, num_blocks = key_blocks.shape
    _, block_size, num_kv_heads, row = cache.shape
    rows = cache.view(cache.shape[0], -1).index_select(0, key_blocks.reshape(-1))
    return rows.view(num_seqs, num_blocks * block_size, num_kv_heads, row).transpose(1, 2)


def gather_kv(cache: torch.Tensor, key_blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """gather_blocks' keys or values [B, H_kv, N * block_size, D] in `dtype`, from a cache of any format."""
    rows = gather_blocks(cache, key_blocks)
    return rows if rows.dtype == dtype else kv_format.read(rows, dtype)


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
    """query [B, H_q, D] (one token per sequence) -> [B, H_q, D], in torch ops (any device, dtype and
    cache format).

    key_blocks: int64 [B, N]; visible: bool [B, N * block_size] or None (all visible); softcap: None or > 0.
    """
    out = sdpa(
        query.unsqueeze(2),  # [B, H_q, 1, D]
        gather_kv(key_cache, key_blocks, query.dtype),
        gather_kv(value_cache, key_blocks, query.dtype),
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
    """decode_attention_torch for float32 CPU queries through the native kernel (a cache in any format)."""
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
        kv_format.NATIVE_FORMAT_IDS[key_cache.dtype],
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
    """The native kernel for float32 CPU queries where it loads, torch otherwise."""
    on_cpu_float32 = query.device.type == "cpu" and query.dtype == torch.float32
    if on_cpu_float32 and key_cache.is_contiguous() and available():
        return decode_attention_native(query, key_cache, value_cache, key_blocks, visible, scale, softcap=softcap)
    return decode_attention_torch(query, key_cache, value_cache, key_blocks, visible, scale, softcap=softcap)
