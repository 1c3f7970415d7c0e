"""The Triton prefill / mixed-step paged attention kernel, run on the CPU in Triton's interpreter.

Every step is held against dense_reference_attention per sequence and against paged_attention_torch on the
same metadata. Physical block ids are shuffled so the block-table addressing is exercised; block_size 16,
head_dim 32 unless a test says otherwise. Shapes stay small: the interpreter runs each tl.dot in numpy.
"""

from __future__ import annotations

import dataclasses
import importlib
import os

os.environ["TRITON_INTERPRET"] = "1"  # read when a @triton.jit decorator runs: kernels then take CPU tensors

import pytest
import torch

pytest.importorskip("triton")

from engine.attention.metadata import AttentionMetadata, build_attention_metadata, visible_mask
from engine.attention.paged import paged_attention_torch, write_kv
from engine.attention.reference import dense_reference_attention
from engine.config import cdiv

pytestmark = pytest.mark.slow

prefill = importlib.import_module("engine.attention.triton_prefill")
if not prefill._interpreted():  # imported earlier in this process without the interpreter: decorate again
    prefill = importlib.reload(prefill)

BLOCK_SIZE = 16
HEAD_DIM = 32
TOLERANCE = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.float16: {"atol": 2e-3, "rtol": 2e-3}}
CPU = torch.device("cpu")


@dataclasses.dataclass
class Step:
    """One step's flat batch over a paged cache, and each sequence's dense K/V for the reference."""

    query: torch.Tensor  # [T, H_q, D]
    key_cache: torch.Tensor  # [num_blocks, BLOCK_SIZE, H_kv, D]
    value_cache: torch.Tensor
    meta: AttentionMetadata
    tables: list[list[int]]
    keys: list[torch.Tensor]  # per sequence [start + count, H_kv, D]: every position, cached or new
    values: list[torch.Tensor]
    starts: list[int]
    counts: list[int]
    window: int | None
    sinks: int
    scale: float
    softcap: float | None = None  # attention-logit softcap every path is run with


# Softcapped steps scale their queries by this: scores of several units, so a softcap of 5 saturates tanh.
QUERY_GAIN_WITH_SOFTCAP = 8.0


def make_step(
    starts: list[int],
    counts: list[int],
    *,
    num_heads: int = 2,
    num_kv_heads: int = 2,
    head_dim: int = HEAD_DIM,
    dtype: torch.dtype = torch.float32,
    window: int | None = None,
    sinks: int = 0,
    shared_prefix_blocks: int = 0,
    key_multiplier: dict[int, float] | None = None,
    seed: int = 0,
    softcap: float | None = None,
) -> Step:
    """Sequence i has `starts[i]` cached tokens and computes `counts[i]` new ones.

    Blocks get shuffled physical ids; blocks the window has released point at the null block (as the
    scheduler leaves them) and are never written. Sequences after the first share the first
    `shared_prefix_blocks` physical blocks (and tokens) of the first. `key_multiplier` scales the keys
    of logical blocks {block: factor} of every sequence. With a softcap the queries are scaled by
    QUERY_GAIN_WITH_SOFTCAP and the step carries the softcap for the kernels and references.
    """
    gen = torch.Generator().manual_seed(seed)
    totals = [start + count for start, count in zip(starts, counts)]
    num_blocks = 1 + sum(cdiv(total, BLOCK_SIZE) for total in totals) + 3  # a few blocks nobody uses
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    keys, values, tables = [], [], []
    for i, total in enumerate(totals):
        key = torch.randn(total, num_kv_heads, head_dim, generator=gen)
        value = torch.randn(total, num_kv_heads, head_dim, generator=gen)
        table = [free.pop() for _ in range(cdiv(total, BLOCK_SIZE))]
        if i > 0 and shared_prefix_blocks:
            assert starts[i] >= shared_prefix_blocks * BLOCK_SIZE, "a shared block must be fully cached"
            shared = shared_prefix_blocks * BLOCK_SIZE
            table[:shared_prefix_blocks] = tables[0][:shared_prefix_blocks]
            key[:shared], value[:shared] = keys[0][:shared], values[0][:shared]
        for block, factor in (key_multiplier or {}).items():
            key[block * BLOCK_SIZE : (block + 1) * BLOCK_SIZE] *= factor
        keys.append(key.to(dtype))
        values.append(value.to(dtype))
        tables.append(table)

    key_cache = torch.zeros(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    # The cached prefix, minus the blocks the window has released: written before this step.
    for start, table, key, value in zip(starts, tables, keys, values):
        if window is not None:
            low_block = max(start - window + 1, 0) // BLOCK_SIZE
            for block in range(min(cdiv(sinks, BLOCK_SIZE), low_block), low_block):
                table[block] = 0
        positions = torch.tensor([p for p in range(start) if table[p // BLOCK_SIZE] != 0], dtype=torch.int64)
        slots = torch.tensor(table)[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
        write_kv(key_cache, value_cache, key[positions], value[positions], slots)

    meta = build_attention_metadata(starts, counts, tables, BLOCK_SIZE, window, sinks, CPU)
    # This step's new tokens: written by write_kv before attention runs, as the runner does.
    new_keys = torch.cat([key[start:] for start, key in zip(starts, keys)])
    new_values = torch.cat([value[start:] for start, value in zip(starts, values)])
    write_kv(key_cache, value_cache, new_keys, new_values, meta.slot_mapping)
    query = torch.randn(sum(counts), num_heads, head_dim, generator=gen)
    if softcap is not None:
        query *= QUERY_GAIN_WITH_SOFTCAP
    query = query.to(dtype)
    return Step(
        query,
        key_cache,
        value_cache,
        meta,
        tables,
        keys,
        values,
        starts,
        counts,
        window,
        sinks,
        head_dim**-0.5,
        softcap,
    )


def dense_expected(step: Step) -> list[torch.Tensor]:
    """dense_reference_attention of each sequence's new tokens over all its positions (the step's softcap)."""
    expected, offset = [], 0
    for start, count, key, value in zip(step.starts, step.counts, step.keys, step.values):
        expected.append(
            dense_reference_attention(
                step.query[offset : offset + count],
                key,
                value,
                torch.arange(start, start + count),
                torch.arange(start + count),
                step.scale,
                step.window,
                step.sinks,
                softcap=step.softcap,
            )
        )
        offset += count
    return expected


def assert_matches_references(step: Step, out: torch.Tensor | None = None, torch_path: bool = True) -> None:
    args = (step.query, step.key_cache, step.value_cache, step.meta, step.scale)
    if out is None:
        out = prefill.triton_paged_prefill(*args, softcap=step.softcap)
    tolerance = TOLERANCE[step.query.dtype]
    assert out.shape == step.query.shape and out.dtype == step.query.dtype
    assert torch.isfinite(out).all()
    offsets = [sum(step.counts[:i]) for i in range(len(step.counts))]
    for offset, count, expected in zip(offsets, step.counts, dense_expected(step)):
        torch.testing.assert_close(out[offset : offset + count], expected, **tolerance)
    if torch_path:
        torch_out = paged_attention_torch(*args, softcap=step.softcap)
        torch.testing.assert_close(out, torch_out, **tolerance)
    if step.softcap is not None:
        uncapped = torch.cat(dense_expected(dataclasses.replace(step, softcap=None)))
        assert (out.float() - uncapped.float()).abs().max() > 0.1, "the softcap must change the attention here"


DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
HEADS = pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (6, 2)], ids=["mha", "gqa3"])
WINDOWS = pytest.mark.parametrize("window,sinks", [(None, 0), (12, 0), (12, 4)], ids=["full", "window", "sinks"])


@DTYPES
@HEADS
@WINDOWS
def test_ragged_prompts(dtype, num_heads, num_kv_heads, window, sinks):
    """Prompts of 5, 16 and 37 tokens in one step: 1, 1 and 3 query tiles, and padding entries."""
    step = make_step(
        [0, 0, 0], [5, 16, 37], num_heads=num_heads, num_kv_heads=num_kv_heads, dtype=dtype, window=window, sinks=sinks
    )
    assert len(set(step.meta.key_blocks[step.meta.key_block_logical >= 0].tolist())) == 5  # 1 + 1 + 3 blocks
    assert_matches_references(step)


@DTYPES
@pytest.mark.parametrize("window,sinks", [(None, 0), (16, 4)], ids=["full", "sinks"])
def test_chunked_prefill_continues_cached_prefix(dtype, window, sinks):
    """20 cached tokens + 13 new, next to a second sequence with 40 cached + 20 new (two query tiles)."""
    step = make_step([20, 40], [13, 20], num_heads=6, num_kv_heads=2, dtype=dtype, window=window, sinks=sinks)
    assert_matches_references(step)


@DTYPES
def test_sinks_with_blocks_released_to_the_null_block(dtype):
    """Window 16 and 4 sinks: sequence 0 (70 cached) has released blocks 1 and 2 to block 0."""
    step = make_step([70, 40], [9, 20], num_heads=6, num_kv_heads=2, dtype=dtype, window=16, sinks=4, seed=1)
    assert step.tables[0][1:3] == [0, 0] and 0 not in step.tables[0][3:] and step.tables[0][0] != 0
    real = step.meta.key_block_logical >= 0
    assert (step.meta.key_blocks[real] != 0).all()  # the metadata lists the sink block, never a released one
    assert step.meta.key_block_logical[0, :3].tolist() == [0, 3, 4]
    assert_matches_references(step)


@DTYPES
def test_shared_prefix(dtype):
    """Two sequences whose tables point at the same two physical prefix blocks (a prefix-cache hit)."""
    step = make_step([32, 32], [10, 7], num_heads=6, num_kv_heads=2, dtype=dtype, shared_prefix_blocks=2, seed=2)
    assert step.tables[0][:2] == step.tables[1][:2] and step.tables[0][2] != step.tables[1][2]
    assert_matches_references(step)


@DTYPES
@pytest.mark.parametrize("window,sinks", [(None, 0), (16, 4)], ids=["full", "sinks"])
def test_mixed_prefill_and_decodes(dtype, window, sinks):
    """One 37-token prompt prefilling while three sequences decode one token each."""
    step = make_step(
        [0, 27, 50, 9], [37, 1, 1, 1], num_heads=6, num_kv_heads=2, dtype=dtype, window=window, sinks=sinks, seed=3
    )
    assert_matches_references(step)


@DTYPES
@pytest.mark.parametrize("window,sinks", [(None, 0), (16, 4)], ids=["full", "sinks"])
def test_softcap(dtype, window, sinks):
    """Softcap 5 over large scores: a whole prompt, a chunk continuing 20 cached tokens and a decode."""
    step = make_step(
        [0, 20, 50], [37, 13, 1], num_heads=6, num_kv_heads=2, dtype=dtype, window=window, sinks=sinks, softcap=5.0
    )
    assert_matches_references(step)


def test_decode_only_step():
    step = make_step([9, 40, 16], [1, 1, 1], num_heads=6, num_kv_heads=2, seed=4)
    assert step.meta.is_decode_only
    assert_matches_references(step)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_larger_head_dims(head_dim):
    step = make_step([0, 20], [21, 5], num_heads=3, num_kv_heads=1, head_dim=head_dim, dtype=torch.float16, seed=5)
    assert_matches_references(step)


@pytest.mark.parametrize("dominant_block", [2, 1])
def test_online_softmax_rescales_when_a_later_block_dominates(dominant_block):
    """The keys of a later block are 20x larger: its scores exceed the running max of the blocks before,
    so the accumulator and sum gathered so far must be rescaled (a missing rescale is far off)."""
    step = make_step([40], [8], num_heads=6, num_kv_heads=2, key_multiplier={dominant_block: 20.0}, seed=6)
    expected = dense_expected(step)[0]
    unscaled = dense_expected(make_step([40], [8], num_heads=6, num_kv_heads=2, seed=6))[0]
    assert (expected - unscaled).abs().max() > 1.0  # the big block really changes the answer
    assert_matches_references(step)


def nan_poisoned_step() -> tuple[Step, AttentionMetadata]:
    """A step whose metadata also lists blocks no query can see, each holding NaN keys and values.

    Sequence 0 (64 cached + 8 new, window 16, 4 sinks) gets extra entries: logical blocks 1 and 2
    (wholly before the window of query 64, no sink) and logical block 5 (keys 80..95, after the last
    query 71). Sequence 1's row is padded to the longer row with the null block, also NaN. Masking
    such a block after loading it is not enough: its probabilities are 0, but 0 * NaN values = NaN.
    """
    step = make_step([64, 0], [8, 20], num_heads=6, num_kv_heads=2, window=16, sinks=4, seed=7)
    meta = step.meta
    assert meta.key_block_logical[0].tolist() == [0, 3, 4] and meta.key_block_logical[1].tolist() == [0, 1, -1]
    poisoned = [b for b in range(1, step.key_cache.shape[0]) if b not in step.tables[0] + step.tables[1]][:3]
    extra_logical = torch.tensor([[1, 2, 5], [-1, -1, -1]], dtype=torch.int32)
    extra_blocks = torch.tensor([poisoned, [0, 0, 0]], dtype=torch.int64)
    # Sink block, a stale block, the window, a stale block, the future block: order is not relied on.
    order = [0, 3, 1, 4, 2, 5]
    key_blocks = torch.cat([meta.key_blocks, extra_blocks], dim=1)[:, order]
    key_logical = torch.cat([meta.key_block_logical, extra_logical], dim=1)[:, order]
    for block in [0, *poisoned]:
        step.key_cache[block] = float("nan")
        step.value_cache[block] = float("nan")
    return step, dataclasses.replace(meta, key_blocks=key_blocks, key_block_logical=key_logical)


def test_skipped_blocks_are_never_read():
    step, poisoned_meta = nan_poisoned_step()
    # The premise: a fully masked block that were multiplied in would turn the output into NaN.
    assert torch.isnan(torch.zeros(1, BLOCK_SIZE) @ step.value_cache[0, :, 0]).all()
    out = prefill.triton_paged_prefill(step.query, step.key_cache, step.value_cache, poisoned_meta, step.scale)
    # paged_attention_torch gathers every listed block, NaN ones included: only the dense reference here.
    assert_matches_references(step, out, torch_path=False)


def expected_visits(starts: list[int], counts: list[int], meta: AttentionMetadata, window, sinks) -> torch.Tensor:
    """int32 [B, num_tiles]: entries of each sequence with a key visible to some query of the tile."""
    num_tiles = cdiv(max(counts), prefill.BLOCK_M)
    visits = torch.zeros(len(starts), num_tiles, dtype=torch.int32)
    for b, (start, count) in enumerate(zip(starts, counts)):
        logical = meta.key_block_logical[b].long()
        key_positions = (logical[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE)).masked_fill(logical[:, None] < 0, -1)
        for tile in range(cdiv(count, prefill.BLOCK_M)):
            rows = torch.arange(tile * prefill.BLOCK_M, min(count, (tile + 1) * prefill.BLOCK_M))
            mask = visible_mask(start + rows, key_positions, window, sinks)  # [N, rows, BLOCK_SIZE]
            visits[b, tile] = mask.flatten(1).any(dim=1).sum()
    return visits


@pytest.mark.parametrize(
    "starts,counts,window,sinks",
    [
        ([0, 0, 0], [5, 16, 50], None, 0),  # causal: tile 0 of the 50-token prompt skips blocks 1..3
        ([0, 0, 0], [5, 16, 50], 12, 0),  # window: its last tiles skip the blocks behind the window
        ([0, 0, 0], [5, 16, 50], 12, 4),  # sinks keep block 0 in
        ([70, 40], [9, 20], 16, 4),
    ],
    ids=["causal", "window", "sinks", "released"],
)
def test_visits_only_blocks_with_a_visible_key(starts, counts, window, sinks):
    """The kernel loads exactly the entries some query of its tile can see, for every head."""
    step = make_step(starts, counts, num_heads=3, num_kv_heads=1, window=window, sinks=sinks, seed=8)
    expected = expected_visits(starts, counts, step.meta, window, sinks)
    visits = torch.zeros(*expected.shape, 3, dtype=torch.int32)
    out = prefill._launch(step.query, step.key_cache, step.value_cache, step.meta, step.scale, visits)
    assert_matches_references(step, out)
    assert (visits == expected[:, :, None]).all(), (visits[..., 0], expected)
    listed = (step.meta.key_block_logical >= 0).sum(dim=1)
    tiles = torch.tensor([cdiv(count, prefill.BLOCK_M) for count in counts])
    assert (expected.sum(dim=1) < listed * tiles).any()  # some tile skips some listed block


def test_visits_skip_the_poisoned_entries():
    step, poisoned_meta = nan_poisoned_step()
    visits = torch.zeros(2, 2, 6, dtype=torch.int32)
    prefill._launch(step.query, step.key_cache, step.value_cache, poisoned_meta, step.scale, visits)
    # Sequence 0: sink block, blocks 3 and 4 of its 6 entries; sequence 1: tile 0 sees block 0, tile 1 both.
    assert visits[0, 0].tolist() == [3] * 6 and visits[1].tolist() == [[1] * 6, [2] * 6]


def test_availability_and_rejected_inputs():
    assert prefill.available() and prefill.unavailable_reason() is None
    step = make_step([0], [4])
    args = (step.key_cache, step.value_cache, step.meta, step.scale)
    with pytest.raises(ValueError, match="dtypes"):  # keys and values in two formats
        prefill.triton_paged_prefill(step.query, step.key_cache, step.value_cache.half(), *args[2:])
    with pytest.raises(ValueError, match="head_dim 24"):
        prefill.triton_paged_prefill(
            step.query[..., :24], step.key_cache[..., :24], step.value_cache[..., :24], *args[2:]
        )
    with pytest.raises(ValueError, match="block_size 8"):
        prefill.triton_paged_prefill(step.query, step.key_cache[:, :8], step.value_cache[:, :8], *args[2:])
    with pytest.raises(ValueError, match="multiple"):
        prefill.triton_paged_prefill(step.query[:, :1].expand(-1, 3, -1), *args)
    with pytest.raises(ValueError, match="softcap"):
        prefill.triton_paged_prefill(step.query, *args, softcap=-1.0)
