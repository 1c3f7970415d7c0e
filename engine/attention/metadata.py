"""Attention over the paged KV cache, and the dense reference it must equal.

Layout of one layer's cache: key_cache, value_cache: [num_blocks, block_size,
num_kv_heads, head_dim]. A token at position p of a sequence lives in slot
`block_table[p // block_size] * block_size + p % block_size` of the flattened
cache. Block 0 is the null block: table entries of blocks released by the
sliding window point at it, and masks never let a query see it.

Per step the runner builds one `AttentionMetadata` for the whole flat batch
(every layer reuses it): which cache slots each new token writes, which slots
each sequence's queries read, and the boolean mask (causal, window, sinks).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TypeVar

import numpy as np
import torch

from engine.config import cdiv


@dataclass
class AttentionMetadata:
    """Tensors describing one step's flat batch of T new tokens from B sequences.

    slot_mapping:   [T]           cache slot each new token's K/V is written to
    key_blocks:     [B, N]        cache blocks each sequence's queries may read (padded with the null block);
                                  whole blocks are gathered, K = N * block_size keys per sequence
    attn_mask:      [B, Q, K]     True where query q of sequence b may see key k; None when all True
                                  or when is_causal says it all
    query_index:    [B, Q]        flat token index of each padded query (padding -> T, a scratch row)
    is_decode_only: every sequence has exactly one new token (Q == 1, query_index is arange)
    is_causal:      every sequence starts at position 0 and no window cuts in: query q sees keys
                    0..q, which SDPA's is_causal computes without a mask, skipping the masked half

    The same step described without a dense mask, for kernels that compute visibility themselves:
    key_block_logical: [B, N] int32  logical block number of each key_blocks entry (-1: padding); slot j
                                     of entry n holds position key_block_logical[b, n] * block_size + j
    query_starts:      [B] int32     position of each sequence's first new token
    query_lens:        [B] int32     new tokens of each sequence
    query_offsets:     [B] int32     flat index of each sequence's first new token
    sliding_window, num_sink_tokens: the masking rule (visible_mask) those positions obey

    probe: None when serving. Set only by engine/attention/probe.py: every layer's attention then
           runs through it (a dense reference that also records the attention weights) instead of a kernel.
    """

    slot_mapping: torch.Tensor
    key_blocks: torch.Tensor
    attn_mask: torch.Tensor | None
    query_index: torch.Tensor
    is_decode_only: bool
    is_causal: bool
    key_block_logical: torch.Tensor
    query_starts: torch.Tensor
    query_lens: torch.Tensor
    query_offsets: torch.Tensor
    sliding_window: int | None
    num_sink_tokens: int
    probe: AttentionProbe | None = None

    @property
    def num_seqs(self) -> int:
        return self.key_blocks.shape[0]


# (query [T, H_q, D], key_cache, value_cache, meta, scale, softcap or None) -> attention output [T, H_q, D]
AttentionProbe = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, float, float | None], torch.Tensor
]


Positions = TypeVar("Positions", torch.Tensor, np.ndarray)


def visible_mask(
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    sliding_window: int | None,
    num_sink_tokens: int,
) -> torch.Tensor:
    """Bool [..., Q, K]: key j visible to query p iff j <= p, and within the window or a sink.

    Negative key positions mark padding and are never visible.
    query_positions: [..., Q], key_positions: [..., K].
    """
    return _visible(query_positions.unsqueeze(-1), key_positions.unsqueeze(-2), sliding_window, num_sink_tokens)


def _visible(q: Positions, k: Positions, sliding_window: int | None, num_sink_tokens: int) -> Positions:
    """visible_mask's rule on query and key positions already shaped to broadcast against each other, in torch
    or numpy (operators only)."""
    mask = (k >= 0) & (k <= q)
    if sliding_window is not None:
        mask &= ((q - k) < sliding_window) | (k < num_sink_tokens)
    return mask


def _logical_blocks(
    starts: list[int], counts: list[int], block_size: int, sliding_window: int | None, num_sink_tokens: int
) -> np.ndarray:
    """int64 [B, N]: the logical blocks each sequence's queries may read, padded with -1.

    The sink blocks, then every block from the first query's window start to the last new token;
    bounded by (W + S + chunk) / block_size with a window, the whole context without.
    """
    rows = []
    for start, count in zip(starts, counts):
        last_block = (start + count - 1) // block_size
        if sliding_window is None:
            rows.append(np.arange(last_block + 1))
        else:
            low_block = max(start - sliding_window + 1, 0) // block_size
            num_sink_blocks = min(cdiv(num_sink_tokens, block_size), low_block)
            rows.append(np.concatenate([np.arange(num_sink_blocks), np.arange(low_block, last_block + 1)]))
    logical = np.full((len(rows), max(len(r) for r in rows)), -1, dtype=np.int64)
    for i, row in enumerate(rows):
        logical[i, : len(row)] = row
    return logical


def _key_positions(logical: np.ndarray, block_size: int) -> np.ndarray:
    """int64 [B, N * block_size]: the position each slot of the logical blocks [B, N] holds, -1 in padding."""
    key_positions = (logical[:, :, None] * block_size + np.arange(block_size)).reshape(logical.shape[0], -1)
    key_positions[np.repeat(logical < 0, block_size, axis=1)] = -1
    return key_positions


def _bind_tables(
    logical: np.ndarray, starts: list[int], counts: list[int], block_tables: list[list[int]], block_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """(key_blocks int64 [B, N], slot_mapping int64 [T]) of these block tables for the logical blocks."""
    key_blocks = np.zeros(logical.shape, dtype=np.int64)
    new_slots = []
    for i, (start, count, table) in enumerate(zip(starts, counts, block_tables)):
        table = np.asarray(table, dtype=np.int64)
        valid = logical[i] >= 0
        key_blocks[i, valid] = table[logical[i, valid]]
        positions = np.arange(start, start + count)
        new_slots.append(table[positions // block_size] * block_size + positions % block_size)
    return key_blocks, np.concatenate(new_slots)


def build_attention_metadata(
    starts: list[int],
    counts: list[int],
    block_tables: list[list[int]],
    block_size: int,
    sliding_window: int | None,
    num_sink_tokens: int,
    device: torch.device,
) -> AttentionMetadata:
    """Metadata for B sequences where sequence i computes positions [starts[i], starts[i] + counts[i])."""
    num_seqs = len(starts)
    logical_blocks = _logical_blocks(starts, counts, block_size, sliding_window, num_sink_tokens)
    key_blocks, slot_mapping = _bind_tables(logical_blocks, starts, counts, block_tables, block_size)
    key_positions = _key_positions(logical_blocks, block_size)

    max_queries = max(counts)
    num_tokens = sum(counts)
    query_positions = np.full((num_seqs, max_queries), -1, dtype=np.int64)
    query_index = np.full((num_seqs, max_queries), num_tokens, dtype=np.int64)
    offset = 0
    for i, (start, count) in enumerate(zip(starts, counts)):
        query_positions[i, :count] = np.arange(start, start + count)
        query_index[i, :count] = np.arange(offset, offset + count)
        offset += count
    is_decode_only = max_queries == 1
    # Prompts computed from their first token with no window inside them (the usual prefill):
    # the mask is plain causal from key 0 (padding queries see key 0 too, so stay finite),
    # which SDPA computes without one; no mask is built for them.
    is_causal = (
        not is_decode_only
        and all(start == 0 for start in starts)
        and (sliding_window is None or sliding_window >= max_queries)
    )
    attn_mask = None
    if not is_causal:
        mask = visible_mask(
            torch.from_numpy(query_positions), torch.from_numpy(key_positions), sliding_window, num_sink_tokens
        )
        # Padding queries see one key so their (discarded) softmax stays finite.
        mask[:, :, 0] |= torch.from_numpy(query_positions < 0)
        # An all-visible mask (e.g. one decoding sequence) is dropped: SDPA is faster without one.
        attn_mask = None if bool(mask.all()) else mask.to(device)
    query_offsets = np.cumsum([0, *counts[:-1]])
    return AttentionMetadata(
        slot_mapping=torch.from_numpy(slot_mapping).to(device),
        key_blocks=torch.from_numpy(key_blocks).to(device),
        attn_mask=attn_mask,
        query_index=torch.from_numpy(query_index).to(device),
        is_decode_only=is_decode_only,
        is_causal=is_causal,
        key_block_logical=torch.from_numpy(logical_blocks.astype(np.int32)).to(device),
        query_starts=torch.tensor(starts, dtype=torch.int32, device=device),
        query_lens=torch.tensor(counts, dtype=torch.int32, device=device),
        query_offsets=torch.from_numpy(query_offsets.astype(np.int32)).to(device),
        sliding_window=sliding_window,
        num_sink_tokens=num_sink_tokens,
    )


def build_group_metadata(
    starts: list[int],
    counts: list[int],
    tables_by_group: list[list[list[int]]],
    kinds: list[tuple[int | None, int]],
    block_size: int,
    device: torch.device,
) -> list[AttentionMetadata]:
    """One AttentionMetadata per attention group: tables_by_group[g][i] is sequence i's table in group g,
    kinds[g] its group's (sliding_window, num_sink_tokens). Groups of one kind share the masks and
    positions (built once) and differ only in the blocks they read and write."""
    by_kind: dict[tuple[int | None, int], AttentionMetadata] = {}
    logical_by_kind: dict[tuple[int | None, int], np.ndarray] = {}  # made only for a kind's second group
    metas = []
    for tables, kind in zip(tables_by_group, kinds, strict=True):
        first = by_kind.get(kind)
        if first is None:
            by_kind[kind] = build_attention_metadata(starts, counts, tables, block_size, *kind, device)
            metas.append(by_kind[kind])
            continue
        if kind not in logical_by_kind:
            logical_by_kind[kind] = _logical_blocks(starts, counts, block_size, *kind)
        logical = logical_by_kind[kind]
        key_blocks, slot_mapping = _bind_tables(logical, starts, counts, tables, block_size)
        metas.append(
            replace(
                first,
                slot_mapping=torch.from_numpy(slot_mapping).to(device),
                key_blocks=torch.from_numpy(key_blocks).to(device),
            )
        )
    return metas


def per_token_rows(meta: AttentionMetadata, block_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The step as one query row per new token: (blocks [T, N], mask bool [T, N * block_size] or None).

    Row t reads its sequence's blocks and sees exactly what query t sees in `meta`, for kernels that
    take one query per row (a decoding token followed by its speculative drafts is several rows).
    """
    num_tokens = meta.slot_mapping.shape[0]
    valid = meta.query_index < num_tokens  # [B, Q]
    num_seqs, max_queries = valid.shape
    device = valid.device
    token = meta.query_index[valid]
    seq = torch.arange(num_seqs, device=device).unsqueeze(1).expand(num_seqs, max_queries)[valid]
    query = torch.arange(max_queries, device=device).unsqueeze(0).expand(num_seqs, max_queries)[valid]
    blocks = torch.empty((num_tokens, meta.key_blocks.shape[1]), dtype=meta.key_blocks.dtype, device=device)
    blocks[token] = meta.key_blocks[seq]
    mask = meta.attn_mask
    if mask is None and meta.is_causal:
        # The plain causal case was left to SDPA without a mask; rows need it spelled out.
        offsets = torch.arange(block_size, device=device)
        key_positions = (meta.key_block_logical.long().unsqueeze(2) * block_size + offsets).flatten(1)
        key_positions[meta.key_block_logical.long().repeat_interleave(block_size, dim=1) < 0] = -1
        query_positions = meta.query_starts.long().unsqueeze(1) + torch.arange(max_queries, device=device)
        mask = visible_mask(query_positions, key_positions, meta.sliding_window, meta.num_sink_tokens)
    if mask is None:
        return blocks, None
    rows = torch.empty((num_tokens, mask.shape[2]), dtype=torch.bool, device=device)
    rows[token] = mask[seq, query]
    return blocks, rows


def decode_only_rows(
    starts: list[int],
    tables_by_group: list[list[list[int]]],
    kinds: list[tuple[int | None, int]],
    block_size: int,
) -> list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]]:
    """A step where sequence i computes one token, at position starts[i], as kernels that take one query row per
    sequence read it: per attention group (arguments as for build_group_metadata), (key_blocks int64 [B, N],
    visibility bool [B, N * block_size] or None when every key is visible, slot_mapping int64 [B]), the same
    tensors as build_group_metadata's key_blocks, attn_mask[:, 0] and slot_mapping, without the rest of a
    step's metadata. Groups of one kind share their mask tensor."""
    counts = [1] * len(starts)
    query_positions = np.asarray(starts, dtype=np.int64)[:, None]  # [B, 1]
    by_kind: dict[tuple[int | None, int], tuple[np.ndarray, torch.Tensor | None]] = {}
    rows = []
    for tables, kind in zip(tables_by_group, kinds, strict=True):
        if kind not in by_kind:
            logical = _logical_blocks(starts, counts, block_size, *kind)
            visible = _visible(query_positions, _key_positions(logical, block_size), *kind)  # [B, K], in numpy
            by_kind[kind] = (logical, None if visible.all() else torch.from_numpy(visible))
        logical, mask = by_kind[kind]
        key_blocks, slot_mapping = _bind_tables(logical, starts, counts, tables, block_size)
        rows.append((torch.from_numpy(key_blocks), mask, torch.from_numpy(slot_mapping)))
    return rows
