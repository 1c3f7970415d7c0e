"""POST /attention and GET /kv_cache: the engine's workings as the playground page shows them."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

from server.protocol.common import StrictRequest, StrictSwitch, TokenId

# Longest prompt POST /attention takes: its answer is a T x T matrix, and the forward keeps every
# layer's [heads, T, T] weights.
MAX_ATTENTION_TOKENS = 256
# A prompt longer than this, in characters, is refused before it is tokenized: 256 tokens of 64
# characters each would be a tokenizer whose tokens are longer than any real one's.
MAX_ATTENTION_PROMPT_CHARS = MAX_ATTENTION_TOKENS * 64


class AttentionRequest(StrictRequest):
    """Give `prompt` (text, tokenized as completions do) or `token_ids`.

    sliding_window: absent -> the server's own setting; null -> no window; W -> key j is seen by query i
    iff i - W < j <= i. num_sink_tokens: the first S positions stay visible under a window (absent ->
    the server's own count when the window is the server's, else 0; ignored without a window).
    """

    model: str | None = None
    prompt: str | None = None
    token_ids: list[TokenId] | None = None
    add_special_tokens: StrictSwitch = True
    layer: Annotated[int, Field(strict=True, ge=0)] = 0
    head: Annotated[int, Field(strict=True, ge=0)] | Literal["mean"] = "mean"
    sliding_window: Annotated[int, Field(strict=True, ge=1)] | None = None
    num_sink_tokens: Annotated[int, Field(strict=True, ge=0)] | None = None


class AttentionResponse(BaseModel):
    object: Literal["attention"] = "attention"
    model: str
    token_ids: list[int]
    tokens: list[str]  # each token's own text
    num_layers: int
    num_heads: int
    layer: int
    head: int | Literal["mean"]
    sliding_window: int | None
    num_sink_tokens: int
    max_tokens: int
    weights: list[list[float]]  # [T queries][T keys]; each row sums to 1, 0.0 exactly where masked


class GroupBlocksView(BaseModel):
    block_table: list[int]  # 0: released by the sliding window
    shared: list[bool]  # per entry: the block is held by more than one sequence


class SequenceBlocksView(BaseModel):
    id: int  # opaque sequence number
    num_tokens: int
    num_computed_tokens: int
    block_table: list[int]  # the first attention group's table (0: released by the sliding window)
    shared: list[bool]  # per entry: the block is held by more than one sequence
    groups: list[GroupBlocksView]  # the table in every attention group, in attention_groups' order


class AttentionGroupView(BaseModel):
    """Layers whose K/V share block tables: one attention kind (full, or a sliding window with its sinks)."""

    sliding_window: int | None  # null: every key is visible
    num_sink_tokens: int
    layers: list[int]


class KVCacheResponse(BaseModel):
    object: Literal["kv_cache"] = "kv_cache"
    block_size: int
    num_blocks: int  # the reserved null block 0 not counted
    num_used_blocks: int
    num_shared_blocks: int
    num_cached_free_blocks: int
    num_free_blocks: int  # free and holding nothing a later request could take back
    # The detail below tells whether someone's prompt is cached or running: admin keys only
    # (server/http/access.py); anyone else gets null for both, and detail false.
    detail: bool
    blocks: str | None  # char i: block id i + 1; u in use, s shared, c cached-free, f free
    sliding_window: int | None  # the sliding layers' window; null when every layer is full
    num_sink_tokens: int
    # One block table per group in each sequence; a model whose layers all attend alike has one group.
    attention_groups: list[AttentionGroupView]
    prefix_caching: bool
    num_running: int
    num_waiting: int
    sequences: list[SequenceBlocksView] | None
