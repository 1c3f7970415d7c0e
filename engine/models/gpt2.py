"""GPT-2 (GPT2LMHeadModel): learned positions, pre-LayerNorm, GELU (tanh), Conv1D weights.

HF's Conv1D stores weights as [in, out]; we transpose once at load into
nn.Linear's [out, in]. Activations are flat: [T, ...].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.metadata import AttentionMetadata
from engine.attention.paged import paged_attention, write_kv
from engine.config import ModelConfig
from engine.models.common import assign, take

_ACTIVATIONS = {
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "relu": F.relu,
}


class GPT2Layer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hf = config.hf_config
        hidden = config.hidden_size
        inner = hf.n_inner or 4 * hidden
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.ln_1 = nn.LayerNorm(hidden, eps=hf.layer_norm_epsilon)
        self.c_attn = nn.Linear(hidden, 3 * hidden)
        self.c_proj = nn.Linear(hidden, hidden)
        self.ln_2 = nn.LayerNorm(hidden, eps=hf.layer_norm_epsilon)
        self.c_fc = nn.Linear(hidden, inner)
        self.mlp_proj = nn.Linear(inner, hidden)
        if hf.activation_function not in _ACTIVATIONS:
            raise ValueError(f"GPT-2 activation {hf.activation_function!r} is not supported")
        self.act = _ACTIVATIONS[hf.activation_function]
        self.scale = self.head_dim**-0.5 if hf.scale_attn_weights else 1.0

    def forward(self, hidden: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata):
        num_tokens = hidden.shape[0]
        q, k, v = self.c_attn(self.ln_1(hidden)).view(num_tokens, 3, self.num_heads, self.head_dim).unbind(1)
        key_cache, value_cache = kv_cache
        write_kv(key_cache, value_cache, k, v, meta.slot_mapping)
        attn = paged_attention(q, key_cache, value_cache, meta, self.scale)
        hidden = hidden + self.c_proj(attn.reshape(num_tokens, -1))
        return hidden + self.mlp_proj(self.act(self.c_fc(self.ln_2(hidden))))


class GPT2LMHeadModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hf = config.hf_config
        if hf.scale_attn_by_inverse_layer_idx or hf.reorder_and_upcast_attn:
            raise ValueError(
                "GPT-2 variants with scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn are not supported"
            )
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.layers = nn.ModuleList([GPT2Layer(config) for _ in range(config.num_layers)])
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=hf.layer_norm_epsilon)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, positions, kv_caches, metas: list[AttentionMetadata]) -> torch.Tensor:
        hidden = self.wte(input_ids) + self.wpe(positions)
        for layer, kv_cache, meta in zip(self.layers, kv_caches, metas, strict=True):
            hidden = layer(hidden, kv_cache, meta)
        return self.ln_f(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        state = {k.removeprefix("transformer."): v for k, v in state.items()}
        assign(self.wte.weight, take(state, "wte.weight"), "wte.weight")
        assign(self.wpe.weight, take(state, "wpe.weight"), "wpe.weight")
        lm_head = state.pop("lm_head.weight", None)
        tied = getattr(self.config.hf_config, "tie_word_embeddings", True) or lm_head is None
        assign(self.lm_head.weight, self.wte.weight if tied else lm_head, "lm_head.weight")
        for name in ("weight", "bias"):
            assign(getattr(self.ln_f, name), take(state, f"ln_f.{name}"), f"ln_f.{name}")
        for i, layer in enumerate(self.layers):
            p = f"h.{i}."
            for ours, theirs in (
                ("c_attn", "attn.c_attn"),
                ("c_proj", "attn.c_proj"),
                ("c_fc", "mlp.c_fc"),
                ("mlp_proj", "mlp.c_proj"),
            ):
                linear = getattr(layer, ours)
                assign(linear.weight, take(state, f"{p}{theirs}.weight").t(), f"{p}{theirs}.weight")
                assign(linear.bias, take(state, f"{p}{theirs}.bias"), f"{p}{theirs}.bias")
            for ln in ("ln_1", "ln_2"):
                for name in ("weight", "bias"):
                    assign(getattr(getattr(layer, ln), name), take(state, f"{p}{ln}.{name}"), f"{p}{ln}.{name}")
        leftovers = [k for k in state if not k.endswith(".attn.bias") and not k.endswith(".attn.masked_bias")]
        if leftovers:
            raise ValueError(f"unexpected weights in checkpoint: {leftovers[:5]}")
