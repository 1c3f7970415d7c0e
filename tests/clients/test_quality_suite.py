"""The quality measures (engine/bench/gguf_quality.py, clients/bench/quality.py) on a tiny random GGUF,
the float32 GGUF written for llama.cpp, and the parsing of llama.cpp's output."""

from __future__ import annotations

from dataclasses import asdict

import gguf
import numpy as np
import pytest

from clients.bench.quality import compare_answers, table
from engine.bench import gguf_quality
from engine.bench.gguf_quality import parse_kl_divergence, scored_chunks, write_float32_gguf
from engine.bench.random_gguf import LlamaShape, write_random_gguf

pytestmark = pytest.mark.slow

TINY = LlamaShape(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128)


def test_answers_are_compared_up_to_their_first_difference():
    assert compare_answers(["abcd", "xyz", "same"], ["abXd", "xyz!", "same"]) == (2 + 3 + 4, 1)


def test_whole_chunks_only():
    assert scored_chunks(list(range(10)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_llama_perplexity_output_is_parsed():
    output = (
        "...\n====== KL divergence statistics ======\nMean    KLD:   0.012345 ±   0.000400\n"
        "Maximum KLD:   1.2\n====== Token probability statistics ======\nSame top p: 96.471 ± 0.330 %\n"
    )
    assert parse_kl_divergence(output) == (0.012345, pytest.approx(0.96471))
    with pytest.raises(RuntimeError):
        parse_kl_divergence("no statistics here")


def test_the_float32_gguf_holds_the_files_values(tmp_path):
    source = write_random_gguf(tmp_path / "q.gguf", "Q4_0", TINY)
    target = write_float32_gguf(source, tmp_path / "f32.gguf")
    quantized, dense = gguf.GGUFReader(str(source)), gguf.GGUFReader(str(target))
    assert dense.fields["tokenizer.ggml.tokens"].contents() == quantized.fields["tokenizer.ggml.tokens"].contents()
    assert dense.fields["llama.block_count"].contents() == TINY.num_layers
    for q, d in zip(quantized.tensors, dense.tensors):
        assert q.name == d.name and d.tensor_type == gguf.GGMLQuantizationType.F32
        assert np.array_equal(gguf.quants.dequantize(q.data, q.tensor_type), d.data)


def test_kvserve_modes_are_measured_against_float32(tmp_path, monkeypatch):
    model = write_random_gguf(tmp_path / "q.gguf", "Q4_1", TINY, weight_std=0.15)
    monkeypatch.setattr(gguf_quality, "PROMPTS", gguf_quality.PROMPTS[:2])
    reference, (blocks,), prompts = gguf_quality.measure(model, ["gguf"], ctx=256)
    assert blocks.scored_tokens % 127 == 0 and blocks.scored_tokens >= 127 * 4
    assert 0 < blocks.mean_kl < 0.05 and 0 < blocks.mean_abs_logprob_diff < 0.2 and blocks.top1_agreement > 0.8
    assert len(prompts) == len(reference.answers) == len(blocks.answers) == 2
    report = {"reference": asdict(reference), "results": [asdict(blocks)], "ctx": 256, "greedy_tokens": 64}
    assert "| kvserve gguf |" in table({**report, "cpu_flags": ["avx2"]})
