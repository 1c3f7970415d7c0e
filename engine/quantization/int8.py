"""int8: weight-only int8 linear layers (CPU, float32), put in place of every nn.Linear after load.

Each weight [N, K] is rounded to int8 with one float32 scale per output channel; the products run in
engine/ops/int8_linear.py (the AVX2 kernel for decode-sized batches, float32 BLAS on the same numbers
above it). Embeddings and norms stay float.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from engine.ops import int8_linear
from engine.quantization.method import INT8_PER_CHANNEL, KernelWeight, QuantizationMethod


class Int8Linear(nn.Module):
    """Drop-in for a float32 CPU nn.Linear whose weight is rounded to int8.

    Keeps the int8 weight for the kernel and its dequantized float32 copy for
    large batches (see engine/ops/int8_linear.py).
    """

    native_op: ClassVar[str] = "int8_linear"  # the engine/ops kernel its decode-sized products run in

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        if linear.weight.device.type != "cpu":
            raise ValueError("int8 linear layers run on CPU only")
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        quantized, scale = int8_linear.quantize_int8(linear.weight)
        self.register_buffer("quantized", quantized)
        self.register_buffer("scale", scale)
        self.register_buffer("dequantized", int8_linear.dequantize_int8(quantized, scale))
        bias = linear.bias.detach().float().contiguous() if linear.bias is not None else None
        self.register_buffer("bias", bias)

    @staticmethod
    def has_native_op() -> bool:
        """Whether `native_op` runs natively on this machine."""
        return int8_linear.available()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        leading = x.shape[:-1]
        flat = x.reshape(-1, self.in_features).float()
        out = int8_linear.int8_linear_forward(flat, self.quantized, self.scale, self.dequantized, self.bias)
        return out.view(*leading, self.out_features)

    def kernel_weight(self) -> KernelWeight:
        bias = self.bias.data_ptr() if self.bias is not None else None
        return KernelWeight(INT8_PER_CHANNEL, self.quantized.data_ptr(), self.scale.data_ptr(), bias, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per channel"


def quantize_linears(model: nn.Module) -> int:
    """Replace every nn.Linear in `model` by an Int8Linear, in place; returns how many."""
    count = 0
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            setattr(model, name, Int8Linear(child))
            count += 1
        else:
            count += quantize_linears(child)
    return count


def quantize_model(model: nn.Module) -> str:
    """Every nn.Linear left in the loaded model becomes int8; a line for the load log."""
    return f"int8 {quantize_linears(model)} linear layers"


METHOD = QuantizationMethod(
    name="int8",
    keeps_gguf_blocks=False,
    needs_gguf_file=False,
    layer=Int8Linear,
    quantize_model=quantize_model,
)
