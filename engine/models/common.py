"""Pieces shared by the decoder families: weight handling and RoPE."""

from __future__ import annotations

import torch

from engine.errors import ModelLoadError
from engine.ops.gguf_linear import BlockParts, BlockWeight, PackedWeight, cat_weights
from engine.quantization import gguf


def take(state: dict[str, torch.Tensor], name: str, *, where: str = "checkpoint") -> torch.Tensor:
    """Pop a required tensor or fail with a message naming it."""
    if name not in state:
        raise ModelLoadError(f"{where}: missing weight {name!r}")
    return state.pop(name)


def assign(param: torch.nn.Parameter | torch.Tensor, value: torch.Tensor, name: str) -> None:
    if tuple(param.shape) != tuple(value.shape):
        raise ModelLoadError(f"weight {name!r} has shape {tuple(value.shape)}, expected {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(value.to(param.dtype))


def cat_rows(parts: list[torch.Tensor | BlockWeight]) -> torch.Tensor | BlockWeight | BlockParts:
    """Weights stacked by rows into one fused projection: one block weight when every part has the same
    block type, the parts each in their own blocks when the types differ, else float (blocks dequantized)."""
    if all(isinstance(p, BlockWeight) for p in parts):
        fused = cat_weights(parts)
        if fused is not None:
            return fused
        if len({p.in_features for p in parts}) == 1:
            return BlockParts(tuple(parts))
    return torch.cat([p.dequantize() if isinstance(p, BlockWeight) else p for p in parts])


def load_linear(
    owner: torch.nn.Module,
    name: str,
    weight: torch.Tensor | BlockWeight | BlockParts | PackedWeight,
    bias: torch.Tensor | None,
    label: str,
) -> None:
    """Fill `owner.<name>` (an nn.Linear) with a float weight, or replace it by the gguf method's layer over
    blocks (a PackedWeight is shared as is: a tied output layer reads the embedding table's blocks)."""
    linear = getattr(owner, name)
    if gguf.is_blocks(weight):
        setattr(owner, name, gguf.linear_over_blocks(linear, weight, bias, label))
        return
    assign(linear.weight, weight, label)
    if bias is not None:
        assign(linear.bias, bias, f"{label}.bias")


def load_embeddings_and_head(model: torch.nn.Module, state: dict, tied_by_default: bool) -> None:
    """Fill `model.embed_tokens` and `model.lm_head` from `state`, popping both weights. The head is the
    embedding table where the config ties them (`tied_by_default` when it does not say) or the checkpoint has
    no head; a table in GGUF blocks stays in them, one copy serving both when tied."""
    embedding = take(state, "model.embed_tokens.weight")
    tied = getattr(model.config.hf_config, "tie_word_embeddings", tied_by_default) or "lm_head.weight" not in state
    lm_head = embedding if tied else take(state, "lm_head.weight")
    state.pop("lm_head.weight", None)
    if gguf.is_blocks(embedding):
        model.embed_tokens = gguf.embedding_over_blocks(model.embed_tokens, embedding, "model.embed_tokens.weight")
        if tied:
            lm_head = model.embed_tokens.packed
    else:
        assign(model.embed_tokens.weight, embedding, "model.embed_tokens.weight")
    load_linear(model, "lm_head", lm_head, None, "lm_head.weight")


class RotaryEmbedding:
    """cos/sin for arbitrary positions (no table, so positions may exceed the trained context).

    Uses transformers' own RoPE parameter functions for the scaling types
    (linear, llama3, yarn, longrope), so scaled configs match the reference exactly. A GGUF file
    carries a Llama 3 scaling as per-frequency divisors instead (freq_factors).

    `rotary_dim` (default: the whole head) is how many leading dims of each head rotate; the rest pass
    through (partial rotary, as Phi-3's partial_rotary_factor sets).

    LongRoPE has two sets of frequencies: the short factors for a context within the pretraining length
    (`original_max_position_embeddings`), the long factors beyond it. transformers picks one set for a
    whole forward pass by its longest position, and recomputes a sequence's keys with the long set once
    it grows past that length. Here the choice is per token: position p uses the short factors when
    p < original_max_position_embeddings and the long ones otherwise. Every key keeps the rotation it
    was cached with, whatever the sequence grows to, and a prefix's KV blocks stay reusable; a sequence
    within the pretraining length computes exactly what transformers does, and the positions past it
    use the long factors transformers uses there (the earlier positions keep the short ones).
    """

    def __init__(
        self,
        hf_config,
        head_dim: int,
        device: torch.device,
        freq_factors: tuple[float, ...] | None = None,
        rotary_dim: int | None = None,
    ) -> None:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        params = getattr(hf_config, "rope_parameters", None) or {}
        rope_type = params.get("rope_type", "default")
        self.long_inv_freq: torch.Tensor | None = None
        self.original_max_positions: int | None = None
        if rope_type == "default":
            base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
            inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
            self.attention_scaling = 1.0
        elif rope_type == "dynamic":
            raise ModelLoadError(f"rope scaling type {rope_type!r} is not supported yet")
        elif rope_type == "longrope":
            init = ROPE_INIT_FUNCTIONS[rope_type]
            original = int(params["original_max_position_embeddings"])
            inv_freq, self.attention_scaling = init(hf_config, torch.device("cpu"))  # the short factors
            long_inv_freq, _ = init(hf_config, torch.device("cpu"), seq_len=original + 1)  # the long factors
            self.long_inv_freq = long_inv_freq.float().to(device)
            self.original_max_positions = original
        else:
            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
        if 2 * inv_freq.shape[0] != rotary_dim:
            raise ModelLoadError(
                f"RoPE ({rope_type}) gives {inv_freq.shape[0]} frequencies; a rotary dim of {rotary_dim} needs "
                f"{rotary_dim // 2}"
            )
        if freq_factors is not None:
            # A GGUF's rope_freqs: the scaled frequencies are the defaults divided by these factors.
            if rope_type != "default":
                raise ModelLoadError(
                    f"the model's config scales RoPE ({rope_type}) and its GGUF file carries rope_freqs too"
                )
            if len(freq_factors) != inv_freq.shape[0]:
                raise ModelLoadError(
                    f"rope_freqs has {len(freq_factors)} factors; head dim {head_dim} needs {inv_freq.shape[0]}"
                )
            inv_freq = inv_freq / torch.tensor(freq_factors, dtype=torch.float)
        self.inv_freq = inv_freq.float().to(device)
        self.rotary_dim = rotary_dim

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, 1, rotary_dim] (broadcast over heads)."""
        inv_freq = self.inv_freq
        if self.long_inv_freq is not None:
            # [T, rotary_dim / 2]: each position's own set (LongRoPE's per-token rule above).
            is_long = (positions >= self.original_max_positions).unsqueeze(-1)
            inv_freq = torch.where(is_long, self.long_inv_freq, self.inv_freq)
        freqs = positions.float().unsqueeze(-1) * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.attention_scaling).to(dtype).unsqueeze(1)
        sin = (emb.sin() * self.attention_scaling).to(dtype).unsqueeze(1)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated (the non-interleaved "rotate half" convention of HF LLaMA).

    cos, sin [T, 1, R]: the first R dims of each head rotate (rotate-half within them) and the other
    D - R pass through unchanged (partial rotary); R == D rotates the whole head."""
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        rotated = apply_rotary(x[..., :rotary_dim], cos, sin)
        return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
