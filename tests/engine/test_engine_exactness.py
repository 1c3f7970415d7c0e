"""The engine against transformers, the reference implementation, in float32."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.llm import LLM
from engine.params import SamplingParams
from tests.conftest import ARCHS
from tests.support.tiny_models import load_reference

PROMPT = "The quick brown fox jumps over the lazy dog. Hello world! A paged KV cache stores keys and values."


def _engine(model_dir: str, **overrides) -> LLM:
    return LLM.from_config(EngineConfig(model=model_dir, **overrides))


def _prompt_logits(engine: LLM, prompt_ids: list[int]) -> torch.Tensor:
    """Logits at every prompt position from one engine step over the whole prompt."""
    engine.engine.add_request(prompt_ids, SamplingParams(max_tokens=1))
    batch = engine.engine.scheduler.schedule()
    assert batch.num_tokens == len(prompt_ids)
    return engine.engine.runner.compute_logits(batch, all_positions=True)


@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_logits_match_transformers(tiny_model_dirs, arch):
    model_dir = tiny_model_dirs[arch]
    engine = _engine(model_dir)
    prompt_ids = engine.tokenizer.encode(PROMPT)
    # Mistral's tiny window (16) is shorter than this prompt: the window mask is exercised.
    assert len(prompt_ids) > 20
    ours = _prompt_logits(engine, prompt_ids)
    reference = load_reference(model_dir)
    with torch.no_grad():
        theirs = reference(torch.tensor([prompt_ids])).logits[0].float()
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_match_transformers_generate(tiny_model_dirs, arch):
    model_dir = tiny_model_dirs[arch]
    # A small token budget forces chunked prefill across several steps; min_tokens bans EOS like
    # transformers' min_new_tokens.
    engine = _engine(model_dir, max_num_batched_tokens=7, block_size=4)
    prompt_ids = engine.tokenizer.encode(PROMPT)
    result = engine.generate([prompt_ids], SamplingParams(temperature=0, max_tokens=32, min_tokens=32))[0][0]
    reference = load_reference(model_dir)
    expected = reference.generate(torch.tensor([prompt_ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False)[
        0, len(prompt_ids) :
    ].tolist()
    assert result.token_ids == expected
    assert result.finish_reason == "length"
    assert engine.engine.stats().num_used_blocks == 0
