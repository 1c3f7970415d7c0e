"""KV cache formats: what each stores, the native writes against kv_format's, and every attention path over a
cache in each format against the dense reference over what that cache holds."""

from __future__ import annotations

import random

import pytest
import torch

from engine.attention.metadata import build_attention_metadata
from engine.attention.paged import paged_attention, paged_attention_torch, write_kv
from engine.attention.reference import dense_reference_attention
from engine.config import EngineConfig
from engine.ops import decode_attention, kv_format
from tests.support.native_kernels import needs_kernels

FORMATS = ["float32", "float16", "bfloat16", "int8"]
# How far a stored value may be from the value written, relative to the largest magnitude of its row.
ROUNDING = {"float32": 0.0, "float16": 2**-11, "bfloat16": 2**-8, "int8": 0.5 / 127}


def _rows(num_tokens: int, num_kv_heads: int, head_dim: int, seed: int) -> torch.Tensor:
    """Random rows with the cases a format must get right: a zero row, a row of one large value, ties."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen) * 3
    rows[0, 0] = 0.0
    rows[-1, -1] = 0.0
    rows[-1, -1, 0] = -1e4
    rows[0, -1] = torch.arange(head_dim) - head_dim / 2  # int8: exact halves after scaling in some rows
    return rows


def test_each_format_has_the_bytes_it_says_and_auto_is_16_bit_only_for_quantized_cpu_models():
    assert [kv_format.row_bytes(name, 64) for name in FORMATS] == [256, 128, 128, 68]
    assert kv_format.allocate("int8", 3, 4, 2, 64, torch.device("cpu")).shape == (3, 4, 2, 68)
    resolve = kv_format.resolve_kv_cache_dtype
    assert resolve("auto", "cpu", "float32", "gguf") == "float16"
    assert resolve("auto", "cpu", "float32", "int8") == "float16"
    assert resolve("auto", "cpu", "float32", "none") == "float32"  # the exact mode stays exact
    assert resolve("auto", "cpu", "bfloat16", "none") == "bfloat16"
    assert resolve("auto", "cuda", "bfloat16", "none") == "bfloat16"
    assert resolve("int8", "cuda", "bfloat16", "none") == "int8"
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(model="m", kv_cache_dtype="fp8")


@pytest.mark.parametrize("name", FORMATS)
def test_a_cache_holds_each_value_within_its_formats_rounding(name):
    rows = _rows(6, 2, 64, seed=1)
    cache = kv_format.allocate(name, 2, 4, 2, 64, torch.device("cpu"))
    slots = torch.tensor([5, 0, 3, 7, 1, 2])
    kv_format.store(cache, rows, slots)
    held = kv_format.read(cache.view(-1, 2, cache.shape[-1])[slots], torch.float32)
    largest = rows.abs().amax(dim=-1, keepdim=True)
    assert ((held - rows).abs() <= largest * ROUNDING[name]).all()
    assert (held[0, 0] == 0).all() and (held[-1, -1, 1:] == 0).all()
    if name == "int8":
        values, scales = kv_format.split_int8(cache.view(-1, 2, 68)[slots])
        torch.testing.assert_close(scales, largest / 127)
        assert values.abs().max() == 127 and values.min() >= -127
        assert scales[0, 0].item() == 0.0  # a zero row: scale 0, no division by it


@needs_kernels
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("head_dim", [64, 12], ids=["vector", "tail"])
def test_the_native_write_stores_the_same_bytes_as_kv_format(name, head_dim):
    rows = _rows(9, 3, head_dim, seed=2)
    slots = torch.randperm(16)[:9]
    ours = kv_format.allocate(name, 4, 4, 3, head_dim, torch.device("cpu"))
    native = torch.zeros_like(ours)
    kv_format.store(ours, rows, slots)
    decode_attention.store_rows_native(native, rows, slots)
    assert torch.equal(native.view(torch.uint8), ours.view(torch.uint8))


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("decode_only", [False, True], ids=["mixed", "decode"])
@pytest.mark.parametrize("trial", range(2))
def test_every_attention_path_over_a_cache_equals_the_dense_reference_over_what_it_holds(name, decode_only, trial):
    """The torch paged path, the decode paths (torch and native) and paged_attention's choice, over a cache in
    `name`, against dense_reference_attention over the keys and values read back from that same cache."""
    rng = random.Random(trial)
    torch.manual_seed(trial)
    block_size, num_kv_heads, head_dim = 4, 2, rng.choice([16, 12])
    num_heads = 2 * num_kv_heads
    key_cache = kv_format.allocate(name, 48, block_size, num_kv_heads, head_dim, torch.device("cpu"))
    value_cache = torch.zeros_like(key_cache)
    free = list(range(1, 48))
    rng.shuffle(free)
    starts, counts, tables, totals = [], [], [], []
    for _ in range(3):
        total = rng.randint(2, 30)
        count = 1 if decode_only else rng.randint(1, total)
        tables.append([free.pop() for _ in range(-(-total // block_size))])
        starts.append(total - count)
        counts.append(count)
        totals.append(total)
    # Every sequence's prefix as an earlier step wrote it, then this step's tokens through write_kv.
    prefix = build_attention_metadata([0] * 3, starts, tables, block_size, None, 0, torch.device("cpu"))
    old = (sum(starts), num_kv_heads, head_dim)
    write_kv(key_cache, value_cache, torch.randn(old), torch.randn(old), prefix.slot_mapping)
    meta = build_attention_metadata(starts, counts, tables, block_size, 7, 2, torch.device("cpu"))
    write_kv(
        key_cache,
        value_cache,
        torch.randn(sum(counts), num_kv_heads, head_dim),
        torch.randn(sum(counts), num_kv_heads, head_dim),
        meta.slot_mapping,
    )
    queries = torch.randn(sum(counts), num_heads, head_dim)
    scale = head_dim**-0.5
    paths = {
        "paged_attention": paged_attention(queries, key_cache, value_cache, meta, scale, softcap=4.0),
        "torch": paged_attention_torch(queries, key_cache, value_cache, meta, scale, softcap=4.0),
    }
    if decode_only:
        visible = meta.attn_mask[:, 0]
        args = (queries, key_cache, value_cache, meta.key_blocks, visible, scale)
        paths["decode torch"] = decode_attention.decode_attention_torch(*args, softcap=4.0)
        if decode_attention.available():
            paths["decode native"] = decode_attention.decode_attention_native(*args, softcap=4.0)
    row = key_cache.shape[-1]
    offset = 0
    for start, count, table, total in zip(starts, counts, tables, totals):
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(total)])
        keys = kv_format.read(key_cache.view(-1, num_kv_heads, row)[slots], torch.float32)
        values = kv_format.read(value_cache.view(-1, num_kv_heads, row)[slots], torch.float32)
        rows = slice(offset, offset + count)
        expected = dense_reference_attention(
            queries[rows], keys, values, torch.arange(start, total), torch.arange(total), scale, 7, 2, softcap=4.0
        )
        for path, out in paths.items():
            torch.testing.assert_close(out[rows], expected, atol=1e-5, rtol=1e-5, msg=lambda m, p=path: f"{p}: {m}")
        offset += count
