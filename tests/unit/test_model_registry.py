"""Every entry of the model registry is consistent: its class, its names, its config mapping, its capabilities."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch import nn

from engine.config import QUANTIZATION_MODES
from engine.errors import ModelLoadError
from engine.models import registry
from engine.models.weights import _model_config_from_hf
from tests.support import tiny_models

ENTRIES = registry.entries()
IDS = [entry.name for entry in ENTRIES]


def test_names_are_unique_and_each_looks_up_its_entry():
    names = registry.names()
    assert len(set(names)) == len(names) == len(ENTRIES)
    assert all(registry.lookup(name) is entry for name, entry in zip(names, ENTRIES))


def test_model_types_and_gguf_names_each_pick_one_entry():
    model_types = [entry.model_type for entry in ENTRIES]
    assert len(set(model_types)) == len(model_types)
    gguf_names = [name for entry in ENTRIES for name in entry.gguf_architectures]
    assert len(set(gguf_names)) == len(gguf_names)
    for entry in ENTRIES:
        assert registry.for_model_type(entry.model_type) is entry
        assert all(registry.for_gguf(name) is entry for name in entry.gguf_architectures)
    assert registry.for_model_type("bert") is None and registry.for_gguf("falcon") is None


def test_an_unsupported_architecture_names_the_source_and_every_supported_one():
    with pytest.raises(ModelLoadError) as err:
        registry.lookup("BertForMaskedLM", "/models/bert")
    message = str(err.value)
    assert message.startswith("/models/bert: architecture 'BertForMaskedLM' is not supported; supported: ")
    assert all(name in message for name in registry.names())


@pytest.mark.parametrize("entry", ENTRIES, ids=IDS)
def test_each_entry_names_a_model_class_and_capabilities_that_hold(entry):
    assert issubclass(entry.model_class, nn.Module)
    for method in ("load_weights", "compute_logits", "forward"):
        assert callable(getattr(entry.model_class, method, None)), method
    assert entry.attention_kinds and set(entry.attention_kinds) <= {"full", "sliding"}
    assert entry.quantization_modes and set(entry.quantization_modes) <= set(QUANTIZATION_MODES) - {"auto"}
    if entry.fused_decode:  # the kernel reads the layers the class describes
        assert callable(getattr(entry.model_class, "fused_recipe", None))
    if entry.gguf_blocks:
        assert "gguf" in entry.quantization_modes and entry.gguf_architectures


@pytest.mark.parametrize("entry", ENTRIES, ids=IDS)
def test_each_entry_has_a_tiny_model_and_maps_its_config(entry):
    """The tiny builder covers the entry; its config maps to this architecture, through `architectures`
    and, as GGUF metadata gives it, through model_type alone; a window only where it has sliding attention."""
    assert tiny_models._MODEL_CLASSES[entry.model_type] == entry.name
    hf_config = tiny_models._base_config(entry.model_type, 384, {})
    hf_config.architectures = [entry.name]
    model_config = _model_config_from_hf(hf_config, Path("tiny"))
    assert model_config.architecture == entry.name
    assert model_config.sliding_window is None or "sliding" in entry.attention_kinds
    hf_config.architectures = None
    assert _model_config_from_hf(hf_config, Path("tiny")) == model_config


def test_qwen2_windows_only_with_use_sliding_window():
    def window(**overrides) -> int | None:
        config = tiny_models._base_config("qwen2", 384, {"sliding_window": 16, **overrides})
        return registry.lookup("Qwen2ForCausalLM").model_config(config, Path("tiny")).sliding_window

    assert window(use_sliding_window=False) is None
    assert window(use_sliding_window=True, max_window_layers=0) == 16


def test_layer_types_give_each_layer_its_window_where_the_architecture_reads_them():
    def config(arch: str, layer_types: list[str], **extra):
        hf = tiny_models._base_config(arch, 384, {"layer_types": layer_types, "sliding_window": 16, **extra})
        return registry.for_model_type(arch).model_config(hf, Path("tiny"))

    qwen2 = dict(use_sliding_window=True)
    mixed = config("qwen2", ["full_attention", "sliding_attention"], **qwen2)
    assert mixed.layer_windows == (None, 16) and mixed.windows() == (None, 16)
    alike = config("qwen2", ["sliding_attention"] * 2, **qwen2)
    assert alike.layer_windows is None and alike.windows() == (16, 16)
    assert config("qwen2", ["full_attention"] * 2, **qwen2).windows() == (None, None)
    assert config("qwen2", ["full_attention", "sliding_attention"]).windows() == (None, None)  # no use_sliding_window
    # Mistral's layers all take its window, as transformers' Mistral ignores layer_types.
    assert config("mistral", ["full_attention", "sliding_attention"]).windows() == (16, 16)
    with pytest.raises(ModelLoadError, match="layer types \\['chunked_attention'\\] are not supported"):
        config("qwen2", ["full_attention", "chunked_attention"], **qwen2)


def test_the_loader_refuses_a_quantization_the_entry_does_not_list(tiny_llama_dir, monkeypatch):
    import dataclasses

    from engine.config import EngineConfig
    from engine.loader import load_generation

    entry = registry.lookup("LlamaForCausalLM")
    monkeypatch.setitem(registry._BY_NAME, entry.name, dataclasses.replace(entry, quantization_modes=("none",)))
    refusal = "LlamaForCausalLM does not run under quantization 'int8'; it runs under none"
    with pytest.raises(ModelLoadError, match=refusal):
        load_generation(EngineConfig(model=tiny_llama_dir, quantization="int8", num_blocks=16))
    assert load_generation(EngineConfig(model=tiny_llama_dir, num_blocks=16)).engine.config.quantization == "none"


def test_an_architecture_not_served_is_refused_in_one_line_before_transformers_reads_it(tmp_path):
    """Both from a folder (even a model_type transformers does not know) and from a GGUF file."""
    import json

    import gguf

    from engine.models.weights import load_checkpoint

    folder = tmp_path / "unknown"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "brand_new_arch", "hidden_size": 8}))
    with pytest.raises(ModelLoadError, match=r"architecture 'brand_new_arch' is not supported; supported: Llama") as e:
        load_checkpoint(folder)
    assert "\n" not in str(e.value)
    writer = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "falcon")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(
        ModelLoadError, match=r"GGUF architecture 'falcon' is not supported; supported: gemma2, gemma3, gpt2, llama"
    ):
        load_checkpoint(tmp_path / "g.gguf")
