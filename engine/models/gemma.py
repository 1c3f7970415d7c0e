"""Gemma 2 (Gemma2ForCausalLM) and Gemma 3 text (Gemma3ForCausalLM).

The layers: an RMSNorm scaled by (1 + weight) before and after attention and before and after the MLP
(four per layer), GeGLU (gelu with the tanh approximation), grouped-query attention scaled by
query_pre_attn_scalar ** -0.5, embeddings multiplied by sqrt(hidden_size) in the activations' dtype, the
output head tied to the embeddings, and the logits capped as cap * tanh(logits / cap) where the config
sets final_logit_softcapping. Layers alternate between sliding-window and full attention (config.layer_types);
each layer's window is in its attention metadata, not here.

Gemma 2 caps the attention scores too (attn_logit_softcapping). Gemma 3 adds an RMSNorm over each head's
query and key before RoPE, and rotates each layer type with its own RoPE (config.rope_parameters keyed by
layer type: a small base for the sliding layers, a large, possibly linearly scaled, one for the full
layers). transformers' Gemma 3 never applies attn_logit_softcapping, so neither does this model.

A GGUF of either carries what transformers' GGUF reader drops (the softcaps, Gemma 3's RoPE scaling);
`gguf_config` reads them back into the config.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.metadata import AttentionMetadata
from engine.attention.paged import paged_attention, write_kv
from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.models.common import (
    RotaryEmbedding,
    apply_rotary,
    assign,
    cat_rows,
    load_embeddings_and_head,
    load_linear,
    take,
)
from engine.models.fused_decode import FusedLayer, FusedRecipe, GreedyTail
from engine.models.llama import RMSNorm
from engine.ops.gguf_linear import BlockWeight
from engine.ops.rms_norm import rms_norm

logger = logging.getLogger(__name__)

# config.hidden_activation -> the MLP's gate activation (transformers' ACT2FN entries of the same names).
_ACTIVATIONS = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}
SUPPORTED_ACTIVATIONS = tuple(_ACTIVATIONS)
# The same activations as the fused decode kernel names them (engine/models/fused_decode.py).
_FUSED_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


class GemmaRMSNorm(RMSNorm):
    """RMSNorm scaled by (1 + weight): the checkpoint's `weight` is the offset from one.

    As transformers computes it, in float32 whatever the activations' dtype: x * rsqrt(mean(x^2) + eps)
    * (1 + weight.float()), then cast back. `scale` holds 1 + weight.float() (float32), set by `load`."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__(size, eps)
        self.register_buffer("scale", torch.ones(size, dtype=torch.float32), persistent=False)

    def load(self, value: torch.Tensor, name: str) -> None:
        assign(self.weight, value, name)
        self.scale = 1.0 + self.weight.detach().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return rms_norm(x, self.scale, self.eps)
        return rms_norm(x.float(), self.scale, self.eps).to(x.dtype)


class GemmaLayer(nn.Module):
    def __init__(self, config: ModelConfig, qk_norm: bool, attn_softcap: float | None) -> None:
        super().__init__()
        hf = config.hf_config
        hidden = config.hidden_size
        eps = hf.rms_norm_eps
        bias = bool(getattr(hf, "attention_bias", False))
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.intermediate = hf.intermediate_size
        self.input_norm = GemmaRMSNorm(hidden, eps)
        self.qkv_proj = nn.Linear(hidden, self.q_size + 2 * self.kv_size, bias=bias)
        # Gemma 3: an RMSNorm over each head's query and key (weights [head_dim]) before RoPE.
        self.q_norm = GemmaRMSNorm(self.head_dim, eps) if qk_norm else None
        self.k_norm = GemmaRMSNorm(self.head_dim, eps) if qk_norm else None
        self.o_proj = nn.Linear(self.q_size, hidden, bias=bias)
        self.post_attention_norm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_norm = GemmaRMSNorm(hidden, eps)
        self.gate_up_proj = nn.Linear(hidden, 2 * self.intermediate, bias=False)
        self.down_proj = nn.Linear(self.intermediate, hidden, bias=False)
        self.post_feedforward_norm = GemmaRMSNorm(hidden, eps)
        self.activation = _ACTIVATIONS[hf.hidden_activation]
        self.fused_activation = _FUSED_ACTIVATIONS[hf.hidden_activation]
        self.scale = hf.query_pre_attn_scalar**-0.5
        self.softcap = attn_softcap

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(self.input_norm(hidden))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        key_cache, value_cache = kv_cache
        write_kv(key_cache, value_cache, k, v, meta.slot_mapping)
        attn = paged_attention(q, key_cache, value_cache, meta, self.scale, softcap=self.softcap)
        hidden = hidden + self.post_attention_norm(self.o_proj(attn.reshape(num_tokens, self.q_size)))
        gate, up = self.gate_up_proj(self.pre_feedforward_norm(hidden)).split(self.intermediate, dim=-1)
        return hidden + self.post_feedforward_norm(self.down_proj(self.activation(gate) * up))


def _rotary_config(hf_config: Any, layer_type: str) -> Any:
    """`hf_config` as RotaryEmbedding reads it for one layer type: a shallow copy whose rope_parameters
    are that type's where the config keys them by layer type (Gemma 3), the config itself otherwise."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    if layer_type not in params:
        return hf_config
    view = copy.copy(hf_config)
    view.rope_parameters = dict(params[layer_type])
    return view


class Gemma2ForCausalLM(nn.Module):
    """Gemma 2; Gemma 3 text is these layers with two switches below."""

    # Gemma 3: each head's query and key pass a (1 + w) RMSNorm before RoPE.
    has_qk_norm: bool = False
    # Whether config.attn_logit_softcapping caps the attention scores (transformers' Gemma 3 ignores it).
    applies_attn_softcap: bool = True

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hf = config.hf_config
        self.config = config
        attn_softcap = getattr(hf, "attn_logit_softcapping", None) if self.applies_attn_softcap else None
        if attn_softcap is None and getattr(hf, "attn_logit_softcapping", None) is not None:
            logger.warning(
                "%s: attn_logit_softcapping=%s is not applied (transformers' %s does not apply it either)",
                config.architecture,
                hf.attn_logit_softcapping,
                config.architecture,
            )
        self.final_softcap: float | None = getattr(hf, "final_logit_softcapping", None)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [GemmaLayer(config, self.has_qk_norm, attn_softcap) for _ in range(config.num_layers)]
        )
        self.norm = GemmaRMSNorm(config.hidden_size, hf.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # Each layer's config.layer_types entry: the RoPE it rotates with where the config keys RoPE by type.
        self.layer_types: list[str] = list(getattr(hf, "layer_types", None) or ["full_attention"] * config.num_layers)
        self.rotaries: dict[str, RotaryEmbedding] = {}  # by RoPE kind, built at load
        self._rotary_kinds: list[str] = []  # each layer's key into self.rotaries
        self.embed_scale: torch.Tensor | None = None  # sqrt(hidden_size) in the model's dtype, set at load

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        metas: list[AttentionMetadata],
    ) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden]; kv_caches and metas: one per layer."""
        hidden = self.embed_tokens(input_ids) * self.embed_scale
        cos_sin = {kind: rotary.cos_sin(positions, hidden.dtype) for kind, rotary in self.rotaries.items()}
        for layer, kind, kv_cache, meta in zip(self.layers, self._rotary_kinds, kv_caches, metas, strict=True):
            cos, sin = cos_sin[kind]
            hidden = layer(hidden, cos, sin, kv_cache, meta)
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> float32 logits [N, vocab], capped in the model's dtype as transformers caps them."""
        logits = self.lm_head(hidden)
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits.float()

    def fused_recipe(self) -> FusedRecipe:
        """These layers as the fused decode kernel runs them (engine/models/fused_decode.py): the four norms
        as their 1 + w multipliers, each layer's RoPE kind and attention softcap."""
        kinds = list(self.rotaries)
        first = self.layers[0]
        return FusedRecipe(
            layers=tuple(
                FusedLayer(
                    attn_norm=layer.input_norm.scale,
                    attn_out_norm=layer.post_attention_norm.scale,
                    ffn_norm=layer.pre_feedforward_norm.scale,
                    ffn_out_norm=layer.post_feedforward_norm.scale,
                    q_norm=layer.q_norm.scale if layer.q_norm is not None else None,
                    k_norm=layer.k_norm.scale if layer.k_norm is not None else None,
                    qkv=layer.qkv_proj,
                    o=layer.o_proj,
                    gate_up=layer.gate_up_proj,
                    down=layer.down_proj,
                    rope=kinds.index(kind),
                    softcap=layer.softcap,
                )
                for layer, kind in zip(self.layers, self._rotary_kinds, strict=True)
            ),
            rotaries=tuple(self.rotaries.values()),
            embed=lambda input_ids: self.embed_tokens(input_ids) * self.embed_scale,
            final_norm=self.norm,
            activation=first.fused_activation,
            eps=first.input_norm.eps,  # every norm of the model has the config's rms_norm_eps
            scale=first.scale,
            num_heads=first.num_heads,
            num_kv_heads=first.num_kv_heads,
            head_dim=first.head_dim,
            intermediate=first.intermediate,
            tail=self._greedy_tail(),
        )

    def _greedy_tail(self) -> GreedyTail | None:
        """The step past the layers for the greedy kernel; None where the logits are capped (Gemma 2), since a cap
        can make two logits equal that the kernel's argmax over the uncapped ones would tell apart."""
        if self.final_softcap is not None or self.embed_scale is None or self.embed_scale.dtype != torch.float32:
            return None
        return GreedyTail(self.embed_tokens, float(self.embed_scale), self.norm.scale, self.norm.eps, self.lm_head)

    def load_weights(self, state: dict[str, torch.Tensor | BlockWeight]) -> None:
        """Fill the model from HF-named tensors; GGUF blocks (BlockWeight) replace the layers they fill."""
        if self.config.rope_freq_factors is not None:
            raise ModelLoadError(f"{self.config.architecture}: a GGUF rope_freqs tensor is not supported")
        state = dict(state)
        dtype = self.norm.weight.dtype  # the model's (the embedding may stay in GGUF blocks)
        load_embeddings_and_head(self, state, tied_by_default=True)
        self.norm.load(take(state, "model.norm.weight"), "model.norm.weight")
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            attn = f"{p}self_attn."
            qkv = cat_rows([take(state, f"{attn}{n}_proj.weight") for n in "qkv"])
            qkv_bias = None
            if layer.qkv_proj.bias is not None:
                qkv_bias = torch.cat([take(state, f"{attn}{n}_proj.bias") for n in "qkv"])
            load_linear(layer, "qkv_proj", qkv, qkv_bias, f"{attn}qkv")
            o_bias = take(state, f"{attn}o_proj.bias") if layer.o_proj.bias is not None else None
            load_linear(layer, "o_proj", take(state, f"{attn}o_proj.weight"), o_bias, f"{attn}o_proj")
            gate_up = cat_rows([take(state, f"{p}mlp.{n}_proj.weight") for n in ("gate", "up")])
            load_linear(layer, "gate_up_proj", gate_up, None, f"{p}mlp.gate_up")
            load_linear(layer, "down_proj", take(state, f"{p}mlp.down_proj.weight"), None, f"{p}mlp.down_proj")
            if layer.q_norm is not None:
                layer.q_norm.load(take(state, f"{attn}q_norm.weight"), f"{attn}q_norm")
                layer.k_norm.load(take(state, f"{attn}k_norm.weight"), f"{attn}k_norm")
            norms = (
                (layer.input_norm, "input_layernorm"),
                (layer.post_attention_norm, "post_attention_layernorm"),
                (layer.pre_feedforward_norm, "pre_feedforward_layernorm"),
                (layer.post_feedforward_norm, "post_feedforward_layernorm"),
            )
            for norm, name in norms:
                norm.load(take(state, f"{p}{name}.weight"), f"{p}{name}")
        leftovers = [k for k in state if "rotary_emb" not in k]
        if leftovers:
            raise ValueError(f"unexpected weights in checkpoint: {leftovers[:5]}")
        device = self.norm.weight.device
        # transformers: a float32 scalar cast to the embeddings' dtype (sqrt(3072) is 55.5 in bfloat16).
        self.embed_scale = torch.tensor(self.config.hidden_size**0.5).to(device, dtype)
        hf = self.config.hf_config
        # One RoPE per layer type where the config keys RoPE by type, else one for every layer.
        keyed = all(kind in (getattr(hf, "rope_parameters", None) or {}) for kind in self.layer_types)
        self._rotary_kinds = self.layer_types if keyed else ["all"] * len(self.layers)
        kinds = dict.fromkeys(self._rotary_kinds)
        self.rotaries = {
            kind: RotaryEmbedding(_rotary_config(hf, kind), self.config.head_dim, device) for kind in kinds
        }


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 text: Gemma 2's layers with per-head q/k norms, RoPE per layer type, no attention softcap."""

    has_qk_norm = True
    applies_attn_softcap = False


def _field(reader: Any, key: str) -> Any:
    field = reader.get_field(key)
    return field.contents() if field is not None else None


# Layer counts at which llama.cpp scales Gemma's attention by hidden_size // num_heads instead of the head size
# (the 27B models, whose query_pre_attn_scalar is that quotient); GGUF metadata does not carry the scalar.
_HIDDEN_PER_HEAD_SCALED = {"gemma2": 46, "gemma3": 62}
# llama.cpp's fixed RoPE base of Gemma 3's sliding layers, where the file does not give one.
_GEMMA3_SLIDING_ROPE_THETA = 10000.0


def gguf_config(reader: Any, architecture: str, config: dict[str, Any]) -> dict[str, Any]:
    """`config` (transformers' reading of a `gemma2` / `gemma3` GGUF's metadata) with what that reading drops,
    from `reader` (the file as engine/hub/gguf_file.py open_gguf read it), read as llama.cpp reads the file:

    - the softcaps (`attn_logit_softcapping`, `final_logit_softcapping`; Gemma 2's defaults where absent,
      none for Gemma 3, which never caps attention scores);
    - query_pre_attn_scalar, which the file lacks: the head size, or hidden_size // num_heads in the 27B
      models (told apart by their layer count);
    - Gemma 3's RoPE per layer type: the file's base and linear scaling for the full layers, base 10000 (or
      the file's rope.freq_base_swa) for the sliding ones.

    The layer types are left to the config's defaults, which are llama.cpp's fixed patterns too: Gemma 2
    alternates sliding and full layers, Gemma 3 has five sliding layers to every full one."""
    config = dict(config)
    prefix = architecture
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if config.get("num_hidden_layers") == _HIDDEN_PER_HEAD_SCALED[architecture]:
        config["query_pre_attn_scalar"] = config["hidden_size"] // config["num_attention_heads"]
    else:
        config["query_pre_attn_scalar"] = head_dim
    final_cap = _field(reader, f"{prefix}.final_logit_softcapping")
    if architecture == "gemma2":
        attn_cap = _field(reader, f"{prefix}.attn_logit_softcapping")
        if attn_cap is not None:
            config["attn_logit_softcapping"] = float(attn_cap)
        if final_cap is not None:
            config["final_logit_softcapping"] = float(final_cap)
        return config
    config["final_logit_softcapping"] = float(final_cap) if final_cap else None
    full: dict[str, Any] = {"rope_type": "default", "rope_theta": float(config.pop("rope_theta", 1_000_000.0))}
    scaling = _field(reader, f"{prefix}.rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise ModelLoadError(f"Gemma 3 GGUF: rope scaling {scaling!r} is not supported (only linear)")
        full.update(rope_type="linear", factor=float(_field(reader, f"{prefix}.rope.scaling.factor")))
    sliding_theta = _field(reader, f"{prefix}.rope.freq_base_swa")
    sliding = {"rope_type": "default", "rope_theta": float(sliding_theta or _GEMMA3_SLIDING_ROPE_THETA)}
    config["rope_parameters"] = {"full_attention": full, "sliding_attention": sliding}
    return config
