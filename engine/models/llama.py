"""The LLaMA family: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM (Qwen3: engine/models/qwen3.py).

RoPE (with transformers' scaling types), RMSNorm, SwiGLU, grouped- and
multi-query attention, optional per-head q/k norms (Qwen3), optional q/k/v(/o) biases (Qwen2, attention_bias), tied
or untied embeddings. Sliding windows are expressed in the attention metadata,
not here. All activations are flat: [T, ...] for the T new tokens of a step.

Plain torch modules. RMSNorm and paged attention call the op functions of
engine/ops, which run a native kernel on float32 CPU tensors where it loads.
The runner may run decode-only steps of int8 or GGUF-block models through
engine/models/fused_decode.py instead, which reads these modules' weights as
`fused_recipe` describes them; this forward is its reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.metadata import AttentionMetadata
from engine.attention.paged import paged_attention, write_kv
from engine.config import ModelConfig
from engine.models.common import (
    RotaryEmbedding,
    apply_rotary,
    assign,
    cat_rows,
    load_embeddings_and_head,
    load_linear,
    take,
)
from engine.models.fused_decode import FusedLayer, FusedRecipe, GreedyTail, NotFusable
from engine.ops.gguf_linear import BlockParts, BlockWeight
from engine.ops.rms_norm import rms_norm


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class LlamaLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, qkv_bias: bool, o_bias: bool, mlp_bias: bool, eps: float, qk_norm: bool = False
    ) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        intermediate = config.hf_config.intermediate_size
        self.intermediate = intermediate
        self.input_norm = RMSNorm(hidden, eps)
        self.qkv_proj = nn.Linear(hidden, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        # Qwen3: an RMSNorm over each head's query and key (weights [head_dim]) before RoPE.
        self.q_norm = RMSNorm(self.head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps) if qk_norm else None
        self.o_proj = nn.Linear(self.q_size, hidden, bias=o_bias)
        self.post_attention_norm = RMSNorm(hidden, eps)
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=mlp_bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=mlp_bias)
        self.scale = self.head_dim**-0.5

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        normed = self.input_norm(hidden)
        qk, v = self.qkv_proj(normed).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = qk.view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        # Rotate queries and keys together: [T, H_q + H_kv, D].
        qk = apply_rotary(qk, cos, sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        key_cache, value_cache = kv_cache
        write_kv(key_cache, value_cache, k, v, meta.slot_mapping)
        attn = paged_attention(q, key_cache, value_cache, meta, self.scale)
        hidden = hidden + self.o_proj(attn.reshape(num_tokens, self.q_size))
        gate, up = self.gate_up_proj(self.post_attention_norm(hidden)).split(self.intermediate, dim=-1)
        return hidden + self.down_proj(F.silu(gate) * up)


class LlamaForCausalLM(nn.Module):
    # True: q/k/v carry biases and o none, whatever the config says (Qwen2); False: attention_bias decides.
    qkv_bias_always: bool = False
    # True: each head's query and key pass an RMSNorm before RoPE (Qwen3).
    has_qk_norm: bool = False

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hf = config.hf_config
        self.config = config
        attention_bias = bool(getattr(hf, "attention_bias", False))
        qkv_bias = self.qkv_bias_always or attention_bias
        o_bias = attention_bias and not self.qkv_bias_always
        mlp_bias = bool(getattr(hf, "mlp_bias", False))
        eps = hf.rms_norm_eps
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [LlamaLayer(config, qkv_bias, o_bias, mlp_bias, eps, self.has_qk_norm) for _ in range(config.num_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary: RotaryEmbedding | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        metas: list[AttentionMetadata],
    ) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden]; kv_caches and metas: one per layer."""
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, hidden.dtype)
        for layer, kv_cache, meta in zip(self.layers, kv_caches, metas, strict=True):
            hidden = layer(hidden, cos, sin, kv_cache, meta)
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> float32 logits [N, vocab]."""
        return self.lm_head(hidden).float()

    def fused_recipe(self) -> FusedRecipe:
        """These layers as the fused decode kernel runs them (engine/models/fused_decode.py)."""
        layers = list(self.layers)
        if not layers:
            raise NotFusable("the model has no layers")
        eps = layers[0].input_norm.eps
        norms = [(layer.input_norm, layer.post_attention_norm, layer.q_norm, layer.k_norm) for layer in layers]
        if any(norm is not None and norm.eps != eps for four in norms for norm in four):
            raise NotFusable("its norms do not all have one eps (the fused kernel uses one)")
        first = layers[0]
        return FusedRecipe(
            layers=tuple(
                FusedLayer(
                    attn_norm=layer.input_norm.weight,
                    ffn_norm=layer.post_attention_norm.weight,
                    qkv=layer.qkv_proj,
                    o=layer.o_proj,
                    gate_up=layer.gate_up_proj,
                    down=layer.down_proj,
                    q_norm=layer.q_norm.weight if layer.q_norm is not None else None,
                    k_norm=layer.k_norm.weight if layer.k_norm is not None else None,
                )
                for layer in layers
            ),
            rotaries=(self.rotary,),
            embed=self.embed_tokens,
            final_norm=self.norm,
            activation="silu",
            eps=eps,
            scale=first.scale,
            num_heads=first.num_heads,
            num_kv_heads=first.num_kv_heads,
            head_dim=first.head_dim,
            intermediate=first.intermediate,
            tail=GreedyTail(self.embed_tokens, None, self.norm.weight, self.norm.eps, self.lm_head),
        )

    def load_weights(self, state: dict[str, torch.Tensor | BlockWeight]) -> None:
        """Fill the model from HF-named tensors; GGUF blocks (BlockWeight) replace the layers they fill."""
        state = dict(state)
        load_embeddings_and_head(self, state, tied_by_default=False)
        assign(self.norm.weight, take(state, "model.norm.weight"), "model.norm.weight")
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."

            def biases(names: list[str], prefix: str = p) -> torch.Tensor:
                return torch.cat([take(state, f"{prefix}{n}.bias") for n in names])

            qkv = self._take_qkv(state, p)
            qkv_bias = biases([f"self_attn.{n}_proj" for n in "qkv"]) if layer.qkv_proj.bias is not None else None
            load_linear(layer, "qkv_proj", qkv, qkv_bias, f"{p}self_attn.qkv")
            o_bias = biases(["self_attn.o_proj"]) if layer.o_proj.bias is not None else None
            load_linear(layer, "o_proj", take(state, f"{p}self_attn.o_proj.weight"), o_bias, f"{p}self_attn.o_proj")
            gate_up = self._take_gate_up(state, p)
            has_mlp_bias = layer.gate_up_proj.bias is not None
            gate_up_bias = biases(["mlp.gate_proj", "mlp.up_proj"]) if has_mlp_bias else None
            load_linear(layer, "gate_up_proj", gate_up, gate_up_bias, f"{p}mlp.gate_up")
            down_bias = biases(["mlp.down_proj"]) if has_mlp_bias else None
            load_linear(layer, "down_proj", take(state, f"{p}mlp.down_proj.weight"), down_bias, f"{p}mlp.down_proj")
            if layer.q_norm is not None:
                assign(layer.q_norm.weight, take(state, f"{p}self_attn.q_norm.weight"), f"{p}self_attn.q_norm")
                assign(layer.k_norm.weight, take(state, f"{p}self_attn.k_norm.weight"), f"{p}self_attn.k_norm")
            assign(layer.input_norm.weight, take(state, f"{p}input_layernorm.weight"), f"{p}input_layernorm")
            assign(
                layer.post_attention_norm.weight,
                take(state, f"{p}post_attention_layernorm.weight"),
                f"{p}post_attention_layernorm",
            )
        leftovers = [k for k in state if "rotary_emb" not in k]
        if leftovers:
            raise ValueError(f"unexpected weights in checkpoint: {leftovers[:5]}")
        self.rotary = RotaryEmbedding(
            self.config.hf_config,
            self.config.head_dim,
            self.norm.weight.device,
            self.config.rope_freq_factors,
            rotary_dim=self._rotary_dim(),
        )

    # Hooks for architectures that lay out the same layers differently (Phi-3: engine/models/phi3.py).

    def _take_qkv(
        self, state: dict[str, torch.Tensor | BlockWeight], prefix: str
    ) -> torch.Tensor | BlockWeight | BlockParts:
        """One layer's fused q/k/v weight [q_size + 2 * kv_size, hidden], taken out of `state`."""
        return cat_rows([take(state, f"{prefix}self_attn.{n}_proj.weight") for n in "qkv"])

    def _take_gate_up(
        self, state: dict[str, torch.Tensor | BlockWeight], prefix: str
    ) -> torch.Tensor | BlockWeight | BlockParts:
        """One layer's fused gate/up weight [2 * intermediate, hidden] (gate rows first), taken out of `state`."""
        return cat_rows([take(state, f"{prefix}mlp.{n}_proj.weight") for n in ("gate", "up")])

    def _rotary_dim(self) -> int:
        """How many leading dims of each query/key head RoPE rotates (the whole head)."""
        return self.config.head_dim


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: the LLaMA layers with q/k/v biases and none on o."""

    qkv_bias_always = True
