"""Paged attention: store new keys/values in their cache slots, then attend over the paged cache.

`paged_attention` picks the kernel for a step: the Triton kernels on CUDA (engine/attention/triton_decode.py,
engine/attention/triton_prefill.py), the native decode kernel for decode-only CPU steps
(engine/ops/decode_attention.py), and `paged_attention_torch` (torch ops only) for everything else.
"""

from __future__ import annotations

import functools
import logging

import torch

from engine.attention.metadata import AttentionMetadata
from engine.attention.prefix_split import prefix_then_causal, split_prefix_length
from engine.ops.decode_attention import decode_attention, gather_kv, store_rows
from engine.ops.sdpa import sdpa

logger = logging.getLogger(__name__)


def write_kv(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store new keys/values [T, H_kv, D] into their cache slots, in the caches' format
    (engine/ops/kv_format.py)."""
    store_rows(key_cache, key, slot_mapping)
    store_rows(value_cache, value, slot_mapping)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of T flat queries [T, H_q, D] over the paged cache -> [T, H_q, D].

    softcap: attention-logit softcapping, every score s (after scaling, before the mask and softmax)
    becoming softcap * tanh(s / softcap); None leaves the scores as they are. Every kernel takes it.

    The new tokens' K/V must already be written (write_kv). On CUDA, with triton installed and
    shapes its kernels take, the Triton kernels run (engine/attention/triton_decode.py for
    decode-only steps, engine/attention/triton_prefill.py for every other step). Otherwise
    decode-only steps run engine/ops/decode_attention.py (its native kernel on float32 CPU
    tensors) and every other step runs `paged_attention_torch`.
    """
    if softcap is not None and not 0 < softcap < float("inf"):
        raise ValueError(f"softcap must be positive and finite (or None for none), got {softcap}")
    if meta.probe is not None:
        return meta.probe(query, key_cache, value_cache, meta, scale, softcap)
    if query.is_cuda and use_triton_kernels(query, key_cache, value_cache):
        from engine.attention.triton_decode import triton_paged_decode
        from engine.attention.triton_prefill import triton_paged_prefill

        kernel = triton_paged_decode if meta.is_decode_only else triton_paged_prefill
        return kernel(query, key_cache, value_cache, meta, scale, softcap=softcap)
    if meta.is_decode_only:
        visible = meta.attn_mask[:, 0] if meta.attn_mask is not None else None
        return decode_attention(query, key_cache, value_cache, meta.key_blocks, visible, scale, softcap=softcap)
    return paged_attention_torch(query, key_cache, value_cache, meta, scale, softcap=softcap)


# The dtypes the Triton kernels' results have been checked in (Triton's interpreter, against the dense
# reference). bfloat16 compiles and runs, but the interpreter computes bfloat16 dot products wrongly, so its
# results are unverified: bfloat16 steps keep the torch path until they are checked on a GPU.
TRITON_CHECKED_DTYPES = (torch.float32, torch.float16)


def use_triton_kernels(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """Whether the Triton kernels compute attention for these tensors here (triton installed, a CUDA device
    or Triton's interpreter, shapes within their limits, a dtype in TRITON_CHECKED_DTYPES). The first
    refusal of each kind is logged, so a GPU server says once why it runs the torch path."""
    from engine.attention import triton_prefill as triton_prefill_attention

    reason = triton_prefill_attention.unavailable_reason() or triton_prefill_attention.unsupported_reason(
        query, key_cache, value_cache
    )
    if reason is None and query.dtype not in TRITON_CHECKED_DTYPES:
        reason = f"{query.dtype} results of the kernels are not yet checked (only {TRITON_CHECKED_DTYPES} are)"
    if reason is not None:
        _log_torch_fallback(reason)
    return reason is None


@functools.cache
def _log_torch_fallback(reason: str) -> None:
    logger.info("attention runs in torch ops, not the Triton kernels: %s", reason)


def paged_attention_torch(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    softcap: float | None = None,
) -> torch.Tensor:
    """paged_attention for any step in torch ops only, so the same code runs on CPU and CUDA."""
    num_tokens, num_heads, head_dim = query.shape
    keys = gather_kv(key_cache, meta.key_blocks, query.dtype)  # [B, H_kv, K, D]
    values = gather_kv(value_cache, meta.key_blocks, query.dtype)
    prefix = split_prefix_length(query, meta, softcap)
    if prefix is not None:  # one long chunk after its cached prefix (engine/attention/prefix_split.py)
        return prefix_then_causal(query, keys, values, prefix, scale)
    # One scratch row at index T receives the padding queries.
    scratch = torch.cat([query, query.new_zeros(1, num_heads, head_dim)])
    padded_query = scratch[meta.query_index]  # [B, Q, H_q, D]
    out = sdpa(
        padded_query.transpose(1, 2),
        keys,
        values,
        meta.attn_mask.unsqueeze(1) if meta.attn_mask is not None else None,
        scale,
        is_causal=meta.is_causal,
        softcap=softcap,
    ).transpose(1, 2)  # [B, Q, H_q, D]
    flat = out.new_empty(num_tokens + 1, num_heads, head_dim)
    flat[meta.query_index.reshape(-1)] = out.reshape(-1, num_heads, head_dim)
    return flat[:num_tokens]
