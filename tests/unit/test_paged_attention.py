"""Paged attention equals the dense reference on random shapes, tables and ragged lengths."""

from __future__ import annotations

import random

import pytest
import torch

from engine.attention.metadata import build_attention_metadata
from engine.attention.paged import paged_attention, paged_attention_torch, write_kv
from engine.attention.reference import dense_reference_attention
from engine.ops.decode_attention import available, decode_attention_native, decode_attention_torch
from tests.support.native_kernels import KERNELS_EXPECTED


@pytest.mark.parametrize("window,sinks", [(None, 0), (7, 0), (9, 3), (5, 8)])
@pytest.mark.parametrize("trial", range(4))
@pytest.mark.parametrize("decode_only", [False, True], ids=["mixed", "decode"])
def test_paged_attention_matches_dense(window, sinks, trial, decode_only):
    """Mixed steps run the torch path; decode-only steps run engine/ops/decode_attention (native and torch)."""
    rng = random.Random(trial * 100 + (window or 0) + sinks)
    torch.manual_seed(trial)
    block_size = rng.choice([2, 4, 8])
    num_kv_heads = rng.choice([1, 2, 3])
    num_heads = num_kv_heads * rng.choice([1, 2, 3])
    head_dim = rng.choice([8, 12, 16])  # 12: the kernel's non-vector tail
    num_seqs = rng.randint(1, 5)
    num_blocks = 128
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim)
    free_blocks = list(range(1, num_blocks))
    rng.shuffle(free_blocks)

    starts, counts, tables, full_keys, full_values = [], [], [], [], []
    for _ in range(num_seqs):
        total = rng.randint(1, 40)
        count = 1 if decode_only else rng.choice([1, rng.randint(1, total)])  # decode or a ragged chunk
        start = total - count
        table = [free_blocks.pop() for _ in range(-(-total // block_size))]
        keys = torch.randn(total, num_kv_heads, head_dim)
        values = torch.randn(total, num_kv_heads, head_dim)
        # The cached prefix is already in the cache; the new chunk is written by write_kv below.
        for pos in range(start):
            key_cache[table[pos // block_size], pos % block_size] = keys[pos]
            value_cache[table[pos // block_size], pos % block_size] = values[pos]
        starts.append(start)
        counts.append(count)
        tables.append(table)
        full_keys.append(keys)
        full_values.append(values)

    meta = build_attention_metadata(starts, counts, tables, block_size, window, sinks, torch.device("cpu"))
    new_keys = torch.cat([k[s:] for k, s in zip(full_keys, starts)])
    new_values = torch.cat([v[s:] for v, s in zip(full_values, starts)])
    write_kv(key_cache, value_cache, new_keys, new_values, meta.slot_mapping)
    queries = torch.randn(sum(counts), num_heads, head_dim)
    scale = head_dim**-0.5
    out = paged_attention(queries, key_cache, value_cache, meta, scale)
    if decode_only:
        assert meta.is_decode_only
        torch_path = paged_attention_torch(queries, key_cache, value_cache, meta, scale)
        torch.testing.assert_close(out, torch_path, atol=1e-5, rtol=1e-5)
        visible = meta.attn_mask[:, 0] if meta.attn_mask is not None else None
        decode_args = (queries, key_cache, value_cache, meta.key_blocks, visible, scale)
        torch.testing.assert_close(decode_attention_torch(*decode_args), torch_path, atol=1e-5, rtol=1e-5)
        if available():
            torch.testing.assert_close(decode_attention_native(*decode_args), torch_path, atol=1e-5, rtol=1e-5)

    offset = 0
    for keys, values, start, count in zip(full_keys, full_values, starts, counts):
        total = start + count
        expected = dense_reference_attention(
            queries[offset : offset + count],
            keys,
            values,
            torch.arange(start, total),
            torch.arange(total),
            scale,
            window,
            sinks if window is not None else 0,
        )
        torch.testing.assert_close(out[offset : offset + count], expected, atol=1e-5, rtol=1e-5)
        offset += count


def test_window_mask_semantics():
    from engine.attention.metadata import visible_mask

    mask = visible_mask(torch.tensor([10]), torch.arange(12), sliding_window=4, num_sink_tokens=2)[0]
    # Sinks 0,1; window 7..10; nothing after the query.
    assert mask.nonzero().flatten().tolist() == [0, 1, 7, 8, 9, 10]


def test_decode_kernel_builds_where_it_should():
    assert available() == KERNELS_EXPECTED


@pytest.mark.parametrize("window", [None, 64, 5], ids=["no window", "window past the prompts", "window inside"])
def test_prompts_from_position_zero_match_dense(window):
    """Whole prompts (the usual prefill) skip the mask for SDPA's is_causal unless a window cuts in."""
    torch.manual_seed(7)
    block_size, num_kv_heads, num_heads, head_dim = 4, 2, 4, 8
    key_cache = torch.zeros(64, block_size, num_kv_heads, head_dim)
    value_cache = torch.zeros_like(key_cache)
    lengths = [9, 3, 14]
    tables, next_block = [], 1
    for length in lengths:
        count = -(-length // block_size)
        tables.append(list(range(next_block, next_block + count)))
        next_block += count
    meta = build_attention_metadata([0] * 3, lengths, tables, block_size, window, 0, torch.device("cpu"))
    assert meta.is_causal == (window != 5) and (meta.attn_mask is None) == meta.is_causal
    keys = torch.randn(sum(lengths), num_kv_heads, head_dim)
    values = torch.randn(sum(lengths), num_kv_heads, head_dim)
    write_kv(key_cache, value_cache, keys, values, meta.slot_mapping)
    queries = torch.randn(sum(lengths), num_heads, head_dim)
    out = paged_attention(queries, key_cache, value_cache, meta, head_dim**-0.5)
    offset = 0
    for length in lengths:
        rows = slice(offset, offset + length)
        positions = torch.arange(length)
        expected = dense_reference_attention(
            queries[rows], keys[rows], values[rows], positions, positions, head_dim**-0.5, window
        )
        torch.testing.assert_close(out[rows], expected, atol=1e-5, rtol=1e-5)
        offset += length
