"""Attention weights of a prompt, from a reference forward of the generation model.

The serving kernels never form the attention matrix (the CPU decode kernel, SDPA and the Triton
kernels keep it in registers), so the weights are computed by a separate, plain path: the model's
own layers (norms, projections, rotary embeddings, biases) run over the prompt with a private KV
cache of its own, and each layer's attention goes through `reference_attention_probs` (explicit
scores, the layer's softcap if it has one, mask, softmax), which records the weights. The serving
cache, block pool and scheduler are never touched, so a probe cannot disturb running requests beyond
the time it takes.

The masking rule is the engine's (`visible_mask`): causal, plus an optional sliding window of W
keys (key j visible to query i iff i - W < j <= i) and the first S positions kept as sinks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn

from engine.attention.metadata import AttentionMetadata, build_attention_metadata
from engine.attention.reference import reference_attention_probs, weighted_values
from engine.config import cdiv
from engine.ops import kv_format


@dataclass(frozen=True)
class AttentionWeights:
    """weights: float32 [num_layers, num_heads, T, T], rows are queries; 0.0 exactly where masked."""

    token_ids: tuple[int, ...]
    weights: torch.Tensor
    sliding_window: int | None
    num_sink_tokens: int
    layer_windows: tuple[int | None, ...]  # the window each layer's weights were computed under (None: full)

    @property
    def num_layers(self) -> int:
        return self.weights.shape[0]

    @property
    def num_heads(self) -> int:
        return self.weights.shape[1]


class _RecordingAttention:
    """Stands in for paged attention in every layer of one probe forward: dense over the new tokens
    (the whole prompt, written to slots in order), recording each layer's weights."""

    def __init__(self) -> None:
        self.layers: list[torch.Tensor] = []  # per layer: float32 [H_q, T, T], on the CPU

    def __call__(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        softcap: float | None = None,
    ) -> torch.Tensor:
        num_tokens = query.shape[0]
        num_kv_heads, row = key_cache.shape[2], key_cache.shape[3]
        # The layer has just written the prompt's K/V to these slots, position p at slot_mapping[p], in the
        # cache's format: read back, they are what the serving path attends over.
        keys = kv_format.read(key_cache.view(-1, num_kv_heads, row)[meta.slot_mapping], query.dtype)  # [T, H_kv, D]
        values = kv_format.read(value_cache.view(-1, num_kv_heads, row)[meta.slot_mapping], query.dtype)
        positions = torch.arange(num_tokens, device=query.device)
        probs = reference_attention_probs(
            query, keys, positions, positions, scale, meta.sliding_window, meta.num_sink_tokens, softcap=softcap
        )  # [H_q, T, T]
        self.layers.append(probs.cpu())  # only one layer's weights at a time on the device
        return weighted_values(probs, values, query.dtype)


@torch.inference_mode()
def attention_weights(
    model: nn.Module,
    token_ids: list[int],
    *,
    num_kv_heads: int,
    head_dim: int,
    num_layers: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    kv_cache_dtype: str | None = None,
    sliding_window: int | None,
    num_sink_tokens: int,
    layer_windows: Sequence[int | None] | None = None,
) -> AttentionWeights:
    """Run `model` (an engine model: forward(input_ids, positions, kv_caches, metas)) over token_ids
    and return every layer's and head's attention weights under the given window and sinks, or under
    each layer's own window (layer_windows, None entries full; sinks apply to the sliding ones).
    kv_cache_dtype: the cache format the keys and values go through (None: the model's dtype)."""
    if not token_ids:
        raise ValueError("attention weights need at least one token")
    num_tokens = len(token_ids)
    num_blocks = cdiv(num_tokens, block_size)
    # Block 0 is the null block in every cache; the probe's own blocks are 1..num_blocks.
    shape = (num_blocks + 1, block_size, num_kv_heads, head_dim)
    cache_format = kv_cache_dtype or kv_format.format_of_dtype(dtype)
    kv_caches = [
        (kv_format.allocate(cache_format, *shape, device), kv_format.allocate(cache_format, *shape, device))
        for _ in range(num_layers)
    ]
    recorder = _RecordingAttention()
    block_table = list(range(1, num_blocks + 1))
    windows = list(layer_windows) if layer_windows is not None else [sliding_window] * num_layers
    metas_by_window: dict[int | None, AttentionMetadata] = {}
    for window in set(windows):
        sinks = num_sink_tokens if window is not None else 0
        meta = build_attention_metadata([0], [num_tokens], [block_table], block_size, window, sinks, device)
        metas_by_window[window] = replace(meta, probe=recorder)
    input_ids = torch.tensor(token_ids, dtype=torch.long, device=device)
    positions = torch.arange(num_tokens, device=device)
    model(input_ids, positions, kv_caches, [metas_by_window[window] for window in windows])
    weights = torch.stack(recorder.layers)  # [L, H_q, T, T]
    return AttentionWeights(tuple(token_ids), weights, sliding_window, num_sink_tokens, tuple(windows))
