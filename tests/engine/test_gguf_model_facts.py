"""What a GGUF file says beside its weights, read so that the file computes what its folder computes.

A Llama 3 GGUF carries its RoPE scaling as a `rope_freqs` tensor (llama.cpp's converter writes the scaled
frequencies' divisors there, not the config's rope_parameters); a Qwen3 GGUF gives its head size as the
attention key length. Each tiny checkpoint gives the same greedy tokens and logprobs from both."""

from __future__ import annotations

import pytest

from engine.models.weights import load_checkpoint
from tests.support.checkpoint_greedy import greedy_from_checkpoint
from tests.support.llama_gguf import write_llama_gguf, write_qwen3_gguf
from tests.support.tiny_models import make_tiny_llama, make_tiny_model

# A short original context, so most of head dim 16's frequencies are scaled and a 60-token prompt reaches them.
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
PROMPTS = [[(7 * i + 3 * j) % 200 + 10 for j in range(60 + 5 * i)] for i in range(3)]


@pytest.fixture(scope="module")
def llama3_checkpoints(tmp_path_factory):
    folder = make_tiny_llama(tmp_path_factory.mktemp("llama3"), rope_parameters=LLAMA3_ROPE)
    gguf_dir = tmp_path_factory.mktemp("llama3-gguf")
    return (
        folder,
        write_llama_gguf(folder, gguf_dir / "tiny-llama3-F32.gguf"),
        write_llama_gguf(folder, gguf_dir / "tiny-llama3-no-rope-freqs-F32.gguf", with_rope_freqs=False),
    )


def test_the_gguf_reads_its_rope_freqs_and_equals_the_folder(llama3_checkpoints):
    folder, gguf_file, _ = llama3_checkpoints
    model_config, _ = load_checkpoint(gguf_file)
    assert model_config.rope_freq_factors is not None and max(model_config.rope_freq_factors) == 8.0
    from_folder, from_gguf = (
        greedy_from_checkpoint(folder, PROMPTS, max_tokens=6),
        greedy_from_checkpoint(gguf_file, PROMPTS, max_tokens=6),
    )
    assert [tokens for tokens, _ in from_gguf] == [tokens for tokens, _ in from_folder]
    for (_, folder_logprobs), (_, gguf_logprobs) in zip(from_folder, from_gguf, strict=True):
        assert gguf_logprobs == pytest.approx(folder_logprobs, abs=1e-4)


def test_without_rope_freqs_the_same_weights_compute_other_logprobs(llama3_checkpoints):
    """The check above can fail: dropping the scaling changes what the model computes."""
    folder, _, unscaled = llama3_checkpoints
    assert load_checkpoint(unscaled)[0].rope_freq_factors is None
    from_folder, from_unscaled = (
        greedy_from_checkpoint(folder, PROMPTS, max_tokens=6),
        greedy_from_checkpoint(unscaled, PROMPTS, max_tokens=6),
    )
    assert any(
        unscaled_logprobs != pytest.approx(folder_logprobs, abs=1e-3)
        for (_, folder_logprobs), (_, unscaled_logprobs) in zip(from_folder, from_unscaled, strict=True)
    )


def test_a_qwen3_gguf_reads_its_head_size_and_equals_its_folder(tmp_path):
    """transformers' GGUF mapping leaves Qwen3's head size to its default (128); the file's key length says
    it, and the q/k norms load under their GGUF names."""
    folder = make_tiny_model(tmp_path / "qwen3", "qwen3")
    gguf_file = write_qwen3_gguf(folder, tmp_path / "tiny-qwen3-F32.gguf")
    model_config, _ = load_checkpoint(gguf_file)
    assert model_config.architecture == "Qwen3ForCausalLM" and model_config.head_dim == 16
    from_folder, from_gguf = (
        greedy_from_checkpoint(folder, PROMPTS, max_tokens=6),
        greedy_from_checkpoint(gguf_file, PROMPTS, max_tokens=6),
    )
    assert [tokens for tokens, _ in from_gguf] == [tokens for tokens, _ in from_folder]
    for (_, folder_logprobs), (_, gguf_logprobs) in zip(from_folder, from_gguf, strict=True):
        assert gguf_logprobs == pytest.approx(folder_logprobs, abs=1e-4)
