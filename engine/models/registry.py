"""The decoder architectures kvserve serves: one entry per Hugging Face architecture name.

An entry names the model class that runs the architecture, the names its checkpoints carry
(config.json's `architectures` and `model_type`, a GGUF file's `general.architecture`), how its
config becomes a ModelConfig, and what the engine may do with it: the attention kinds it has,
whether its positions are learned, whether the fused native decode (engine/models/llama_fused.py)
computes it exactly, whether its GGUF matrices can stay in their blocks, and the quantization
modes that apply. Every list of decoder architecture names in the engine reads this table.

Encoders (embedding models, cross-encoders) are not here: they load through engine/models/bert.py
and engine/models/cross_encoder.py, keyed by their own model types, and none of these capabilities
apply to them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from torch import nn

from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.models.gpt2 import GPT2LMHeadModel
from engine.models.llama import LlamaForCausalLM, Qwen2ForCausalLM
from engine.models.qwen3 import Qwen3ForCausalLM

AttentionKind = Literal["full", "sliding"]
# (architecture, transformers config, the checkpoint it came from) -> the engine's ModelConfig
ConfigMapper = Callable[[str, Any, Path], ModelConfig]


@dataclass(frozen=True)
class ModelEntry:
    """One decoder architecture and what the engine may do with it."""

    name: str  # config.json's `architectures[0]`, e.g. "LlamaForCausalLM"
    model_class: type[nn.Module]  # built from a ModelConfig on the meta device, then filled by load_weights(state)
    model_type: str  # config.json's `model_type`; names the architecture when `architectures` is absent
    # `general.architecture` values of its GGUF files; empty when llama.cpp writes it under another's name
    gguf_architectures: tuple[str, ...]
    config_mapper: ConfigMapper
    attention_kinds: tuple[AttentionKind, ...]  # "sliding": its config may set a window
    has_learned_positions: bool = False  # a position table: no streaming past max_position_embeddings
    fused_decode: bool = False  # llama_fused's kernel computes exactly this architecture's layers
    gguf_blocks: bool = False  # its GGUF tensors are read natively and may stay in their quantized blocks
    # Modes of engine.config.QUANTIZATION_MODES (auto aside) it runs under; "gguf" without gguf_blocks
    # dequantizes the file and rounds its matrices to int8.
    quantization_modes: tuple[str, ...] = ("none", "int8", "gguf")

    def model_config(self, hf_config: Any, source: Path) -> ModelConfig:
        """The ModelConfig of a checkpoint of this architecture (`source` names it in errors)."""
        return self.config_mapper(self.name, hf_config, source)


# ------------------------------------------------------------------ config mappers


def _gpt2_config(architecture: str, hf_config: Any, source: Path) -> ModelConfig:
    hidden = hf_config.n_embd
    heads = hf_config.n_head
    return ModelConfig(
        architecture=architecture,
        vocab_size=hf_config.vocab_size,
        hidden_size=hidden,
        num_layers=hf_config.n_layer,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        max_position_embeddings=hf_config.n_positions,
        sliding_window=None,
        hf_config=hf_config,
    )


def _rope_config(architecture: str, hf_config: Any, source: Path, window: int | None) -> ModelConfig:
    """The LLaMA family's config; `window` is the architecture's reading of its sliding window."""
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    layer_types = getattr(hf_config, "layer_types", None)
    if window is not None and layer_types and len(set(layer_types)) > 1:
        raise ModelLoadError(
            f"{source}: models that mix full and sliding-window layers ({sorted(set(layer_types))}) "
            "are not supported yet"
        )
    return ModelConfig(
        architecture=architecture,
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        num_layers=hf_config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        max_position_embeddings=hf_config.max_position_embeddings,
        sliding_window=window,
        hf_config=hf_config,
    )


def _llama_config(architecture: str, hf_config: Any, source: Path) -> ModelConfig:
    return _rope_config(architecture, hf_config, source, getattr(hf_config, "sliding_window", None))


def _qwen2_config(architecture: str, hf_config: Any, source: Path) -> ModelConfig:
    # Qwen2 configs carry a sliding_window that applies only when use_sliding_window is set.
    window = getattr(hf_config, "sliding_window", None) if getattr(hf_config, "use_sliding_window", False) else None
    return _rope_config(architecture, hf_config, source, window)


# ------------------------------------------------------------------ the table

_ENTRIES = (
    ModelEntry(
        name="LlamaForCausalLM",
        model_class=LlamaForCausalLM,
        model_type="llama",
        gguf_architectures=("llama",),
        config_mapper=_llama_config,
        attention_kinds=("full",),
        fused_decode=True,
        gguf_blocks=True,
    ),
    ModelEntry(
        name="MistralForCausalLM",
        model_class=LlamaForCausalLM,
        model_type="mistral",
        # llama.cpp writes Mistral as "llama"; transformers' GGUF reader tells it apart by general.name
        # and reports model_type "mistral", so such a file loads as this entry through its converter.
        gguf_architectures=(),
        config_mapper=_llama_config,
        attention_kinds=("full", "sliding"),
        fused_decode=True,
    ),
    ModelEntry(
        name="Qwen2ForCausalLM",
        model_class=Qwen2ForCausalLM,
        model_type="qwen2",
        gguf_architectures=("qwen2",),
        config_mapper=_qwen2_config,
        attention_kinds=("full", "sliding"),
        fused_decode=True,
    ),
    ModelEntry(
        name="Qwen3ForCausalLM",
        model_class=Qwen3ForCausalLM,
        model_type="qwen3",
        gguf_architectures=("qwen3",),
        config_mapper=_qwen2_config,  # the same use_sliding_window rule
        attention_kinds=("full", "sliding"),
        # The native fused decode has no q/k norm: Qwen3 decodes through the torch layers.
    ),
    ModelEntry(
        name="GPT2LMHeadModel",
        model_class=GPT2LMHeadModel,
        model_type="gpt2",
        gguf_architectures=("gpt2",),
        config_mapper=_gpt2_config,
        attention_kinds=("full",),
        has_learned_positions=True,
    ),
)
_BY_NAME = {entry.name: entry for entry in _ENTRIES}
_BY_MODEL_TYPE = {entry.model_type: entry for entry in _ENTRIES}
_BY_GGUF = {gguf: entry for entry in _ENTRIES for gguf in entry.gguf_architectures}


def entries() -> tuple[ModelEntry, ...]:
    """Every registered architecture, in a fixed order."""
    return _ENTRIES


def names() -> tuple[str, ...]:
    """The supported architecture names, in the order of entries()."""
    return tuple(entry.name for entry in _ENTRIES)


def lookup(architecture: str, source: str | Path | None = None) -> ModelEntry:
    """The entry of `architecture`; ModelLoadError naming `source` and the supported names otherwise."""
    entry = _BY_NAME.get(architecture)
    if entry is None:
        where = f"{source}: " if source is not None else ""
        raise ModelLoadError(f"{where}architecture {architecture!r} is not supported; supported: {', '.join(names())}")
    return entry


def for_model_type(model_type: str) -> ModelEntry | None:
    """The entry whose config.json says `model_type`, or None."""
    return _BY_MODEL_TYPE.get(model_type)


def for_gguf(general_architecture: str) -> ModelEntry | None:
    """The entry that reads GGUF files whose `general.architecture` is `general_architecture`, or None."""
    return _BY_GGUF.get(general_architecture)
