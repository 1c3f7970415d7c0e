"""Phi-3 (engine/models/phi3.py) in float32 against transformers: fused checkpoint projections, partial rotary
(3/4 of each head, as Phi-4-mini), LongRoPE around a short pretraining length, a sliding window, and the same
model from its GGUF file.

The tiny model's LongRoPE pretraining length (ORIGINAL) is short, so the tests reach both factor sets: a
sequence that stays below it is transformers' computation exactly; past it each position takes its own set
(RotaryEmbedding in engine/models/common.py), checked against transformers' own RoPE functions."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.llm import LLM
from engine.models.common import RotaryEmbedding
from engine.models.weights import load_checkpoint
from engine.params import SamplingParams
from engine.quantization.gguf import GgufLinear
from engine.runner.decode_path import DecodePath, DecodePlan
from tests.support.checkpoint_greedy import greedy_from_checkpoint, greedy_on
from tests.support.llama_gguf import write_phi3_gguf
from tests.support.tiny_models import load_reference, make_tiny_model

ORIGINAL = 32  # LongRoPE's original_max_position_embeddings here: short factors below it, long ones from it on
WINDOW = 8  # shorter than every prompt below
HEAD_DIM, ROTARY_DIM = 16, 12  # the tiny Phi-3's heads, 3/4 of which rotate


def _prompt(length: int, seed: int = 0) -> list[int]:
    return [(7 * i + 11 * seed) % 300 + 10 for i in range(length)]


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory) -> str:
    return str(
        make_tiny_model(
            tmp_path_factory.mktemp("phi3"),
            "phi3",
            original_max_position_embeddings=ORIGINAL,
            max_position_embeddings=128,  # 4x the original length: an attention factor of sqrt(1 + ln 4 / ln 32)
            sliding_window=WINDOW,
        )
    )


def _engine_greedy(model_dir: str, prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], list[float]]]:
    # A 7-token budget splits prompts over several steps; block size 4 crosses blocks within a chunk.
    engine = LLM.from_config(EngineConfig(model=model_dir, max_num_batched_tokens=7, block_size=4))
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    results = [samples[0] for samples in engine.generate(prompts, params)]
    return [(r.token_ids, [e.logprob for e in r.logprobs]) for r in results]


def _reference_greedy(reference, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    out = reference.generate(
        torch.tensor([prompt]),
        max_new_tokens=max_tokens,
        min_new_tokens=max_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [float(logits[0].float().log_softmax(-1)[t]) for logits, t in zip(out.logits, tokens, strict=True)]
    return tokens, logprobs


def _assert_same(ours: tuple[list[int], list[float]], theirs: tuple[list[int], list[float]]) -> None:
    assert ours[0] == theirs[0]
    assert ours[1] == pytest.approx(theirs[1], abs=1e-4)


def test_below_the_pretraining_length_generation_matches_transformers(phi3_dir):
    """Short factors, partial rotary and the window through chunked prefill and decode, up to the last
    position (ORIGINAL - 1) at which transformers still runs the short factors."""
    prompt, max_tokens = _prompt(20), 13
    assert len(prompt) + max_tokens - 1 == ORIGINAL  # the last token fed sits at position ORIGINAL - 1
    reference = load_reference(phi3_dir)
    with torch.no_grad():
        expected = _reference_greedy(reference, prompt, max_tokens)
    _assert_same(_engine_greedy(phi3_dir, [prompt], max_tokens)[0], expected)


def test_rope_takes_transformers_short_factors_below_the_original_length_and_its_long_ones_past_it(phi3_dir):
    from transformers import AutoConfig
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    config = AutoConfig.from_pretrained(phi3_dir)
    ours = RotaryEmbedding(config, HEAD_DIM, torch.device("cpu"), rotary_dim=ROTARY_DIM)
    theirs = Phi3RotaryEmbedding(config)
    x = torch.zeros(1)
    # transformers picks one set per pass by its longest position: short while every position is below ORIGINAL
    short_cos, short_sin = theirs(x, torch.arange(ORIGINAL)[None])
    long_cos, long_sin = theirs(x, torch.arange(2 * ORIGINAL)[None])  # long, for every position
    cos, sin = ours.cos_sin(torch.arange(2 * ORIGINAL), torch.float32)
    assert cos.shape == (2 * ORIGINAL, 1, ROTARY_DIM)
    torch.testing.assert_close(cos[:ORIGINAL, 0], short_cos[0], rtol=0, atol=0)
    torch.testing.assert_close(sin[:ORIGINAL, 0], short_sin[0], rtol=0, atol=0)
    torch.testing.assert_close(cos[ORIGINAL:, 0], long_cos[0, ORIGINAL:], rtol=0, atol=0)
    torch.testing.assert_close(sin[ORIGINAL:, 0], long_sin[0, ORIGINAL:], rtol=0, atol=0)
    # The two sets differ (so the checks above tell them apart), and the attention factor scales both.
    assert not torch.allclose(short_cos[0, 1:], long_cos[0, 1:ORIGINAL])
    assert ours.attention_scaling == pytest.approx((1 + torch.tensor(4.0).log() / torch.tensor(32.0).log()).sqrt())
    # Per token, whatever shares the batch: a short position keeps its rotation beside a long one.
    mixed_cos, _ = ours.cos_sin(torch.tensor([5, ORIGINAL + 3]), torch.float32)
    torch.testing.assert_close(mixed_cos[:, 0], torch.stack([short_cos[0, 5], long_cos[0, ORIGINAL + 3]]))


def _per_token_reference(model_dir: str):
    """transformers' Phi-3 whose RoPE takes the short or long factors per position (its own frequencies)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    reference = load_reference(model_dir)
    rotary = reference.model.rotary_emb
    short = rotary.original_inv_freq
    long, _ = ROPE_INIT_FUNCTIONS["longrope"](reference.config, None, seq_len=ORIGINAL + 1)

    def forward(x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = torch.where((position_ids >= ORIGINAL)[..., None], long, short)
        freqs = position_ids[..., None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * rotary.attention_scaling).to(x.dtype), (emb.sin() * rotary.attention_scaling).to(x.dtype)

    rotary.forward = forward
    return reference


def test_past_the_pretraining_length_each_position_keeps_its_own_factors(phi3_dir):
    """A decode that crosses ORIGINAL and a prompt that does, through chunked prefill: the per-token rule."""
    prompts, max_tokens = [_prompt(26, seed=1), _prompt(40, seed=2)], 12
    reference = _per_token_reference(phi3_dir)
    with torch.no_grad():
        expected = [_reference_greedy(reference, prompt, max_tokens) for prompt in prompts]
    for ours, theirs in zip(_engine_greedy(phi3_dir, prompts, max_tokens), expected, strict=True):
        _assert_same(ours, theirs)


def test_a_phi3_gguf_reads_its_rotary_dims_longrope_and_window_and_equals_its_folder(phi3_dir, tmp_path):
    """transformers' GGUF mapping drops all three; the file's keys and rope_factors tensors carry them."""
    gguf_file = write_phi3_gguf(Path(phi3_dir), tmp_path / "tiny-phi3-F32.gguf")
    model_config, _ = load_checkpoint(gguf_file)
    folder_config, _ = load_checkpoint(phi3_dir)
    assert model_config.architecture == "Phi3ForCausalLM" and model_config.sliding_window == WINDOW
    rope, folder_rope = model_config.hf_config.rope_parameters, folder_config.hf_config.rope_parameters
    assert rope["partial_rotary_factor"] == 0.75 and rope["rope_type"] == "longrope"
    assert rope["original_max_position_embeddings"] == ORIGINAL
    for key in ("short_factor", "long_factor"):
        assert rope[key] == pytest.approx(folder_rope[key])
    prompts = [_prompt(20, seed=3), _prompt(36, seed=4)]  # one stays below ORIGINAL, one crosses it
    from_folder, from_gguf = greedy_from_checkpoint(phi3_dir, prompts), greedy_from_checkpoint(gguf_file, prompts)
    for ours, theirs in zip(from_gguf, from_folder, strict=True):
        _assert_same(ours, theirs)


def test_a_q8_0_phi3_gguf_runs_on_its_blocks_and_follows_the_same_file_in_float32(phi3_dir, tmp_path):
    """The engine reads a Phi-3 file itself: its fused qkv and gate/up matrices stay in their Q8_0 blocks."""
    gguf_file = write_phi3_gguf(Path(phi3_dir), tmp_path / "tiny-phi3-Q8_0.gguf", matrix_type="Q8_0")
    config = EngineConfig(model=str(gguf_file), tokenizer=phi3_dir, quantization="gguf", block_size=4, num_blocks=96)
    blocks = LLM.from_config(config)
    model = blocks.engine.runner.model
    assert all(isinstance(layer.qkv_proj, GgufLinear) for layer in model.layers)
    assert all(isinstance(layer.gate_up_proj, GgufLinear) for layer in model.layers)
    prompts = [_prompt(20, seed=3), _prompt(24, seed=5)]
    on_blocks = greedy_on(blocks.engine, prompts, max_tokens=6)
    in_float32 = greedy_from_checkpoint(gguf_file, prompts, max_tokens=6)
    # Only the activations' rounding to 8-bit blocks differs from float32.
    for (tokens, logprobs), (float_tokens, float_logprobs) in zip(on_blocks, in_float32, strict=True):
        assert tokens[:3] == float_tokens[:3]
        assert logprobs[0] == pytest.approx(float_logprobs[0], abs=0.05)


def test_the_fused_decode_rotates_part_of_each_head_with_each_tokens_longrope_factors(phi3_dir):
    """int8 Phi-3 decodes through the fused kernel: 12 of 16 values of each head rotate, positions below and
    past ORIGINAL take their own factor sets, under the window; the same tokens as its torch layers."""
    fused = LLM.from_config(EngineConfig(model=phi3_dir, block_size=4, quantization="int8"))
    assert fused.engine.runner.decode_plan.path is DecodePath.FUSED_NATIVE, fused.engine.runner.decode_plan.reason
    layers = LLM.from_config(EngineConfig(model=phi3_dir, block_size=4, quantization="int8"))
    layers.engine.runner.decode_plan = DecodePlan(DecodePath.TORCH_LAYERS, "the reference", ())
    prompts = [_prompt(20, seed=3), _prompt(30, seed=4)]  # both decode across ORIGINAL
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    for ours, theirs in zip(fused.generate(prompts, params), layers.generate(prompts, params), strict=True):
        assert ours[0].token_ids == theirs[0].token_ids
        for got, expected in zip(ours[0].logprobs, theirs[0].logprobs, strict=True):
            assert got.logprob == pytest.approx(expected.logprob, abs=1e-3)
