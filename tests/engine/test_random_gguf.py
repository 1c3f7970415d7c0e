"""engine/bench/random_gguf.py writes a GGUF that kvserve and transformers read alike (a tiny shape here;
the default is TinyLlama-1.1B's, for benchmarks)."""

from __future__ import annotations

import pytest
import torch

from engine.bench.random_gguf import LlamaShape, write_random_gguf
from engine.config import EngineConfig
from engine.llm import LLM
from engine.params import SamplingParams

TINY = LlamaShape(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128)
PROMPT = "The quick brown fox jumps over the lazy dog."


def _tensor_types(path) -> dict[str, str]:
    import gguf

    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}


def test_q8_0_weights_are_written_as_q8_0_blocks(tmp_path):
    types = _tensor_types(write_random_gguf(tmp_path / "random-Q8_0.gguf", "Q8_0", TINY))
    assert types["blk.1.ffn_down.weight"] == "Q8_0" and types["token_embd.weight"] == "Q8_0"
    assert types["output_norm.weight"] == "F32" and len(types) == 3 + 9 * TINY.num_layers


def test_a_random_gguf_serves_as_transformers_reads_it(tmp_path):
    """Loading parses the copied 49,152-token vocabulary twice (kvserve and transformers): ~30 s."""
    from transformers import AutoModelForCausalLM

    weight_type = "Q4_0"
    path = write_random_gguf(tmp_path / f"random-{weight_type}.gguf", weight_type, TINY, seed=1)
    types = _tensor_types(path)
    assert types["blk.0.attn_q.weight"] == weight_type and types["output.weight"] == weight_type
    assert types["blk.0.attn_norm.weight"] == "F32"

    llm = LLM.from_config(EngineConfig(model=str(path)))  # float32, the blocks dequantized
    assert llm.tokenizer.has_chat_template  # the tokenizer came along
    ids = llm.tokenizer.encode(PROMPT)
    ours = llm.generate([ids], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0][0].token_ids
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    input_ids = torch.tensor([ids])
    expected = reference.generate(
        input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=8, min_new_tokens=8, do_sample=False
    )[0, len(ids) :].tolist()
    assert ours == expected


def test_unknown_weight_types_are_refused(tmp_path):
    with pytest.raises(ValueError, match="weight type"):
        write_random_gguf(tmp_path / "x.gguf", "Q5_K", TINY)
