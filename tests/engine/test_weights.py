"""Loading: sharded safetensors, clear errors for what cannot be loaded, lower precisions."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine.config import EngineConfig
from engine.errors import ModelLoadError
from engine.llm import LLM
from engine.models import registry
from engine.models.weights import load_checkpoint
from engine.params import SamplingParams
from tests.support.tiny_models import load_reference


def test_sharded_safetensors_with_index(tiny_llama_dir, tmp_path):
    sharded = tmp_path / "sharded"
    load_reference(tiny_llama_dir).save_pretrained(sharded, max_shard_size="100KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{tiny_llama_dir}/{name}", sharded / name)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    one = LLM.from_config(EngineConfig(model=tiny_llama_dir)).generate(["Hello world"], params)
    many = LLM.from_config(EngineConfig(model=str(sharded))).generate(["Hello world"], params)
    assert one[0][0].token_ids == many[0][0].token_ids


def test_unsupported_architecture_lists_supported(tiny_llama_dir, tmp_path):
    bad = tmp_path / "bert"
    shutil.copytree(tiny_llama_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    config.update(architectures=["BertForMaskedLM"], model_type="bert")
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as err:
        load_checkpoint(bad)
    message = str(err.value)
    assert "BertForMaskedLM" in message and str(bad) in message
    assert all(arch in message for arch in registry.names())


@pytest.mark.parametrize(
    "setup,needle",
    [
        (lambda d: (d / "config.json").unlink(), "config.json"),
        (lambda d: [p.unlink() for p in d.glob("*.safetensors")], "safetensors"),
        (lambda d: (d / "model.safetensors").write_bytes(b"not a safetensors file"), "model.safetensors"),
    ],
    ids=["no-config", "no-weights", "corrupt-weights"],
)
def test_broken_model_directory_names_file_and_reason(tiny_llama_dir, tmp_path, setup, needle):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama_dir, broken)
    setup(broken)
    with pytest.raises(ModelLoadError) as err:
        LLM.from_config(EngineConfig(model=str(broken)))
    assert needle in str(err.value)


def test_missing_path_and_bad_file(tmp_path):
    with pytest.raises(ModelLoadError, match="no such file"):
        load_checkpoint(tmp_path / "nowhere")
    not_gguf = tmp_path / "model.bin"
    not_gguf.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="gguf"):
        load_checkpoint(not_gguf)
    fake_gguf = tmp_path / "model.gguf"
    fake_gguf.write_bytes(b"definitely not gguf")
    with pytest.raises(ModelLoadError, match="model.gguf"):
        load_checkpoint(fake_gguf)


def test_bfloat16_logits_close_to_float32(tiny_llama_dir):
    """bf16 is a documented approximation: logits within a few hundredths, same greedy start."""
    prompt = "The quick brown fox jumps over the lazy dog."
    logits = {}
    for dtype in ("float32", "bfloat16"):
        engine = LLM.from_config(EngineConfig(model=tiny_llama_dir, dtype=dtype))
        engine.engine.add_request(engine.tokenizer.encode(prompt), SamplingParams(max_tokens=1))
        batch = engine.engine.scheduler.schedule()
        logits[dtype] = engine.engine.runner.compute_logits(batch, all_positions=True)
    error = (logits["float32"] - logits["bfloat16"]).abs().max().item()
    assert error < 0.25
    assert torch.equal(logits["float32"][-1].argmax(), logits["bfloat16"][-1].argmax())
