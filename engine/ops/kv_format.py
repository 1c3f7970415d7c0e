"""How a KV cache stores its keys and values: float32, float16, bfloat16, or int8 rows with a scale.

Every cache tensor is [num_blocks, block_size, H_kv, row]. For float32, float16 and bfloat16 a row is
the head's D values in that dtype. For int8 a row is D int8 values followed by their float32 scale
(4 bytes), so row = D + 4: one scale per token and head, symmetric (value = q * scale, q in -127..127,
scale = the row's largest magnitude / 127). Keeping the scale in the row keeps every layer at one
tensor per K and V, so block tables, the prefix cache and every kernel's cache pointer are the same
for all formats; a kernel reads a row and its scale from one cache line.

`store` writes new keys or values into their slots in the cache's format; `read` turns rows back
into a float dtype. The native kernels (engine/ops/decode_attention.c, engine/ops/fused_decode.c) and
the Triton kernels do the same per row; tests/unit/test_kv_format.py holds them to these functions.
"""

from __future__ import annotations

import torch

from engine.config import KV_CACHE_DTYPES, EngineConfig

KV_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int8": torch.int8}
# The id each format has in the native kernels (the KV_* enum of engine/ops/decode_attention.c).
NATIVE_FORMAT_IDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.int8: 3}
INT8_SCALE_BYTES = 4  # one float32 per row
INT8_MAX = 127
# Weight quantizations under which auto picks a 16-bit cache on CPU (the rounding of the weights
# dwarfs a 16-bit cache's); unquantized float32 keeps a float32 cache, so that mode stays exact.
_QUANTIZED_WEIGHTS = ("int8", "gguf")


def resolve_kv_cache_dtype(kv_cache_dtype: str, device: str, dtype: str, quantization: str) -> str:
    """The concrete format `auto` stands for (other values are returned as they are).

    auto: on CUDA the model's dtype; on CPU float16 where the weights are quantized (int8 or GGUF
    blocks: half the bytes of a float32 cache, the default of llama.cpp), and the model's dtype
    where they are not (float32 with no quantization is the mode whose tokens equal transformers')."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    if kv_cache_dtype != "auto":
        return kv_cache_dtype
    if device.startswith("cuda") or quantization not in _QUANTIZED_WEIGHTS:
        return dtype
    return "float16"


def kv_cache_dtype_of(config: EngineConfig) -> str:
    """The format an engine built from `config` keeps its KV cache in."""
    return resolve_kv_cache_dtype(config.kv_cache_dtype, config.device, config.dtype, config.quantization)


def row_bytes(kv_cache_dtype: str, head_dim: int) -> int:
    """Bytes of one token's key (or value) for one KV head."""
    return row_length(kv_cache_dtype, head_dim) * KV_TORCH_DTYPES[kv_cache_dtype].itemsize


def row_length(kv_cache_dtype: str, head_dim: int) -> int:
    """The last dimension of a cache tensor in this format."""
    return head_dim + INT8_SCALE_BYTES if kv_cache_dtype == "int8" else head_dim


def allocate(
    kv_cache_dtype: str, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, device: torch.device
) -> torch.Tensor:
    """One zeroed cache tensor [num_blocks, block_size, H_kv, row] (keys or values of one layer slot)."""
    shape = (num_blocks, block_size, num_kv_heads, row_length(kv_cache_dtype, head_dim))
    return torch.zeros(shape, dtype=KV_TORCH_DTYPES[kv_cache_dtype], device=device)


def format_of_dtype(dtype: torch.dtype) -> str:
    """The KV_CACHE_DTYPES name of a float dtype's cache (or of int8's)."""
    return {v: k for k, v in KV_TORCH_DTYPES.items()}[dtype]


def head_dim_of(cache: torch.Tensor) -> int:
    """The head size D a cache tensor holds (its last dimension, less the scale for int8)."""
    return cache.shape[-1] - INT8_SCALE_BYTES if cache.dtype == torch.int8 else cache.shape[-1]


def split_int8(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An int8 cache's views: its values [..., D] (int8) and its scales [..., 1] (float32)."""
    head_dim = head_dim_of(cache)
    return cache[..., :head_dim], cache[..., head_dim:].view(torch.float32)


def kernel_views(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What a Triton kernel reads a cache through: its values [..., D] and its scales [..., 1] (int8), or the
    cache and a stand-in for the scales that the kernel never reads (the cache itself, other formats)."""
    return split_int8(cache) if cache.dtype == torch.int8 else (cache, cache)


def quantize_int8(values: torch.Tensor) -> torch.Tensor:
    """Rows [..., D] of any float dtype -> int8 rows [..., D + 4] (values, then their float32 scale).

    The scale is the row's largest magnitude / 127 in float32; each value is x / scale rounded to the
    nearest integer, ties to even (a zero row stores zeros and scale 0)."""
    x = values.float()
    scale = x.abs().amax(dim=-1, keepdim=True) / INT8_MAX
    q = torch.where(scale > 0, x / scale, 0.0).round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return torch.cat([q, scale.view(torch.int8)], dim=-1)


def read(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows [..., row] of any format -> their values [..., D] in `dtype`."""
    if rows.dtype != torch.int8:
        return rows.to(dtype)
    values, scales = split_int8(rows.contiguous())
    return (values.float() * scales).to(dtype)


def encode(values: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """New keys or values [..., D] as rows in a cache of `cache_dtype`."""
    if cache_dtype == torch.int8:
        return quantize_int8(values)
    return values.to(cache_dtype)


def store(cache: torch.Tensor, values: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write new keys or values [T, H_kv, D] into their cache slots [T] in the cache's format."""
    num_kv_heads = values.shape[1]
    cache.view(-1, num_kv_heads, cache.shape[-1]).index_copy_(0, slot_mapping, encode(values, cache.dtype))
