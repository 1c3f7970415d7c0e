"""none: the weights stay float, in the engine's dtype, on any device; nn.Linear stays."""

from __future__ import annotations

from torch import nn

from engine.quantization.method import QuantizationMethod


def quantize_model(model: nn.Module) -> None:
    """Nothing to replace."""
    return None


METHOD = QuantizationMethod(
    name="none",
    keeps_gguf_blocks=False,
    needs_gguf_file=False,
    layer=None,
    quantize_model=quantize_model,
)
