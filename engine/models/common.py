"""Pieces shared by the decoder families: weight handling and RoPE."""

from __future__ import annotations

import torch

from engine.errors import ModelLoadError
from engine.ops.gguf_linear import BlockWeight, PackedWeight, cat_weights
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


def cat_rows(parts: list[torch.Tensor | BlockWeight]) -> torch.Tensor | BlockWeight:
    """Weights stacked by rows into one fused projection: still blocks when every part has the
    same block type, else float (the blocks dequantized)."""
    if all(isinstance(p, BlockWeight) for p in parts):
        fused = cat_weights(parts)
        if fused is not None:
            return fused
    return torch.cat([p.dequantize() if isinstance(p, BlockWeight) else p for p in parts])


def load_linear(
    owner: torch.nn.Module,
    name: str,
    weight: torch.Tensor | BlockWeight | PackedWeight,
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


class RotaryEmbedding:
    """cos/sin for arbitrary positions (no table, so positions may exceed the trained context).

    Uses transformers' own RoPE parameter functions for the scaling types
    (linear, llama3, yarn), so scaled configs match the reference exactly. A GGUF file
    carries a Llama 3 scaling as per-frequency divisors instead (freq_factors).
    """

    def __init__(
        self, hf_config, head_dim: int, device: torch.device, freq_factors: tuple[float, ...] | None = None
    ) -> None:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        params = getattr(hf_config, "rope_parameters", None) or {}
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
            inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            self.attention_scaling = 1.0
        elif rope_type in ("dynamic", "longrope"):
            raise ModelLoadError(f"rope scaling type {rope_type!r} is not supported yet")
        else:
            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
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

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, 1, head_dim] (broadcast over heads)."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.attention_scaling).to(dtype).unsqueeze(1)
        sin = (emb.sin() * self.attention_scaling).to(dtype).unsqueeze(1)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated (the non-interleaved "rotate half" convention of HF LLaMA)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
