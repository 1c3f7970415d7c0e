"""Paged sliding-window attention: bounded blocks per sequence, exact against transformers."""

from __future__ import annotations

import torch

from engine.config import EngineConfig
from engine.llm import LLM
from engine.params import SamplingParams
from tests.support.tiny_models import load_reference


def _run_and_track_blocks(engine: LLM, prompt_ids: list[int], params: SamplingParams):
    engine.engine.add_request(prompt_ids, params)
    max_held = 0
    tokens: list[int] = []
    while engine.engine.has_unfinished_requests():
        for out in engine.engine.step():
            tokens.extend(out.outputs[0].token_ids)
        for seq in engine.engine.scheduler.running:
            max_held = max(max_held, sum(1 for b in seq.block_table if b != 0))
    return tokens, max_held


def test_mistral_window_bounded_blocks_and_exact(tiny_model_dirs):
    model_dir = tiny_model_dirs["mistral"]
    window, block_size = 16, 4
    engine = LLM.from_config(EngineConfig(model=model_dir, block_size=block_size, max_num_batched_tokens=4))
    assert engine.engine.sliding_window == window
    prompt_ids = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    num_new = 3 * window + 8 - len(prompt_ids) + 1
    params = SamplingParams(temperature=0, max_tokens=num_new, min_tokens=num_new)
    tokens, max_held = _run_and_track_blocks(engine, prompt_ids, params)
    assert len(prompt_ids) + len(tokens) > 3 * window
    assert max_held <= -(-window // block_size) + 1
    assert engine.engine.stats().num_used_blocks == 0

    reference = load_reference(model_dir)
    expected = reference.generate(
        torch.tensor([prompt_ids]), max_new_tokens=num_new, min_new_tokens=num_new, do_sample=False
    )[0, len(prompt_ids) :].tolist()
    assert tokens == expected


def test_forced_window_on_llama_equals_mistral_with_that_window(tiny_model_dirs):
    """A LLaMA checkpoint with --sliding-window W is, by definition, Mistral with window W."""
    from transformers import MistralConfig, MistralForCausalLM

    model_dir = tiny_model_dirs["llama"]
    window = 12
    engine = LLM.from_config(EngineConfig(model=model_dir, block_size=4, sliding_window=window))
    prompt_ids = engine.tokenizer.encode("Hello world! Continuous batching lets requests join and leave.")
    result = engine.generate([prompt_ids], SamplingParams(temperature=0, max_tokens=40, min_tokens=40))[0][0]

    llama = load_reference(model_dir)
    mistral_config = MistralConfig(**{**llama.config.to_dict(), "sliding_window": window, "model_type": "mistral"})
    mistral = MistralForCausalLM(mistral_config).eval()
    mistral.load_state_dict(llama.state_dict())
    expected = mistral.generate(torch.tensor([prompt_ids]), max_new_tokens=40, min_new_tokens=40, do_sample=False)
    assert result.token_ids == expected[0, len(prompt_ids) :].tolist()


def test_sinks_stream_past_context_with_bounded_memory(tiny_model_dirs):
    model_dir = tiny_model_dirs["llama"]  # max_position_embeddings 512
    window, sinks, block_size = 32, 4, 8
    engine = LLM.from_config(
        EngineConfig(
            model=model_dir, block_size=block_size, sliding_window=window, num_sink_tokens=sinks, max_model_len=600
        )
    )
    prompt_ids = engine.tokenizer.encode("Hello world")
    tokens, max_held = _run_and_track_blocks(
        engine, prompt_ids, SamplingParams(temperature=0, max_tokens=520, ignore_eos=True)
    )
    assert len(prompt_ids) + len(tokens) > 512
    # window blocks + the partial block + the sink block
    assert max_held <= -(-window // block_size) + 1 + -(-sinks // block_size)
    assert engine.engine.stats().num_used_blocks == 0
