"""Gemma 2 and Gemma 3 text (engine/models/gemma.py) beyond the exactness tests every architecture takes: the same
model from its GGUF file, Gemma 3's attention softcap (which transformers ignores), and the configs refused.

The tiny Gemmas (tests/support/tiny_models.py) slide a window of 8 over longer prompts, cap their scores and
logits, and Gemma 3 rotates its sliding and full layers with different RoPE bases (the full one scaled)."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.errors import ModelLoadError
from engine.llm import LLM
from engine.models import gemma
from engine.models.weights import load_checkpoint
from engine.params import SamplingParams
from engine.quantization.gguf import GgufEmbedding, GgufLinear
from tests.support.checkpoint_greedy import greedy_from_checkpoint, greedy_on
from tests.support.gemma_gguf import write_gemma_gguf
from tests.support.tiny_models import load_reference, make_tiny_model

PROMPTS = [[(7 * i + 3 * j) % 300 + 10 for j in range(20 + 9 * i)] for i in range(3)]  # all past the window of 8
HEAD_DIM = 16


@pytest.fixture(scope="module", params=["gemma2", "gemma3_text"])
def checkpoints(request, tmp_path_factory):
    """A tiny folder and its GGUF. The file cannot carry query_pre_attn_scalar (llama.cpp scales by the head
    size), so this folder's is the head size."""
    arch = request.param
    folder = make_tiny_model(tmp_path_factory.mktemp(arch), arch, query_pre_attn_scalar=HEAD_DIM)
    return arch, folder, write_gemma_gguf(folder, tmp_path_factory.mktemp(f"{arch}-gguf") / f"tiny-{arch}-F32.gguf")


def test_the_gguf_reads_what_its_folder_says(checkpoints):
    arch, folder, gguf_file = checkpoints
    from_folder, from_file = load_checkpoint(folder)[0], load_checkpoint(gguf_file)[0]
    assert from_file.architecture == from_folder.architecture
    # Per-layer windows from the architecture's fixed pattern: Gemma 2 alternates, Gemma 3 five sliding to one.
    assert from_file.layer_windows == from_folder.layer_windows
    assert from_file.layer_windows == ((8, None) if arch == "gemma2" else (8, 8, 8, 8, 8, None))
    folder_hf, file_hf = from_folder.hf_config, from_file.hf_config
    assert file_hf.query_pre_attn_scalar == HEAD_DIM and file_hf.tie_word_embeddings
    assert file_hf.final_logit_softcapping == folder_hf.final_logit_softcapping == 3.0
    assert file_hf.attn_logit_softcapping == folder_hf.attn_logit_softcapping
    assert file_hf.rope_parameters == folder_hf.rope_parameters


def test_the_gguf_equals_its_folder(checkpoints):
    """Greedy tokens and logprobs: the norms' stored 1 + w, the softcaps, the windows and Gemma 3's RoPE per layer
    type all come back from the file."""
    _, folder, gguf_file = checkpoints
    from_folder, from_gguf = greedy_from_checkpoint(folder, PROMPTS), greedy_from_checkpoint(gguf_file, PROMPTS)
    assert [tokens for tokens, _ in from_gguf] == [tokens for tokens, _ in from_folder]
    for (_, folder_logprobs), (_, gguf_logprobs) in zip(from_folder, from_gguf, strict=True):
        assert gguf_logprobs == pytest.approx(folder_logprobs, abs=1e-4)


def test_without_the_gemma_metadata_the_gguf_computes_other_logprobs(checkpoints, monkeypatch):
    """The check above can fail: transformers' reading of the file alone (Gemma 2's default softcaps of 50 and
    30, Gemma 3 without its final softcap and RoPE scaling, a query_pre_attn_scalar of 256) is another model."""
    _, folder, gguf_file = checkpoints
    from_folder = greedy_from_checkpoint(folder, PROMPTS)
    monkeypatch.setattr(gemma, "gguf_config", lambda reader, architecture, config: config)
    from_bare_file = greedy_from_checkpoint(gguf_file, PROMPTS)
    assert any(
        bare != pytest.approx(expected, abs=1e-3)
        for (_, expected), (_, bare) in zip(from_folder, from_bare_file, strict=True)
    )


def test_a_q8_0_gguf_runs_on_its_blocks_and_follows_the_same_file_in_float32(checkpoints, tmp_path):
    """The engine reads a Gemma file itself: its Q8_0 matrices and tied embedding table stay in their blocks,
    its norms come back from their stored 1 + w."""
    arch, folder, _ = checkpoints
    gguf_file = write_gemma_gguf(folder, tmp_path / f"tiny-{arch}-Q8_0.gguf", matrix_type="Q8_0")
    # The file carries no tokenizer: the folder's serves it (--tokenizer).
    config = EngineConfig(
        model=str(gguf_file),
        tokenizer=str(folder),
        quantization="gguf",
        block_size=4,
        num_blocks=96,
        kv_cache_dtype="float32",  # only the weights' blocks differ from the float32 run
    )
    blocks = LLM.from_config(config)
    model = blocks.engine.runner.model
    assert isinstance(model.embed_tokens, GgufEmbedding) and model.embed_tokens.qtype == "Q8_0"
    assert model.lm_head.packed.blocks.data_ptr() == model.embed_tokens.packed.blocks.data_ptr()  # one copy
    assert all(isinstance(layer.qkv_proj, GgufLinear) for layer in model.layers)
    on_blocks = greedy_on(blocks.engine, PROMPTS, max_tokens=6)
    in_float32 = greedy_from_checkpoint(gguf_file, PROMPTS, max_tokens=6)
    # Only the activations' rounding to 8-bit blocks differs from float32.
    for (tokens, logprobs), (float_tokens, float_logprobs) in zip(on_blocks, in_float32, strict=True):
        assert tokens[:3] == float_tokens[:3]
        assert logprobs[0] == pytest.approx(float_logprobs[0], abs=0.05)


def test_gemma3_leaves_an_attention_softcap_unapplied_as_transformers_does(tmp_path):
    """transformers' Gemma 3 never passes attn_logit_softcapping to its attention; a config that sets it still
    computes transformers' logits here."""
    folder = make_tiny_model(tmp_path / "gemma3", "gemma3_text", attn_logit_softcapping=1.0)
    engine = LLM.from_config(EngineConfig(model=str(folder)))
    assert all(layer.softcap is None for layer in engine.engine.runner.model.layers)
    prompt = PROMPTS[1]
    engine.engine.add_request(prompt, SamplingParams(max_tokens=1))
    batch = engine.engine.scheduler.schedule()
    ours = engine.engine.runner.compute_logits(batch, all_positions=True)
    with torch.no_grad():
        theirs = load_reference(folder)(torch.tensor([prompt])).logits[0].float()
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


def test_a_bidirectional_gemma3_is_refused(tmp_path):
    folder = make_tiny_model(tmp_path / "gemma3", "gemma3_text", use_bidirectional_attention=True)
    with pytest.raises(ModelLoadError, match="use_bidirectional_attention"):
        load_checkpoint(folder)


def test_the_multimodal_gemma3_stays_refused_in_one_line(tmp_path):
    import json

    folder = tmp_path / "gemma3-vision"
    folder.mkdir()
    config = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3"}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="architecture 'Gemma3ForConditionalGeneration' is not supported") as e:
        load_checkpoint(folder)
    assert "\n" not in str(e.value)
