"""The decoder architectures kvserve serves: one entry per Hugging Face architecture name.

An entry names the model class that runs the architecture, the names its checkpoints carry
(config.json's `architectures` and `model_type`, a GGUF file's `general.architecture`), how its
config becomes a ModelConfig, and what the engine may do with it: the attention kinds it has,
whether its positions are learned, whether the fused native decode (engine/models/fused_decode.py)
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
from engine.models.gemma import SUPPORTED_ACTIVATIONS, Gemma2ForCausalLM, Gemma3ForCausalLM
from engine.models.gpt2 import GPT2LMHeadModel
from engine.models.llama import LlamaForCausalLM, Qwen2ForCausalLM
from engine.models.phi3 import Phi3ForCausalLM
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
    fused_decode: bool = False  # engine/models/fused_decode.py's kernel computes this architecture's layers
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


# config.layer_types' names of the two attention kinds.
_SLIDING_LAYER = "sliding_attention"
_FULL_LAYER = "full_attention"


def layer_windows(hf_config: Any, source: Path, window: int | None) -> tuple[int | None, ...] | None:
    """Each layer's window from config.layer_types (sliding layers see `window` keys, full layers all),
    or None where the config names no layer types. A window of None makes every layer full."""
    layer_types = getattr(hf_config, "layer_types", None)
    if not layer_types or window is None:
        return None
    unknown = sorted(set(layer_types) - {_SLIDING_LAYER, _FULL_LAYER})
    if unknown:
        raise ModelLoadError(
            f"{source}: layer types {unknown} are not supported (only {_SLIDING_LAYER}, {_FULL_LAYER})"
        )
    if len(layer_types) != hf_config.num_hidden_layers:
        raise ModelLoadError(f"{source}: {len(layer_types)} layer_types for {hf_config.num_hidden_layers} layers")
    return tuple(window if kind == _SLIDING_LAYER else None for kind in layer_types)


def _rope_config(
    architecture: str,
    hf_config: Any,
    source: Path,
    window: int | None,
    windows: tuple[int | None, ...] | None = None,
) -> ModelConfig:
    """The LLaMA family's config; `window` is the architecture's reading of its sliding window, `windows` each
    layer's where the architecture gives layers their own (layer_windows)."""
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    if windows is not None and len(set(windows)) == 1:
        window, windows = windows[0], None  # every layer alike: one window (or none) for all
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
        layer_windows=windows,
    )


def _llama_config(architecture: str, hf_config: Any, source: Path) -> ModelConfig:
    return _rope_config(architecture, hf_config, source, getattr(hf_config, "sliding_window", None))


def _qwen2_config(architecture: str, hf_config: Any, source: Path) -> ModelConfig:
    # Qwen2 configs carry a sliding_window that applies only when use_sliding_window is set.
    window = getattr(hf_config, "sliding_window", None) if getattr(hf_config, "use_sliding_window", False) else None
    # Qwen2 and Qwen3 give it to the layers config.layer_types names sliding (from max_window_layers on);
    # LLaMA, Mistral and Phi-3 give their window to every layer, whatever layer_types says.
    return _rope_config(architecture, hf_config, source, window, layer_windows(hf_config, source, window))


def _gemma_config(architecture: str, hf_config: Any, source: Path) -> ModelConfig:
    """Gemma 2 / Gemma 3 text: config.sliding_window on the layers config.layer_types names sliding."""
    if getattr(hf_config, "use_bidirectional_attention", False):
        raise ModelLoadError(f"{source}: use_bidirectional_attention (a non-causal {architecture}) is not supported")
    activation = getattr(hf_config, "hidden_activation", None)
    if activation not in SUPPORTED_ACTIVATIONS:
        raise ModelLoadError(
            f"{source}: hidden_activation {activation!r} is not supported (only {', '.join(SUPPORTED_ACTIVATIONS)})"
        )
    window = getattr(hf_config, "sliding_window", None)
    return _rope_config(architecture, hf_config, source, window, layer_windows(hf_config, source, window))


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
        gguf_blocks=True,  # llama.cpp's LLaMA tensor names plus q/k/v biases, rows unpermuted
    ),
    ModelEntry(
        name="Qwen3ForCausalLM",
        model_class=Qwen3ForCausalLM,
        model_type="qwen3",
        gguf_architectures=("qwen3",),
        config_mapper=_qwen2_config,  # the same use_sliding_window rule
        attention_kinds=("full", "sliding"),
        fused_decode=True,  # its per-head q/k norms run in the fused kernel too
        gguf_blocks=True,  # llama.cpp's LLaMA tensor names plus attn_q_norm / attn_k_norm, rows unpermuted
    ),
    ModelEntry(
        name="Phi3ForCausalLM",
        model_class=Phi3ForCausalLM,
        model_type="phi3",
        gguf_architectures=("phi3",),
        config_mapper=_llama_config,  # transformers' Phi-3 applies a config's sliding_window as LLaMA's does
        attention_kinds=("full", "sliding"),
        fused_decode=True,  # partial rotary and LongRoPE's per-token cos/sin run in the fused kernel too
        gguf_blocks=True,
    ),
    ModelEntry(
        name="Gemma2ForCausalLM",
        model_class=Gemma2ForCausalLM,
        model_type="gemma2",
        gguf_architectures=("gemma2",),
        config_mapper=_gemma_config,
        attention_kinds=("full", "sliding"),
        fused_decode=True,  # post-norms, GeGLU, softcaps and one attention group per window run fused too
        gguf_blocks=True,  # its norms stored as 1 + w
    ),
    ModelEntry(
        name="Gemma3ForCausalLM",
        model_class=Gemma3ForCausalLM,
        model_type="gemma3_text",
        gguf_architectures=("gemma3",),  # transformers reads a gemma3 GGUF as the text model
        config_mapper=_gemma_config,
        attention_kinds=("full", "sliding"),
        fused_decode=True,  # its q/k norms and per-layer-type RoPE too
        gguf_blocks=True,
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
