"""Scaled dot-product attention with optional attention-logit softcapping, for the torch paths.

Softcapping bounds every score to (-softcap, softcap): after scaling and before the mask and softmax, a
score s becomes softcap * tanh(s / softcap). SDPA has no hook between scaling and softmax, so with a
softcap the scores are formed explicitly (float32, the same mask and causal rule, GQA by repeating the
KV heads); without one SDPA runs unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    scale: float,
    *,
    is_causal: bool = False,
    softcap: float | None = None,
) -> torch.Tensor:
    """query [B, H_q, Q, D], key/value [B, H_kv, K, D] -> [B, H_q, Q, D] in the query's dtype.

    attn_mask: bool, broadcastable to [B, H_q, Q, K], True where a key is visible; is_causal: query q sees
    keys 0..q (SDPA's rule). H_q must be a multiple of H_kv: query head h reads KV head h // (H_q // H_kv).
    """
    num_heads, num_kv_heads = query.shape[1], key.shape[1]
    if softcap is None:
        return F.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=attn_mask,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )
    group = num_heads // num_kv_heads
    key = key.float().repeat_interleave(group, dim=1)
    value = value.float().repeat_interleave(group, dim=1)
    scores = torch.matmul(query.float(), key.transpose(-1, -2)) * scale  # [B, H_q, Q, K]
    scores = torch.tanh(scores / softcap) * softcap
    if is_causal:
        num_queries, num_keys = scores.shape[-2:]
        causal = torch.ones(num_queries, num_keys, dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, value).to(query.dtype)
