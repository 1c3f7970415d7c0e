"""Paged attention: store new keys/values in their cache slots, then attend over the paged cache.

`paged_attention` picks the kernel for a step: the Triton kernels on CUDA (engine/attention/triton_decode.py,
engine/attention/triton_prefill.py), the native decode kernel for decode-only CPU steps
(engine/ops/decode_attention.py), and `paged_attention_torch` (torch ops only) for everything else.

`paged_attention_torch` pads every sequence to the step's most queries and keys. Where that padding is most of
the work (a long prompt chunk beside decoding sequences: each decoding row padded to the chunk's thousands of
queries), it attends sequence by sequence instead, the decoding rows together in the decode kernel. With 8
sequences decoding, a step with a 2,000-token chunk of the default model took 17.7 s with padding, 1.9 s alone.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import replace

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
    ragged = _ragged_shape(meta)
    if ragged is not None:
        return _attend_by_sequence(query, key_cache, value_cache, meta, scale, softcap, *ragged)
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


# A step whose padded [queries x keys] rectangles come to this many times the sequences' own is attended
# sequence by sequence.
RAGGED_WASTE = 2.0


def _ragged_shape(meta: AttentionMetadata) -> tuple[list[int], list[int], list[int]] | None:
    """(each sequence's new tokens, key blocks it reads, flat offset) where padding would make the step's
    attention RAGGED_WASTE times each sequence's own, else None."""
    if meta.num_seqs == 1 or meta.probe is not None:
        return None
    counts = meta.query_lens.tolist()
    if max(counts) == 1:
        return None
    blocks = (meta.key_block_logical >= 0).sum(dim=1).tolist()
    padded = len(counts) * max(counts) * max(blocks)
    if padded < RAGGED_WASTE * sum(count * num_blocks for count, num_blocks in zip(counts, blocks)):
        return None
    return counts, blocks, meta.query_offsets.tolist()


def _attend_by_sequence(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    softcap: float | None,
    counts: list[int],
    blocks: list[int],
    offsets: list[int],
) -> torch.Tensor:
    """The decoding rows together in the decode kernel, each other sequence on its own over its own blocks."""
    block_size = key_cache.shape[1]
    out = torch.empty_like(query)
    decoding = [i for i, count in enumerate(counts) if count == 1]
    if decoding:
        width = max(blocks[i] for i in decoding)
        seqs = torch.tensor(decoding, device=query.device)
        rows = torch.tensor([offsets[i] for i in decoding], device=query.device)
        visible = meta.attn_mask[seqs, 0, : width * block_size] if meta.attn_mask is not None else None
        out[rows] = decode_attention(
            query[rows], key_cache, value_cache, meta.key_blocks[seqs, :width], visible, scale, softcap=softcap
        )
    for i, count in enumerate(counts):
        if count > 1:
            own = slice(offsets[i], offsets[i] + count)
            one = _one_sequence(meta, i, count, blocks[i], block_size)
            out[own] = paged_attention_torch(query[own], key_cache, value_cache, one, scale, softcap=softcap)
    return out


def _one_sequence(meta: AttentionMetadata, i: int, count: int, num_blocks: int, block_size: int) -> AttentionMetadata:
    """Sequence i's part of the step alone: its own blocks, queries and mask (None where the causal rule says
    it all, as for a step of that sequence alone)."""
    start = int(meta.query_starts[i])
    window = meta.sliding_window
    is_causal = start == 0 and (window is None or window >= count)
    mask = None
    if not is_causal and meta.attn_mask is not None:
        mask = meta.attn_mask[i : i + 1, :count, : num_blocks * block_size]
    device = meta.query_index.device
    return replace(
        meta,
        key_blocks=meta.key_blocks[i : i + 1, :num_blocks],
        attn_mask=mask,
        query_index=torch.arange(count, device=device).unsqueeze(0),
        is_decode_only=False,
        is_causal=is_causal,
        key_block_logical=meta.key_block_logical[i : i + 1, :num_blocks],
        query_starts=meta.query_starts[i : i + 1],
        query_lens=meta.query_lens[i : i + 1],
        query_offsets=torch.zeros(1, dtype=meta.query_offsets.dtype, device=device),
    )
