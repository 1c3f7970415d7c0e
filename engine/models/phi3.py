"""Phi-3 (Phi-3, Phi-3.5-mini, Phi-4-mini): the LLaMA layers, stored fused and with partial rotary.

Its checkpoints keep each layer's q/k/v as one `self_attn.qkv_proj.weight` and gate/up as one
`mlp.gate_up_proj.weight` (gate rows first), the fused layouts the LLaMA layers run, so both load as
they are. No biases. RoPE rotates only the first int(head_dim * partial_rotary_factor) dims of each
head (Phi-4-mini: 0.75), and the long-context models scale it with LongRoPE (short and long factors
around original_max_position_embeddings; RotaryEmbedding in engine/models/common.py says which
positions take which). A window in the config's `sliding_window` applies as the LLaMA family's does.

A Phi-3 GGUF carries what transformers' GGUF reader drops: the rotary dims, the LongRoPE factors (as the
`rope_factors_long` / `rope_factors_short` tensors), the original context length, the attention factor
and the sliding window; `gguf_config` reads them back into the config.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from engine.errors import ModelLoadError
from engine.models.common import take
from engine.models.llama import LlamaForCausalLM
from engine.ops.gguf_linear import BlockWeight

# Not weights: a GGUF's LongRoPE factors, read into the config's rope_parameters by gguf_config.
_ROPE_FACTOR_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")


class Phi3ForCausalLM(LlamaForCausalLM):
    def _take_qkv(self, state: dict[str, torch.Tensor | BlockWeight], prefix: str) -> torch.Tensor | BlockWeight:
        return take(state, f"{prefix}self_attn.qkv_proj.weight")

    def _take_gate_up(self, state: dict[str, torch.Tensor | BlockWeight], prefix: str) -> torch.Tensor | BlockWeight:
        return take(state, f"{prefix}mlp.gate_up_proj.weight")

    def _rotary_dim(self) -> int:
        params = getattr(self.config.hf_config, "rope_parameters", None) or {}
        return int(self.config.head_dim * params.get("partial_rotary_factor", 1.0))


def _field(reader: Any, key: str) -> Any:
    field = reader.get_field(key)
    return field.contents() if field is not None else None


def gguf_config(reader: Any, config: dict[str, Any]) -> dict[str, Any]:
    """`config` (transformers' reading of a `phi3` GGUF's metadata) with what that reading drops, from
    `reader` (the file as engine/hub/gguf_file.py open_gguf read it): the partial rotary factor (from the rotary dim
    count), the sliding window (0: none), and a LongRoPE scaling when the file has its factor tensors."""
    import gguf

    config = dict(config)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    rope: dict[str, Any] = {"rope_theta": config.get("rope_theta", 10000.0)}
    rotary_dims = _field(reader, "phi3.rope.dimension_count")
    if rotary_dims is not None and int(rotary_dims) != head_dim:
        factor = int(rotary_dims) / head_dim
        if int(head_dim * factor) != int(rotary_dims):
            raise ModelLoadError(f"a rotary dim count of {rotary_dims} is no fraction of head dim {head_dim}")
        rope["partial_rotary_factor"] = factor
    window = _field(reader, "phi3.attention.sliding_window")
    config["sliding_window"] = int(window) if window else None
    factors = {}
    for tensor in reader.tensors:
        if tensor.name in _ROPE_FACTOR_TENSORS:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(-1)
            factors[tensor.name.split(".")[0].removeprefix("rope_factors_")] = [float(v) for v in values]
    if factors:
        if set(factors) != {"long", "short"}:
            raise ModelLoadError(f"the GGUF has only the {', '.join(factors)} LongRoPE factors (it needs both)")
        original = _field(reader, "phi3.rope.scaling.original_context_length")
        if original is None:
            raise ModelLoadError("the GGUF has LongRoPE factors but no rope.scaling.original_context_length")
        rope.update(rope_type="longrope", long_factor=factors["long"], short_factor=factors["short"])
        # Phi-3 configs keep the pretraining length outside rope_parameters, and transformers reads it there.
        config["original_max_position_embeddings"] = int(original)
        attn_factor = _field(reader, "phi3.rope.scaling.attn_factor")
        scale = config["max_position_embeddings"] / int(original)
        default = math.sqrt(1 + math.log(scale) / math.log(int(original))) if scale > 1.0 else 1.0
        # The file stores the attention factor in float32; only one that is not the default one is kept.
        if attn_factor is not None and not math.isclose(float(attn_factor), default, rel_tol=1e-6):
            rope["attention_factor"] = float(attn_factor)
    config.pop("rope_theta", None)
    config["rope_parameters"] = rope
    return config
