"""ModelInfo: the facts about a loaded generation model that callers read and never change.

The model's shape (layers, heads, head size, vocabulary), how its attention is masked as this
engine runs it (the engine's sliding window and sink tokens, which may override the checkpoint's), and
what it runs on (the device; on CPU the features its kernels were chosen by, the kernels' build and the
dtype of its GGUF layers' prefill products), so a benchmark table can say what ran.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.engine_core import LLMEngine

# ModelInfo.attention_kinds: which keys a layer's queries see.
ATTENTION_FULL = "full"  # every earlier position (causal)
ATTENTION_SLIDING = "sliding"  # the last sliding_window positions, plus the first num_sink_tokens


@dataclass(frozen=True)
class ModelInfo:
    model_name: str
    architecture: str  # the model family as its checkpoint names it ("llama", "qwen2", "mistral", ...)
    num_parameters: int  # the checkpoint's weights' elements, counted before quantization
    weight_bytes: int  # the weights as held in memory, quantized blocks included
    quantization: str  # the --quantization method the weights run under, auto resolved
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    attention_kinds: tuple[str, ...]  # one per layer: ATTENTION_FULL or ATTENTION_SLIDING
    sliding_window: int | None  # keys each sliding layer sees; None where every layer is full
    num_sink_tokens: int  # leading positions a sliding layer keeps visible; 0 without a window
    max_model_len: int  # prompt plus generated tokens of one sequence
    vocab_size: int  # token ids are in [0, vocab_size)
    device: str  # torch device, "cpu" or "cuda:0"
    cpu_features: tuple[str, ...]  # on CPU the SIMD features kernels are chosen by (engine/ops/cpu_features.py)
    kernel_build: str | None  # the native kernels' instruction-set build (engine/ops/loader.py); None: torch only
    prefill_dtype: str | None  # the GGUF block layers' prefill products (--prefill-dtype); None: no such layers
    kv_cache_dtype: str  # the KV cache's format (--kv-cache-dtype, auto resolved)
    kv_bytes_per_token: int  # one token's keys and values over every layer, in that format


def read_model_info(llm_engine: LLMEngine) -> ModelInfo:
    """The engine's model, as the engine runs it: each layer full or under the engine's window and sinks."""
    model = llm_engine.model_config
    window = llm_engine.sliding_window
    from engine.ops import loader  # here: ModelInfo itself imports without torch
    from engine.ops.cpu_features import cpu_features

    layout = llm_engine.layout
    runner = llm_engine.runner
    on_cpu = runner.device.type == "cpu"
    kinds = tuple(
        ATTENTION_FULL if layout.window_of_layer(layer) is None else ATTENTION_SLIDING
        for layer in range(model.num_layers)
    )
    return ModelInfo(
        model_name=llm_engine.model_name,
        architecture=getattr(model.hf_config, "model_type", None) or model.architecture,
        num_parameters=runner.num_parameters,
        weight_bytes=runner.weight_bytes,
        quantization=runner.quantization,
        hidden_size=model.hidden_size,
        num_layers=model.num_layers,
        num_heads=model.num_heads,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        attention_kinds=kinds,
        sliding_window=window,
        num_sink_tokens=llm_engine.num_sink_tokens,
        max_model_len=llm_engine.max_model_len,
        vocab_size=llm_engine.vocab_size,
        device=str(runner.device),
        cpu_features=cpu_features() if on_cpu else (),
        kernel_build=loader.chosen_isa() if on_cpu and runner.decode_plan.native_ops else None,
        prefill_dtype=runner.prefill_dtype,
        kv_cache_dtype=llm_engine.kv_cache_dtype,
        kv_bytes_per_token=llm_engine.kv_bytes_per_token,
    )
