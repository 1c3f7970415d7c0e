"""What a GGUF file says beside its weights, read so that the file computes what its folder computes.

A Llama 3 GGUF carries its RoPE scaling as a `rope_freqs` tensor (llama.cpp's converter writes the scaled
frequencies' divisors there, not the config's rope_parameters); a Qwen3 GGUF gives its head size as the
attention key length. Each tiny checkpoint gives the same greedy tokens and logprobs from both."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.llm import LLM
from engine.models.weights import load_checkpoint
from engine.ops.gguf_linear import BlockWeight
from engine.quantization.gguf import GgufLinear
from engine.runner.decode_path import DecodePath
from tests.support.checkpoint_greedy import greedy_from_checkpoint, greedy_on
from tests.support.llama_gguf import write_llama_gguf, write_qwen2_gguf, write_qwen3_gguf
from tests.support.native_kernels import needs_kernels
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


@needs_kernels
def test_a_qwen3_gguf_runs_on_its_blocks_through_the_fused_decode(tmp_path):
    """Qwen3's tensors are read natively: its Q8_0 matrices stay in their blocks (biases and q/k norms beside
    them), the fused decode runs its q/k norms, and its greedy tokens follow the same file in float32."""
    folder = make_tiny_model(tmp_path / "qwen3", "qwen3")
    gguf_file = write_qwen3_gguf(folder, tmp_path / "tiny-qwen3-Q8_0.gguf", matrix_type="Q8_0")
    _, state = load_checkpoint(gguf_file, keep_gguf_blocks=True)
    assert isinstance(state["model.layers.0.self_attn.q_proj.weight"], BlockWeight)
    assert state["model.layers.0.self_attn.q_proj.weight"].qtype == "Q8_0"
    assert state["model.layers.0.self_attn.q_norm.weight"].dtype == torch.float32
    # The file carries no tokenizer: the folder's serves it (--tokenizer).
    config = EngineConfig(
        model=str(gguf_file),
        tokenizer=str(folder),
        quantization="gguf",
        block_size=4,
        num_blocks=64,
        kv_cache_dtype="float32",  # only the weights' blocks differ from the float32 run
    )
    blocks = LLM.from_config(config)
    runner = blocks.engine.runner
    assert runner.decode_plan.path is DecodePath.FUSED_NATIVE
    assert isinstance(runner.model.layers[0].qkv_proj, GgufLinear)
    on_blocks = greedy_on(blocks.engine, PROMPTS, max_tokens=6)
    in_float32 = greedy_from_checkpoint(gguf_file, PROMPTS, max_tokens=6)
    # Only the activations' rounding to 8-bit blocks differs from float32.
    for (tokens, logprobs), (float_tokens, float_logprobs) in zip(on_blocks, in_float32, strict=True):
        assert tokens[:3] == float_tokens[:3]
        assert logprobs[0] == pytest.approx(float_logprobs[0], abs=0.05)


def test_a_qwen2_gguf_with_its_biases_equals_its_folder(tmp_path):
    """Qwen2's tensors are read natively too: q/k/v biases under llama.cpp's names, rows as they are."""
    folder = make_tiny_model(tmp_path / "qwen2", "qwen2")
    gguf_file = write_qwen2_gguf(folder, tmp_path / "tiny-qwen2-F32.gguf")
    _, state = load_checkpoint(gguf_file)
    assert "model.layers.0.self_attn.q_proj.bias" in state
    from_folder = greedy_from_checkpoint(folder, PROMPTS, max_tokens=6)
    from_gguf = greedy_from_checkpoint(gguf_file, PROMPTS, max_tokens=6)
    assert [tokens for tokens, _ in from_gguf] == [tokens for tokens, _ in from_folder]
    for (_, folder_logprobs), (_, gguf_logprobs) in zip(from_folder, from_gguf, strict=True):
        assert gguf_logprobs == pytest.approx(folder_logprobs, abs=1e-4)
