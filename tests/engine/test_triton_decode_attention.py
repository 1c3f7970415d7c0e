"""The Triton paged decode kernel (engine/attention/triton_decode.py) in Triton's interpreter on CPU.

Every case is checked against dense_reference_attention per sequence and paged_attention_torch on the
same cache: GQA groups 1, 3 (and 16, the tl.dot path), no window / window / window with sinks and
released blocks, ragged lengths, a prefix shared between two block tables, float32 / float16 caches,
split-K forced to 1, 2 and 3 splits, and attention-logit softcapping. Shapes are small: the interpreter
runs each program in numpy.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, replace

import pytest
import torch

# The kernels are decorated for the interpreter only if this is set before the module is imported.
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from engine.attention import triton_decode as tda  # noqa: E402
from engine.attention.metadata import AttentionMetadata, build_attention_metadata  # noqa: E402
from engine.attention.paged import paged_attention_torch, write_kv  # noqa: E402
from engine.attention.reference import dense_reference_attention  # noqa: E402

pytestmark = pytest.mark.slow

if not tda.available():
    pytest.skip(
        "the triton kernels were built before TRITON_INTERPRET=1 was set and there is no CUDA device",
        allow_module_level=True,
    )

BLOCK_SIZE = 16
# Context lengths of one ragged batch (the query is the last token of each); sequence 3 shares its
# first SHARED_BLOCKS blocks with sequence 2, and with a window of 20 it has released blocks 1 and 2.
TOTALS = [1, 17, 40, 70]
SHARED_BLOCKS = 2
MASKS = {"full": (None, 0), "window": (24, 0), "window_sinks": (20, 5)}
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@dataclass
class DecodeStep:
    query: torch.Tensor  # [B, H_q, D]
    key_cache: torch.Tensor  # [num_blocks, BLOCK_SIZE, H_kv, D]
    value_cache: torch.Tensor
    meta: AttentionMetadata
    keys: list[torch.Tensor]  # per sequence [total, H_kv, D], every position, in the cache dtype
    values: list[torch.Tensor]
    scale: float


def make_step(
    *,
    num_kv_heads: int,
    group: int,
    head_dim: int = 32,
    window: int | None = None,
    sinks: int = 0,
    dtype: torch.dtype = torch.float32,
    totals: list[int] = TOTALS,
    seed: int = 0,
    late_block_scale: float = 1.0,
    query_gain: float = 1.0,
) -> DecodeStep:
    """A decode step over a cache filled through shuffled block tables.

    Slots no sequence has written hold large noise, so reading one that should be invisible (or the
    wrong block) shows. With a window, blocks wholly behind it (not sinks) are released: their table
    entries point at the null block 0. late_block_scale multiplies the keys of each sequence's last
    block, the last entry the kernel visits, giving large score ranges across blocks. query_gain
    multiplies the queries (large scores, for a softcap to saturate).
    """
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 2 * sum(-(-t // BLOCK_SIZE) for t in totals) + 1
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    key_cache = (50 * torch.randn(shape, generator=gen)).to(dtype)
    value_cache = (50 * torch.randn(shape, generator=gen)).to(dtype)
    free = list(range(1, num_blocks))
    rng.shuffle(free)

    tables, keys, values = [], [], []
    for i, total in enumerate(totals):
        num_table_blocks = -(-total // BLOCK_SIZE)
        seq_keys = torch.randn(total, num_kv_heads, head_dim, generator=gen)
        seq_values = torch.randn(total, num_kv_heads, head_dim, generator=gen)
        seq_keys[(num_table_blocks - 1) * BLOCK_SIZE :] *= late_block_scale
        table = [free.pop() for _ in range(num_table_blocks)]
        if i == 3:  # shares sequence 2's first blocks: same physical blocks, same K/V
            shared = SHARED_BLOCKS * BLOCK_SIZE
            assert totals[2] > shared and total > shared
            table[:SHARED_BLOCKS] = tables[2][:SHARED_BLOCKS]
            seq_keys[:shared] = keys[2][:shared]
            seq_values[:shared] = values[2][:shared]
        seq_keys, seq_values = seq_keys.to(dtype), seq_values.to(dtype)
        for pos in range(total - 1):  # the cached context; the query's own K/V goes through write_kv
            key_cache[table[pos // BLOCK_SIZE], pos % BLOCK_SIZE] = seq_keys[pos]
            value_cache[table[pos // BLOCK_SIZE], pos % BLOCK_SIZE] = seq_values[pos]
        tables.append(table)
        keys.append(seq_keys)
        values.append(seq_values)

    if window is not None:
        for table, total in zip(tables, totals):
            newest = total - 1
            sink_blocks = -(-sinks // BLOCK_SIZE)
            for block in range(sink_blocks, len(table)):
                if (block + 1) * BLOCK_SIZE - 1 <= newest - window:  # every slot behind the window
                    table[block] = 0

    starts = [t - 1 for t in totals]
    meta = build_attention_metadata(starts, [1] * len(totals), tables, BLOCK_SIZE, window, sinks, torch.device("cpu"))
    assert meta.is_decode_only
    new_keys = torch.stack([k[-1] for k in keys])
    new_values = torch.stack([v[-1] for v in values])
    write_kv(key_cache, value_cache, new_keys, new_values, meta.slot_mapping)
    query = (query_gain * torch.randn(len(totals), num_kv_heads * group, head_dim, generator=gen)).to(dtype)
    return DecodeStep(query, key_cache, value_cache, meta, keys, values, head_dim**-0.5)


def run_kernel(step: DecodeStep, num_splits: int | None, softcap: float | None = None) -> torch.Tensor:
    return tda.triton_paged_decode(
        step.query, step.key_cache, step.value_cache, step.meta, step.scale, num_splits=num_splits, softcap=softcap
    )


def check_against_references(step: DecodeStep, out: torch.Tensor, softcap: float | None = None) -> None:
    """out equals the dense reference per sequence and paged_attention_torch on the same cache (both with
    the same softcap); with a softcap, the uncapped reference must be far from out."""
    tol = TOLERANCE[step.query.dtype]
    assert out.shape == step.query.shape and out.dtype == step.query.dtype
    assert torch.isfinite(out).all()
    window, sinks = step.meta.sliding_window, step.meta.num_sink_tokens
    uncapped_gap = 0.0
    for b, (keys, values) in enumerate(zip(step.keys, step.values)):
        total = keys.shape[0]
        args = (step.query[b : b + 1], keys, values, torch.tensor([total - 1]), torch.arange(total), step.scale)
        expected = dense_reference_attention(*args, window, sinks, softcap=softcap)
        torch.testing.assert_close(out[b : b + 1], expected, atol=tol, rtol=tol, msg=f"sequence {b} vs dense")
        if softcap is not None:
            uncapped = dense_reference_attention(*args, window, sinks)
            uncapped_gap = max(uncapped_gap, (out[b : b + 1].float() - uncapped.float()).abs().max().item())
    torch_path = paged_attention_torch(
        step.query, step.key_cache, step.value_cache, step.meta, step.scale, softcap=softcap
    )
    torch.testing.assert_close(out, torch_path, atol=tol, rtol=tol)
    if softcap is not None:
        assert uncapped_gap > 0.1, "the softcap must change the attention in this test"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("mask", list(MASKS))
# (2, 3): two groups of 3, so a wrong query-head -> KV-head mapping shows (with one KV head it cannot).
@pytest.mark.parametrize("num_kv_heads,group", [(2, 1), (1, 3), (2, 3)], ids=["mha", "gqa3_1kv", "gqa3_2kv"])
def test_decode_matches_references(num_kv_heads, group, mask, dtype):
    window, sinks = MASKS[mask]
    step = make_step(num_kv_heads=num_kv_heads, group=group, window=window, sinks=sinks, dtype=dtype, seed=group)
    check_against_references(step, run_kernel(step, num_splits=1))


def test_window_sinks_step_exercises_null_blocks_and_sharing():
    """The window_sinks case really releases blocks and shares a physical block between tables."""
    window, sinks = MASKS["window_sinks"]
    step = make_step(num_kv_heads=1, group=1, window=window, sinks=sinks)
    logical = step.meta.key_block_logical
    # Sequence 3 (70 tokens, query at 69): sink block 0, then blocks 3 and 4; blocks 1 and 2 released.
    assert logical[3].tolist() == [0, 3, 4]
    blocks = step.meta.key_blocks
    assert blocks[2, 0] == blocks[3, 0]  # the shared sink block: one physical block in both tables
    # Sequence 2 still reads its logical block 1, shared with sequence 3, which has released it.
    assert logical[2].tolist() == [0, 1, 2] and blocks[2, 1] not in blocks[3].tolist()
    assert (logical[0] == -1).sum() == 2  # the 1-token sequence is padded


@pytest.mark.parametrize("num_splits", [1, 2])
def test_skips_invisible_entries_without_loading(num_splits):
    """Entries none of whose keys is visible are not loaded: padding in the middle of a row, a block after
    the query, and blocks behind the window holding no sink. They point at a NaN-filled block."""
    window, sinks = MASKS["window_sinks"]
    step = make_step(num_kv_heads=2, group=1, window=window, sinks=sinks, seed=13)
    meta = step.meta
    used = set(meta.key_blocks.flatten().tolist())
    nan_block = next(b for b in range(1, step.key_cache.shape[0]) if b not in used)
    step.key_cache[nan_block] = float("nan")
    step.value_cache[nan_block] = float("nan")
    # Per sequence: the logical blocks to list, in order (-1: padding). Sequence 3 (query at 69) lists
    # blocks 1 and 2, wholly behind its window and not sinks; every sequence lists the block after its query.
    rows = [[0, -1, 1], [0, 1, 2], [0, 1, 2, 3], [0, 1, 2, 3, 4, 5]]
    width = max(len(r) for r in rows)
    key_blocks = torch.zeros(len(rows), width, dtype=torch.int64)
    logical = torch.full((len(rows), width), -1, dtype=torch.int32)
    loaded = []
    for b, row in enumerate(rows):
        physical = dict(zip(meta.key_block_logical[b].tolist(), meta.key_blocks[b].tolist()))
        physical.pop(-1, None)
        loaded.append(len(physical))
        for n, block in enumerate(row):
            logical[b, n] = block
            key_blocks[b, n] = 0 if block < 0 else physical.get(block, nan_block)
    padded = replace(meta, key_blocks=key_blocks, key_block_logical=logical)

    expected = run_kernel(step, num_splits=1)
    visits = torch.zeros(len(rows), 2, num_splits, dtype=torch.int32)
    out = tda._paged_decode(step.query, step.key_cache, step.value_cache, padded, step.scale, num_splits, visits)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert loaded == [1, 2, 3, 3]
    assert visits.sum(dim=2).tolist() == [[n, n] for n in loaded]  # each KV head loads each visible entry once


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("mask", list(MASKS))
def test_split_k_agrees(mask, dtype):
    """1, 2 and 3 splits (and the automatic choice) agree with each other and the references."""
    window, sinks = MASKS[mask]
    step = make_step(num_kv_heads=2, group=3, window=window, sinks=sinks, dtype=dtype, seed=7)
    outs = {splits: run_kernel(step, num_splits=splits) for splits in (1, 2, 3)}
    for splits, out in outs.items():
        check_against_references(step, out)
        if splits > 1:
            torch.testing.assert_close(out, outs[1], atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    torch.testing.assert_close(run_kernel(step, num_splits=None), outs[1], atol=0, rtol=0)  # auto: 1 here


@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize("mask", ["full", "window_sinks"])
def test_large_score_range_across_blocks(mask, num_splits):
    """Keys of the last block scaled by 20: its scores dwarf the earlier blocks', so the running max
    jumps late and the accumulator and sum must be rescaled (an unrescaled sum is far off)."""
    window, sinks = MASKS[mask]
    step = make_step(num_kv_heads=1, group=3, window=window, sinks=sinks, seed=11, late_block_scale=20.0)
    check_against_references(step, run_kernel(step, num_splits))


@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize("mask", ["full", "window_sinks"])
def test_softcap(mask, num_splits):
    """Softcap 5 over queries scaled by 8: scores saturate tanh; the kernel matches the capped references."""
    window, sinks = MASKS[mask]
    step = make_step(num_kv_heads=2, group=3, window=window, sinks=sinks, seed=17, query_gain=8.0)
    check_against_references(step, run_kernel(step, num_splits, softcap=5.0), softcap=5.0)


def test_softcap_with_tl_dot_in_float16():
    """16 query heads per KV head (the tl.dot scores) in float16, capped, over two splits."""
    step = make_step(
        num_kv_heads=1,
        group=16,
        window=20,
        sinks=5,
        dtype=torch.float16,
        totals=[17, 40, 40, 70],
        seed=19,
        query_gain=8.0,
    )
    check_against_references(step, run_kernel(step, num_splits=2, softcap=5.0), softcap=5.0)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_head_dims(head_dim):
    step = make_step(num_kv_heads=2, group=1, head_dim=head_dim, window=20, sinks=5, seed=head_dim)
    check_against_references(step, run_kernel(step, num_splits=2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_large_group_uses_tl_dot(dtype):
    """16 query heads per KV head: the scores and P @ V go through tl.dot."""
    step = make_step(num_kv_heads=2, group=16, window=20, sinks=5, dtype=dtype, totals=[17, 40, 40, 70], seed=5)
    check_against_references(step, run_kernel(step, num_splits=2))


def test_bfloat16_cache():
    step = make_step(num_kv_heads=1, group=2, window=24, dtype=torch.bfloat16, seed=3)
    check_against_references(step, run_kernel(step, num_splits=1))


def test_choose_num_splits():
    assert tda.choose_num_splits(1, 1) == 1
    assert tda.choose_num_splits(31, 1) == 1  # short contexts: one split, no reduction kernel
    assert tda.choose_num_splits(64, 1) == 4  # >= 16 blocks per split
    assert tda.choose_num_splits(10_000, 1) == 16  # capped
    assert tda.choose_num_splits(10_000, 512) == 1  # the grid is already full
    assert tda.choose_num_splits(10_000, 128) == 4


def test_rejects_unsupported_inputs():
    step = make_step(num_kv_heads=1, group=1, totals=[17, 20])
    prefill = build_attention_metadata([0], [3], [[1, 2]], BLOCK_SIZE, None, 0, torch.device("cpu"))
    with pytest.raises(ValueError, match="decode-only"):
        tda.triton_paged_decode(step.query, step.key_cache, step.value_cache, prefill, step.scale)
    odd = torch.zeros(4, BLOCK_SIZE, 1, 24)
    with pytest.raises(ValueError, match="power of 2"):
        tda.triton_paged_decode(torch.zeros(2, 1, 24), odd, odd, step.meta, step.scale)
    with pytest.raises(ValueError, match="num_splits"):
        tda.triton_paged_decode(step.query, step.key_cache, step.value_cache, step.meta, step.scale, num_splits=0)
    with pytest.raises(ValueError, match="softcap"):
        tda.triton_paged_decode(step.query, step.key_cache, step.value_cache, step.meta, step.scale, softcap=0.0)
