"""A long chunk of one sequence's prompt after its cached prefix, on CPU: the prefix unmasked, the chunk causal.

A chunk of Q new tokens after P cached ones sees the prefix whole and itself causally. SDPA with that mask
computes every score of the [Q, P + Q] rectangle and masks the upper triangle of its last Q columns
afterwards; split in two, the prefix runs without a mask and the chunk with SDPA's causal rule, which skips
the masked half, and the two are merged by their log-sum-exps. Against the masked call, one sequence on 2
Zen 5 cores: 1.25-1.54x for chunks of 2,048 tokens after 512-2,048 (heads of 64 and 128), 1.09-1.25x after
6,144, and 0.90-0.94x for 100 tokens after 4,000; on 2 Zen 4 cores, chunks of 512 tokens 1.00-1.10x after
2,048 and 1.15-1.39x after 3,072-12,288 (the unmasked prefix call reads each KV head's keys once for its whole
group of query heads), and 256 tokens 0.99-1.05x. So chunks under 512 keep the mask.

torch's CPU flash-attention op gives the log-sum-exp beside the output; it takes as many key heads as query
heads, so the prefix folds each group's query heads into one longer run of queries of its KV head (the prefix's
keys are not repeated per query head), and the chunk's own keys (Q of them) are.
"""

from __future__ import annotations

import torch

from engine.attention.metadata import AttentionMetadata

# The split pays from chunks this long, whatever the prefix's length.
MIN_CHUNK = 512


def _flash_op():
    return getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def split_prefix_length(query: torch.Tensor, meta: AttentionMetadata, softcap: float | None) -> int | None:
    """P, where this step is one sequence's chunk of Q >= MIN_CHUNK tokens after P > 0 cached ones, on CPU,
    with no window, softcap or inspection; else None."""
    num_tokens = query.shape[0]
    if (
        meta.num_seqs != 1
        or num_tokens < MIN_CHUNK
        or query.device.type != "cpu"
        or softcap is not None
        or meta.sliding_window is not None
        or meta.probe is not None
        or _flash_op() is None
    ):
        return None
    prefix = int(meta.query_starts[0])
    return prefix if prefix > 0 else None


def prefix_then_causal(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, prefix: int, scale: float
) -> torch.Tensor:
    """query [Q, H_q, D] at positions prefix .. prefix + Q - 1; keys, values [1, H_kv, K, D] from position 0
    (K >= prefix + Q) -> [Q, H_q, D]: query i sees keys 0 .. prefix + i."""
    op = _flash_op()
    num_queries, num_heads, head_dim = query.shape
    num_kv_heads = keys.shape[1]
    group = num_heads // num_kv_heads
    q = query.permute(1, 0, 2).contiguous()  # [H_q, Q, D]: query head kvh * group + j reads KV head kvh
    folded = q.view(1, num_kv_heads, group * num_queries, head_dim)
    before, before_lse = op(
        folded, keys[:, :, :prefix].contiguous(), values[:, :, :prefix].contiguous(), 0.0, False, scale=scale
    )
    end = prefix + num_queries
    own_keys = keys[:, :, prefix:end].repeat_interleave(group, dim=1)
    own_values = values[:, :, prefix:end].repeat_interleave(group, dim=1)
    own, own_lse = op(q.unsqueeze(0), own_keys, own_values, 0.0, True, scale=scale)
    before = before.reshape(num_heads, num_queries, head_dim)
    before_lse = before_lse.reshape(num_heads, num_queries)
    own, own_lse = own[0], own_lse[0]
    total = torch.logaddexp(before_lse, own_lse)
    out = before * torch.exp(before_lse - total).unsqueeze(-1) + own * torch.exp(own_lse - total).unsqueeze(-1)
    return out.permute(1, 0, 2).to(query.dtype)
