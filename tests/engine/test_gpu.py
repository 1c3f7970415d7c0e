"""GPU checks (run with `pytest -m gpu` on a CUDA machine; CI is CPU-only and skips them)."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.llm import LLM
from engine.params import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "gpt2"])
def test_cuda_float32_matches_cpu(tiny_model_dirs, arch):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = ["Hello world", "The quick brown fox jumps over the lazy dog. " * 3]
    cpu = LLM.from_config(EngineConfig(model=tiny_model_dirs[arch])).generate(prompts, params)
    gpu = LLM.from_config(EngineConfig(model=tiny_model_dirs[arch], device="cuda")).generate(prompts, params)
    assert [r[0].token_ids for r in cpu] == [r[0].token_ids for r in gpu]


def test_cuda_seeded_sampling_is_batch_independent(tiny_llama_dir):
    engine = LLM.from_config(EngineConfig(model=tiny_llama_dir, device="cuda"))
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=16, ignore_eos=True)
    alone = engine.generate(["Hello world"], params)[0][0].token_ids
    together = engine.generate(["Hello world", "A paged cache", "lazy dog"], params)[0][0].token_ids
    assert alone == together


def test_cuda_structured_output_matches_cpu(tiny_llama_dir):
    """Grammar masks on CUDA logits: the same constrained tokens as on the CPU, and valid JSON."""
    import json

    from engine.structured.spec import StructuredOutput

    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "n": {"type": "integer", "minimum": 0, "maximum": 9},
        },
        "required": ["name", "n"],
        "additionalProperties": False,
    }
    params = SamplingParams(temperature=0, max_tokens=60, structured=StructuredOutput(json=json.dumps(schema)))
    prompts = ["Hello world", "The quick brown fox"]
    cpu = LLM.from_config(EngineConfig(model=tiny_llama_dir)).generate(prompts, params)
    gpu = LLM.from_config(EngineConfig(model=tiny_llama_dir, device="cuda")).generate(prompts, params)
    assert [r[0].token_ids for r in cpu] == [r[0].token_ids for r in gpu]
    for result in gpu:
        assert set(json.loads(result[0].text)) == {"name", "n"}
