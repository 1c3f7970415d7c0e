"""The dense reference: plain attention for one sequence with an explicit mask, no paging and no batching.

Written with explicit matmul/softmax so that it shares no code with the paged fast path it checks.
"""

from __future__ import annotations

import torch

from engine.attention.metadata import visible_mask


def dense_reference_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    num_sink_tokens: int = 0,
    *,
    softcap: float | None = None,
) -> torch.Tensor:
    """Plain attention for ONE sequence with an explicit mask; no paging, no batching.

    query: [Q, H_q, D], key/value: [K, H_kv, D] (contiguous, all positions),
    positions: [Q] and [K]. Returns [Q, H_q, D]. Written with explicit
    matmul/softmax so it shares no code with the fast path. softcap: as reference_attention_probs.
    """
    probs = reference_attention_probs(
        query, key, query_positions, key_positions, scale, sliding_window, num_sink_tokens, softcap=softcap
    )
    return weighted_values(probs, value, query.dtype)


def weighted_values(probs: torch.Tensor, value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Attention output [Q, H_q, D] in `dtype` from one sequence's weights [H_q, Q, K] and values [K, H_kv, D]."""
    value = value.repeat_interleave(probs.shape[0] // value.shape[1], dim=1)
    return torch.einsum("hqk,khd->qhd", probs, value.float()).to(dtype)


def reference_attention_probs(
    query: torch.Tensor,
    key: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    num_sink_tokens: int = 0,
    *,
    softcap: float | None = None,
) -> torch.Tensor:
    """The attention weights of ONE sequence: float32 [H_q, Q, K], each row a softmax over the keys
    the query sees, exactly 0.0 where visible_mask hides a key. query: [Q, H_q, D], key: [K, H_kv, D].

    softcap: each scaled score s becomes softcap * tanh(s / softcap) before the mask; None: no cap."""
    group = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.float(), key.float()) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    mask = visible_mask(query_positions, key_positions, sliding_window, num_sink_tokens)
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
