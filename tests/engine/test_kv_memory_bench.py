"""engine/bench/kv_memory.py: the KV bytes one sequence holds in kvserve (per-group block tables) against
every layer full, and llama.cpp's cache sizes read from its log."""

from __future__ import annotations

import pytest

from engine.bench.kv_memory import kvserve_measures, markdown, parse_llama_cpp_kv
from engine.bench.random_gguf import Gemma3Shape, write_random_gguf

pytestmark = pytest.mark.slow

# A llama-server start-up log of a Gemma 3 model at -c 4096, one slot (the lines the parser reads, as
# llama.cpp prints them, and one it must skip).
_LLAMA_LOG = """\
llama_kv_cache_iswa: creating non-SWA KV cache, size = 4096 cells
llama_kv_cache:        CPU KV buffer size =    16.00 MiB
llama_kv_cache: size =   16.00 MiB (  4096 cells,   4 layers,  1/1 seqs), K (f16):    8.00 MiB, V (f16):    8.00 MiB
llama_kv_cache_iswa: creating     SWA KV cache, size = 1024 cells
llama_kv_cache:        CPU KV buffer size =    22.00 MiB
llama_kv_cache: size =   22.00 MiB (  1024 cells,  22 layers,  1/1 seqs), K (f16):   11.00 MiB, V (f16):   11.00 MiB
"""


def test_llama_cpp_caches_are_read_from_its_log():
    assert parse_llama_cpp_kv(_LLAMA_LOG) == [("non-SWA", 4096, 4, 16.0), ("SWA", 1024, 22, 22.0)]
    single = "llama_kv_cache: size =  176.00 MiB (  4096 cells,  22 layers,  1/1 seqs), K (f16):   88.00 MiB"
    assert parse_llama_cpp_kv(single) == [("all", 4096, 22, 176.0)]


def test_a_sliding_model_holds_its_full_layers_and_windows(tmp_path):
    """Six layers, five sliding (window 8): after 63 tokens the full layer holds 4 blocks of 16 tokens and each
    sliding one the single block its window reaches; every layer full would hold 6 x 4. ~30 s (the copied
    vocabulary is parsed)."""
    shape = Gemma3Shape(
        num_layers=6, hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=128, head_dim=32, sliding_window=8
    )
    path = write_random_gguf(tmp_path / "gemma3.gguf", "Q8_0", shape)
    (measure,) = kvserve_measures(path, [64])
    assert measure.layout == "sliding 8: 5 layers in 5 groups; full: 1 layers in 1 groups; 1 layers per block"
    # K and V, 16 tokens, one KV head of 32, float16 (auto for GGUF blocks on CPU), one layer per block
    per_block = 2 * 16 * 1 * 32 * 2
    assert measure.bytes_per_block == per_block and measure.element_size == 2
    assert measure.kv_cache_dtype == "float16"
    assert measure.held_bytes == (4 + 5 * 1) * per_block
    assert measure.all_full_bytes == 6 * 4 * per_block
    assert measure.peak_bytes == 6 * 4 * per_block  # the prompt's one prefill chunk reaches past every window
    assert "| 64 |" in markdown([measure], [])
