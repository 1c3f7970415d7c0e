"""Every attention path on the same inputs, in one test: the dense reference, the CPU paged paths (the
torch path and the decode kernel the CPU runs) and both Triton kernels (in Triton's interpreter), plus the
dispatch that picks the Triton kernels on CUDA.

A mixed step (a prompt continuing a cached prefix, a short prompt, a decode) runs through the reference,
paged_attention_torch and the Triton prefill kernel; then each sequence's last token, as a decode-only
step over the same cache, runs through the CPU decode path and the Triton decode kernel (1 and 2 splits).
Each of those last tokens must get the same answer from every path, with and without an attention-logit
softcap (softcap 5 over large scores, so the cap changes the answer). Over a cache in each 16-bit and the
int8 format, every path reads what the cache holds: each equals the torch path over those values in float32.
"""

from __future__ import annotations

import dataclasses
import importlib
import os

os.environ["TRITON_INTERPRET"] = "1"  # read when a @triton.jit decorator runs: kernels then take CPU tensors

import pytest
import torch

pytest.importorskip("triton")

from engine.attention.metadata import build_attention_metadata
from engine.attention.paged import paged_attention, paged_attention_torch, use_triton_kernels
from engine.ops import kv_format
from tests.engine.test_triton_prefill_attention import BLOCK_SIZE, CPU, dense_expected, make_step

decode_kernels = importlib.import_module("engine.attention.triton_decode")
prefill_kernels = importlib.import_module("engine.attention.triton_prefill")
if not decode_kernels._interpreted():  # imported earlier in this process without the interpreter
    decode_kernels = importlib.reload(decode_kernels)
if not prefill_kernels._interpreted():
    prefill_kernels = importlib.reload(prefill_kernels)


@pytest.mark.parametrize("softcap", [None, 5.0], ids=["no_softcap", "softcap"])
@pytest.mark.parametrize("window,sinks", [(None, 0), (24, 4)], ids=["full", "window_sinks"])
def test_dense_cpu_paged_and_both_triton_kernels_agree(window, sinks, softcap):
    # 6 query heads over 2 KV heads: a wrong GQA mapping shows. Sequence 0 continues 20 cached tokens.
    step = make_step(
        [20, 0, 37], [13, 9, 1], num_heads=6, num_kv_heads=2, window=window, sinks=sinks, seed=3, softcap=softcap
    )
    tolerance = {"atol": 1e-5, "rtol": 1e-5}
    reference = torch.cat(dense_expected(step))
    if softcap is not None:
        uncapped = torch.cat(dense_expected(dataclasses.replace(step, softcap=None)))
        assert (reference - uncapped).abs().max() > 0.1  # the cap changes the answer
    args = (step.query, step.key_cache, step.value_cache, step.meta, step.scale)
    torch_paged = paged_attention_torch(*args, softcap=softcap)
    triton_prefill = prefill_kernels.triton_paged_prefill(*args, softcap=softcap)
    torch.testing.assert_close(torch_paged, reference, **tolerance)
    torch.testing.assert_close(triton_prefill, reference, **tolerance)

    # The last token of each sequence as a decode-only step over the same cache (its K/V are written).
    last = [start + count - 1 for start, count in zip(step.starts, step.counts)]
    rows = torch.tensor([sum(step.counts[: i + 1]) - 1 for i in range(len(step.counts))])
    decode_meta = build_attention_metadata(last, [1, 1, 1], step.tables, BLOCK_SIZE, window, sinks, CPU)
    decode_query = step.query[rows]
    decode_args = (decode_query, step.key_cache, step.value_cache, decode_meta, step.scale)
    cpu_decode = paged_attention(*decode_args, softcap=softcap)
    for num_splits in (1, 2):
        triton_decode = decode_kernels.triton_paged_decode(*decode_args, num_splits=num_splits, softcap=softcap)
        torch.testing.assert_close(triton_decode, reference[rows], **tolerance)
    torch.testing.assert_close(cpu_decode, reference[rows], **tolerance)
    torch.testing.assert_close(triton_prefill[rows], torch_paged[rows], **tolerance)


@pytest.mark.parametrize("kv_cache_dtype", ["float16", "bfloat16", "int8"])
def test_every_path_reads_a_cache_of_each_format_as_the_values_it_holds(kv_cache_dtype):
    step = make_step([20, 0, 37], [13, 9, 1], num_heads=6, num_kv_heads=2, window=24, sinks=4, seed=4)
    cache_dtype = kv_format.KV_TORCH_DTYPES[kv_cache_dtype]
    caches = (kv_format.encode(step.key_cache, cache_dtype), kv_format.encode(step.value_cache, cache_dtype))
    held = tuple(kv_format.read(cache, torch.float32) for cache in caches)
    tolerance = {"atol": 1e-5, "rtol": 1e-5}
    reference = paged_attention_torch(step.query, *held, step.meta, step.scale)
    assert (
        reference - paged_attention_torch(step.query, step.key_cache, step.value_cache, step.meta, step.scale)
    ).abs().max() > 0
    for path in (paged_attention_torch, prefill_kernels.triton_paged_prefill):
        torch.testing.assert_close(path(step.query, *caches, step.meta, step.scale), reference, **tolerance)
    last = [start + count - 1 for start, count in zip(step.starts, step.counts)]
    rows = torch.tensor([sum(step.counts[: i + 1]) - 1 for i in range(len(step.counts))])
    decode_meta = build_attention_metadata(last, [1, 1, 1], step.tables, BLOCK_SIZE, 24, 4, CPU)
    decode_args = (step.query[rows], *caches, decode_meta, step.scale)
    torch.testing.assert_close(paged_attention(*decode_args), reference[rows], **tolerance)  # the CPU decode kernel
    for num_splits in (1, 2):
        triton_decode = decode_kernels.triton_paged_decode(*decode_args, num_splits=num_splits)
        torch.testing.assert_close(triton_decode, reference[rows], **tolerance)


def test_the_triton_kernels_are_chosen_only_where_they_can_run():
    step = make_step([0], [5], num_heads=2, num_kv_heads=2)
    assert use_triton_kernels(step.query, step.key_cache, step.value_cache)  # the interpreter takes CPU tensors
    odd_head_dim = make_step([0], [5], head_dim=24)  # not a power of two: the torch path
    assert not use_triton_kernels(odd_head_dim.query, odd_head_dim.key_cache, odd_head_dim.value_cache)
    # A cache in another format is read into the query's dtype; a value cache of a different format is refused.
    assert use_triton_kernels(step.query.to(torch.float16), step.key_cache, step.value_cache)
    int8 = kv_format.encode(step.key_cache, torch.int8)
    assert use_triton_kernels(step.query, int8, kv_format.encode(step.value_cache, torch.int8))
    assert not use_triton_kernels(step.query, int8, step.value_cache)
    half = make_step([0], [5], dtype=torch.float16)
    assert use_triton_kernels(half.query, half.key_cache, half.value_cache)
    # bfloat16 runs, but the interpreter cannot check its results: the torch path until a GPU has.
    bf16 = [t.to(torch.bfloat16) for t in (step.query, step.key_cache, step.value_cache)]
    assert not use_triton_kernels(*bf16)
