"""The attention weights of the reference path against transformers' output_attentions, and its masks."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.config import EngineConfig
from engine.llm import LLM
from engine.params import SamplingParams
from tests.conftest import ARCHS

PROMPT = "The quick brown fox jumps over the lazy dog. A paged KV cache stores keys and values in blocks."


def _engine(model_dir: str, **overrides) -> LLM:
    return LLM.from_config(EngineConfig(model=model_dir, **overrides))


@pytest.mark.parametrize("arch", ARCHS)
def test_weights_equal_transformers_output_attentions(tiny_model_dirs, arch):
    model_dir = tiny_model_dirs[arch]
    llm = _engine(model_dir, block_size=4)
    engine = llm.engine
    ids = llm.tokenizer.encode(PROMPT)
    assert len(ids) > 20  # past the tiny Mistral's 16-token window: its band is compared too
    # Each layer under its own window: Gemma's full layers see every key, its sliding ones the last 8.
    windows = tuple(engine.layout.window_of_layer(layer) for layer in range(engine.model_config.num_layers))
    ours = engine.attention_weights(ids, engine.sliding_window, engine.num_sink_tokens, layer_windows=windows)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        theirs = reference(torch.tensor([ids]), output_attentions=True).attentions
    assert ours.num_layers == len(theirs) == engine.model_config.num_layers
    expected = torch.stack([layer[0] for layer in theirs])  # [L, H, T, T]
    assert ours.weights.shape == expected.shape
    torch.testing.assert_close(ours.weights, expected, atol=1e-5, rtol=0)
    assert ours.token_ids == tuple(ids)


def test_window_and_sinks_zero_everything_outside_band_and_sink_columns(tiny_llama_dir):
    llm = _engine(tiny_llama_dir)
    ids = llm.tokenizer.encode(PROMPT)[:20]
    result = llm.engine.attention_weights(ids, 4, 1)
    i = torch.arange(len(ids)).unsqueeze(1)
    j = torch.arange(len(ids)).unsqueeze(0)
    visible = (j <= i) & ((i - j < 4) | (j < 1))
    assert (result.weights[..., ~visible] == 0).all()
    assert (result.weights[..., visible] > 0).all()
    torch.testing.assert_close(result.weights.sum(-1), torch.ones(result.weights.shape[:-1]))
    causal = llm.engine.attention_weights(ids, None, 5)  # sinks mean nothing without a window
    assert causal.num_sink_tokens == 0
    assert (causal.weights[..., j > i] == 0).all() and (causal.weights[..., j <= i] > 0).all()


def test_probe_leaves_serving_cache_and_running_requests_alone(tiny_llama_dir):
    llm = _engine(tiny_llama_dir, block_size=4)
    engine = llm.engine
    ids = llm.tokenizer.encode(PROMPT)
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=12)
    expected = llm.generate([ids], params)[0][0].token_ids

    request_id = engine.add_request(ids, params)
    tokens = [t for output in engine.step() if output.request_id == request_id for t in output.outputs[0].token_ids]
    caches = [(k.clone(), v.clone()) for k, v in engine.runner.kv_caches]
    used = engine.pool.num_used_blocks
    engine.attention_weights(ids[:30], None, 0)
    assert engine.pool.num_used_blocks == used
    for (k, v), (k2, v2) in zip(caches, engine.runner.kv_caches):
        assert torch.equal(k, k2) and torch.equal(v, v2)
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id == request_id:
                tokens += output.outputs[0].token_ids
    assert tokens == expected


def test_bad_token_ids_are_refused(tiny_llama_dir):
    from engine.errors import InvalidRequestError

    llm = _engine(tiny_llama_dir)
    with pytest.raises(InvalidRequestError):
        llm.engine.attention_weights([], None, 0)
    with pytest.raises(InvalidRequestError):
        llm.engine.attention_weights([llm.engine.vocab_size], None, 0)
