"""Paged attention equals the dense reference on random shapes, tables and ragged lengths."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from engine.attention.metadata import build_attention_metadata
from engine.attention.paged import paged_attention, paged_attention_torch, write_kv
from engine.attention.probe import _RecordingAttention
from engine.attention.reference import dense_reference_attention, reference_attention_probs
from engine.ops.decode_attention import available, decode_attention_native, decode_attention_torch
from tests.support.native_kernels import KERNELS_EXPECTED

# Softcap 5 with queries scaled by QUERY_GAIN_WITH_SOFTCAP: scaled scores of several units, so tanh saturates
# and the capped attention is far from the uncapped one (the tests assert it is).
SOFTCAPS = pytest.mark.parametrize("softcap", [None, 5.0], ids=["no_softcap", "softcap"])
QUERY_GAIN_WITH_SOFTCAP = 8.0


@pytest.mark.parametrize("window,sinks", [(None, 0), (7, 0), (9, 3), (5, 8)])
@pytest.mark.parametrize("trial", range(4))
@pytest.mark.parametrize("decode_only", [False, True], ids=["mixed", "decode"])
@SOFTCAPS
def test_paged_attention_matches_dense(window, sinks, trial, decode_only, softcap):
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
    if softcap is not None:
        queries *= QUERY_GAIN_WITH_SOFTCAP
    scale = head_dim**-0.5
    out = paged_attention(queries, key_cache, value_cache, meta, scale, softcap=softcap)
    if decode_only:
        assert meta.is_decode_only
        torch_path = paged_attention_torch(queries, key_cache, value_cache, meta, scale, softcap=softcap)
        torch.testing.assert_close(out, torch_path, atol=1e-5, rtol=1e-5)
        visible = meta.attn_mask[:, 0] if meta.attn_mask is not None else None
        decode_args = (queries, key_cache, value_cache, meta.key_blocks, visible, scale)
        torch_decode = decode_attention_torch(*decode_args, softcap=softcap)
        torch.testing.assert_close(torch_decode, torch_path, atol=1e-5, rtol=1e-5)
        if available():
            native = decode_attention_native(*decode_args, softcap=softcap)
            torch.testing.assert_close(native, torch_path, atol=1e-5, rtol=1e-5)

    offset, uncapped_gap = 0, 0.0
    for keys, values, start, count in zip(full_keys, full_values, starts, counts):
        total = start + count
        args = (
            queries[offset : offset + count],
            keys,
            values,
            torch.arange(start, total),
            torch.arange(total),
            scale,
            window,
            sinks if window is not None else 0,
        )
        expected = dense_reference_attention(*args, softcap=softcap)
        torch.testing.assert_close(out[offset : offset + count], expected, atol=1e-5, rtol=1e-5)
        if softcap is not None:
            uncapped = dense_reference_attention(*args)
            uncapped_gap = max(uncapped_gap, (expected - uncapped).abs().max().item())
        offset += count
    if softcap is not None:
        assert uncapped_gap > 0.1, "the softcap must change the attention in this test"


def test_window_mask_semantics():
    from engine.attention.metadata import visible_mask

    mask = visible_mask(torch.tensor([10]), torch.arange(12), sliding_window=4, num_sink_tokens=2)[0]
    # Sinks 0,1; window 7..10; nothing after the query.
    assert mask.nonzero().flatten().tolist() == [0, 1, 7, 8, 9, 10]


def test_decode_kernel_builds_where_it_should():
    assert available() == KERNELS_EXPECTED


@pytest.mark.parametrize("window", [None, 64, 5], ids=["no window", "window past the prompts", "window inside"])
@SOFTCAPS
def test_prompts_from_position_zero_match_dense(window, softcap):
    """Whole prompts (the usual prefill) skip the mask for SDPA's is_causal unless a window cuts in
    (with a softcap, the torch path spells the causal mask out itself)."""
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
    if softcap is not None:
        queries *= QUERY_GAIN_WITH_SOFTCAP
    out = paged_attention(queries, key_cache, value_cache, meta, head_dim**-0.5, softcap=softcap)
    offset = 0
    for length in lengths:
        rows = slice(offset, offset + length)
        positions = torch.arange(length)
        args = (queries[rows], keys[rows], values[rows], positions, positions, head_dim**-0.5, window)
        expected = dense_reference_attention(*args, softcap=softcap)
        torch.testing.assert_close(out[rows], expected, atol=1e-5, rtol=1e-5)
        if softcap is not None:
            assert (expected - dense_reference_attention(*args)).abs().max() > 0.1
        offset += length


def test_softcap_reaches_the_probe_and_bounds_the_scores():
    """paged_attention hands its softcap to the probe, whose recorded weights are the capped softmax; a cap
    that is not positive is refused."""
    torch.manual_seed(3)
    block_size, num_kv_heads, num_heads, head_dim, length = 4, 1, 2, 8, 7
    meta = build_attention_metadata([0], [length], [[1, 2]], block_size, None, 0, torch.device("cpu"))
    key_cache = torch.zeros(3, block_size, num_kv_heads, head_dim)
    value_cache = torch.zeros_like(key_cache)
    keys, values = torch.randn(length, num_kv_heads, head_dim), torch.randn(length, num_kv_heads, head_dim)
    write_kv(key_cache, value_cache, keys, values, meta.slot_mapping)
    queries = QUERY_GAIN_WITH_SOFTCAP * torch.randn(length, num_heads, head_dim)
    positions = torch.arange(length)
    recorder = _RecordingAttention()
    probed = dataclasses.replace(meta, probe=recorder)
    out = paged_attention(queries, key_cache, value_cache, probed, head_dim**-0.5, softcap=2.0)
    capped = reference_attention_probs(queries, keys, positions, positions, head_dim**-0.5, softcap=2.0)
    torch.testing.assert_close(recorder.layers[0], capped)
    assert (capped - reference_attention_probs(queries, keys, positions, positions, head_dim**-0.5)).abs().max() > 0.1
    # Scores within (-2, 2): a visible key's weight is at least exp(-4) of the row's largest.
    visible = capped > 0
    assert (capped[visible] >= capped.amax(dim=-1, keepdim=True).expand_as(capped)[visible] * 0.018).all()
    torch.testing.assert_close(out, paged_attention(queries, key_cache, value_cache, meta, head_dim**-0.5, softcap=2.0))
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="softcap"):
            paged_attention(queries, key_cache, value_cache, meta, head_dim**-0.5, softcap=bad)


@pytest.mark.parametrize("prefix,count,num_heads,num_kv_heads", [(300, 600, 6, 2), (3000, 512, 4, 4)])
def test_long_chunk_after_its_prefix_attends_in_two_parts(prefix, count, num_heads, num_kv_heads):
    """One sequence's chunk of 512 or more tokens after its cached prefix, however long, attends to the prefix
    unmasked and to itself causally, merged by log-sum-exps: it equals the dense reference. Shorter chunks,
    batches and windows keep the masked call."""
    from engine.attention.prefix_split import split_prefix_length

    torch.manual_seed(prefix)
    block_size, head_dim = 16, 16
    total = prefix + count
    table = torch.randperm(-(-total // block_size) + 3)[: -(-total // block_size)].tolist()
    key_cache = torch.zeros(len(table) + 3, block_size, num_kv_heads, head_dim)
    value_cache = torch.zeros_like(key_cache)
    keys, values = torch.randn(total, num_kv_heads, head_dim), torch.randn(total, num_kv_heads, head_dim)
    meta = build_attention_metadata([0], [total], [table], block_size, None, 0, torch.device("cpu"))
    write_kv(key_cache, value_cache, keys, values, meta.slot_mapping)
    meta = build_attention_metadata([prefix], [count], [table], block_size, None, 0, torch.device("cpu"))
    queries = torch.randn(count, num_heads, head_dim) * 2
    assert split_prefix_length(queries, meta, None) == prefix
    out = paged_attention(queries, key_cache, value_cache, meta, head_dim**-0.5)
    positions = torch.arange(total)
    expected = dense_reference_attention(queries, keys, values, positions[prefix:], positions, head_dim**-0.5)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)

    assert split_prefix_length(queries, meta, 5.0) is None  # a softcap
    short = build_attention_metadata([prefix], [100], [table], block_size, None, 0, torch.device("cpu"))
    assert split_prefix_length(queries[:100], short, None) is None
    windowed = build_attention_metadata([prefix], [count], [table], block_size, 64, 0, torch.device("cpu"))
    assert split_prefix_length(queries, windowed, None) is None
    batch = build_attention_metadata([prefix, 0], [count, 4], [table, table], block_size, None, 0, torch.device("cpu"))
    assert split_prefix_length(torch.randn(count + 4, num_heads, head_dim), batch, None) is None


@pytest.mark.parametrize("window,sinks", [(None, 0), (16, 2)])
@SOFTCAPS
def test_a_long_chunk_beside_decoding_sequences_attends_sequence_by_sequence(window, sinks, softcap):
    """Padded to a chunk's queries, decoding sequences would multiply the step's attention; it runs sequence by
    sequence instead (decoding rows together in the decode kernel). Each sequence's output equals the dense
    reference, and equals the same sequence's step alone, bit for bit."""
    from engine.attention.paged import _ragged_shape

    torch.manual_seed(7)
    block_size, num_kv_heads, num_heads, head_dim = 4, 2, 4, 16
    # (cached tokens, new tokens): three decoding, a chunk after its prefix, a prompt from its first token
    shapes = [(30, 1), (47, 1), (12, 1), (20, 40), (0, 25)]
    pool = torch.randperm(200).tolist()
    key_cache = torch.randn(200, block_size, num_kv_heads, head_dim)
    value_cache = torch.randn(200, block_size, num_kv_heads, head_dim)
    tables = [[pool.pop() for _ in range(-(-(start + count) // block_size))] for start, count in shapes]
    starts, counts = [start for start, _ in shapes], [count for _, count in shapes]
    cpu = torch.device("cpu")
    meta = build_attention_metadata(starts, counts, tables, block_size, window, sinks, cpu)
    assert _ragged_shape(meta) is not None
    queries = torch.randn(sum(counts), num_heads, head_dim) * (QUERY_GAIN_WITH_SOFTCAP if softcap else 1.0)
    scale = head_dim**-0.5
    out = paged_attention(queries, key_cache, value_cache, meta, scale, softcap=softcap)
    offset = 0
    for (start, count), table in zip(shapes, tables):
        own = queries[offset : offset + count]
        alone = build_attention_metadata([start], [count], [table], block_size, window, sinks, cpu)
        assert torch.equal(
            out[offset : offset + count], paged_attention(own, key_cache, value_cache, alone, scale, softcap=softcap)
        )
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(start + count)])
        keys, values = key_cache.flatten(0, 1)[slots], value_cache.flatten(0, 1)[slots]
        positions = torch.arange(start + count)
        expected = dense_reference_attention(
            own, keys, values, positions[start:], positions, scale, window, sinks if window else 0, softcap=softcap
        )
        torch.testing.assert_close(out[offset : offset + count], expected, atol=1e-5, rtol=1e-5)
        offset += count


def _random_paged_cache(
    kv_cache_dtype: str, num_seqs: int, blocks_per_seq: int, block_size: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Key and value caches of random rows in `kv_cache_dtype`, each sequence's blocks spread over the pool
    ([num_seqs, blocks_per_seq] tables), and a visibility mask hiding ~15% of keys (never a sequence's first)."""
    from engine.ops import kv_format
    from engine.ops.decode_attention import store_rows

    rows = num_seqs * blocks_per_seq * block_size
    key_cache = kv_format.allocate(kv_cache_dtype, num_seqs * blocks_per_seq, block_size, num_kv_heads, head_dim, "cpu")
    value_cache = torch.zeros_like(key_cache)
    store_rows(key_cache, torch.randn(rows, num_kv_heads, head_dim), torch.arange(rows))
    store_rows(value_cache, torch.randn(rows, num_kv_heads, head_dim), torch.arange(rows))
    tables = torch.randperm(num_seqs * blocks_per_seq).view(num_seqs, blocks_per_seq)
    visible = torch.rand(num_seqs, blocks_per_seq * block_size) < 0.85
    visible[:, 0] = True
    return key_cache, value_cache, tables, visible


@pytest.mark.skipif(not available(), reason="native decode attention kernel unavailable")
@pytest.mark.parametrize("kv_cache_dtype", ["float32", "float16", "bfloat16", "int8"])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim",
    [(9, 3, 64), (8, 1, 24), (10, 2, 16), (4, 4, 12), (8, 2, 128), (6, 2, 96), (4, 4, 256)],
)
def test_decode_kernel_heads_give_the_same_numbers_in_every_split(kv_cache_dtype, num_heads, num_kv_heads, head_dim):
    """The kernel attends a sequence's heads together when the step has enough sequences, and a KV head or one
    query head at a time otherwise; heads of up to 64 values go by tiles of 8 keys, longer ones key by key. A
    sequence's output is the same alone as in a batch, bit for bit, and matches the torch path over the same
    cache (groups of 3, 8, 5, 1, 4 and 3; heads of 12 values end in a partial 8, heads of 96, 128 and 256 go key
    by key, in 512-bit registers where the CPU has AVX-512; blocks of 4 keys are half of the wide way's 8)."""
    torch.manual_seed(num_heads)
    num_seqs = 7
    key_cache, value_cache, tables, visible = _random_paged_cache(
        kv_cache_dtype, num_seqs, 6, 4, num_kv_heads, head_dim
    )
    queries = torch.randn(num_seqs, num_heads, head_dim) * 3
    args = (key_cache, value_cache)
    batched = decode_attention_native(queries, *args, tables, visible, head_dim**-0.5, softcap=6.0)
    for b in range(num_seqs):
        alone = decode_attention_native(
            queries[b : b + 1], *args, tables[b : b + 1], visible[b : b + 1], head_dim**-0.5, softcap=6.0
        )
        assert torch.equal(alone[0], batched[b])
    reference = decode_attention_torch(queries, *args, tables, visible, head_dim**-0.5, softcap=6.0)
    torch.testing.assert_close(batched, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not available(), reason="native decode attention kernel unavailable")
@pytest.mark.parametrize("kv_cache_dtype", ["float32", "float16", "int8"])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (4, 4, 12)])
def test_decode_kernel_long_sequences_in_spans_give_the_same_numbers_alone(
    kv_cache_dtype, num_heads, num_kv_heads, head_dim
):
    """Keys past 512 go in spans of 512 whose outputs are merged: 1,300 keys are 3 spans, 513 keys 2 (the second
    of one key), 512 and fewer one. Alone, each sequence's table and mask end at its own last block; in the batch
    they run to the widest's, so a short sequence's keys fill its first span and the spans after it see nothing.
    Alone equals batched bit for bit, and both match the torch path."""
    torch.manual_seed(head_dim)
    lengths, block_size = [1300, 37, 512, 513, 1030], 16
    blocks_per_seq = -(-max(lengths) // block_size)
    key_cache, value_cache, tables, visible = _random_paged_cache(
        kv_cache_dtype, len(lengths), blocks_per_seq, block_size, num_kv_heads, head_dim
    )
    for b, length in enumerate(lengths):
        visible[b, length:] = False
    queries = torch.randn(len(lengths), num_heads, head_dim) * 3
    args = (key_cache, value_cache)
    batched = decode_attention_native(queries, *args, tables, visible, head_dim**-0.5, softcap=6.0)
    for b, length in enumerate(lengths):
        own_blocks = -(-length // block_size)
        alone = decode_attention_native(
            queries[b : b + 1],
            *args,
            tables[b : b + 1, :own_blocks],
            visible[b : b + 1, : own_blocks * block_size],
            head_dim**-0.5,
            softcap=6.0,
        )
        assert torch.equal(alone[0], batched[b]), f"{length} keys"
    reference = decode_attention_torch(queries, *args, tables, visible, head_dim**-0.5, softcap=6.0)
    torch.testing.assert_close(batched, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not available(), reason="native decode attention kernel unavailable")
@pytest.mark.parametrize("kv_cache_dtype", ["float16", "int8"])
def test_decode_kernel_wide_way_matches_the_8_wide_way(kv_cache_dtype):
    """Heads of 96, 128 and 256 values run in 512-bit registers where the CPU has AVX-512 F/BW/VL: their outputs
    match the 8-wide way's over the same cache within float32 rounding (the scores sum in another order), with
    masked keys, a softcap, groups of 1 to 4 query heads and blocks of 16 keys (two groups of 8)."""
    from engine.ops.decode_attention import use_wide_attention, wide_attention

    if not wide_attention():
        pytest.skip(
            "the 512-bit decode attention is off: no AVX-512 F/BW/VL, or KVSERVE_NATIVE_ISA names a 256-bit build"
        )
    torch.manual_seed(5)
    num_seqs = 5
    try:
        for num_heads, num_kv_heads, head_dim in [(8, 2, 128), (3, 3, 96), (8, 2, 256), (12, 3, 128)]:
            key_cache, value_cache, tables, visible = _random_paged_cache(
                kv_cache_dtype, num_seqs, 3, 16, num_kv_heads, head_dim
            )
            queries = torch.randn(num_seqs, num_heads, head_dim) * 2
            args = (queries, key_cache, value_cache, tables, visible, head_dim**-0.5)
            assert use_wide_attention("decode_attention", True)
            wide = decode_attention_native(*args, softcap=8.0)
            assert not use_wide_attention("decode_attention", False)
            narrow = decode_attention_native(*args, softcap=8.0)
            assert not torch.equal(wide, narrow)  # the two ways ran
            torch.testing.assert_close(wide, narrow, atol=2e-6, rtol=2e-5)
    finally:
        use_wide_attention("decode_attention", True)
