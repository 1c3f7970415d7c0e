"""What every quantization method declares (QuantizationMethod), and what its layers show the fused kernel.

A method's module (none.py, int8.py, gguf.py) builds one QuantizationMethod; engine/quantization/__init__.py
lists them. A quantized linear layer offers `kernel_weight()`, so that the fused decode step
(engine/models/fused_decode.py) reads any layer it supports without knowing its class.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

# KernelWeight.block_type of an int8 weight with one scale per output channel; any other value is the
# GGML type id of GGUF blocks (fused_decode.c `Int8Weight.block_type`).
INT8_PER_CHANNEL = 0


@dataclass(frozen=True)
class KernelWeight:
    """One linear layer as the fused decode kernel reads it: raw data pointers, valid while the layer lives."""

    block_type: int  # INT8_PER_CHANNEL, or the GGUF kernel type (engine/ops/gguf_linear.py PackedWeight)
    weight: int  # int8 [out_features, in_features], or the GGUF blocks [out_features, row_bytes]
    scale: int | None  # float32 [out_features] for int8; None for blocks (their scales are inside)
    bias: int | None  # float32 [out_features]; None: no bias
    out_features: int
    next: KernelWeight | None = None  # the projection's next rows, in a type of their own (their outputs follow)


def kernel_weight(linear: nn.Module) -> KernelWeight | None:
    """What the fused decode kernel reads of `linear`, or None when it cannot read it: a float nn.Linear
    (the kernel multiplies only quantized weights) or any layer without `kernel_weight()`."""
    read = getattr(linear, "kernel_weight", None)
    return read() if callable(read) else None


@dataclass(frozen=True)
class QuantizationMethod:
    """One value of `--quantization` other than auto: how the weights load and which layers replace nn.Linear
    (engine/config.py lists the values, and which of them run on CPU in float32 only).

    keeps_gguf_blocks: the checkpoint loader keeps a GGUF file's matrices in the file's blocks
        (engine/ops/gguf_linear.py BlockWeight), and the model's load_weights puts this method's layers
        in place of the nn.Linear / nn.Embedding they fill.
    needs_gguf_file: only a .gguf checkpoint can use it.
    layer: the layer this method puts in place of nn.Linear (None: nn.Linear stays).
    quantize_model: called once the weights are loaded; replaces the nn.Linear layers that are left, in
        place, and returns a line for the load log (None when it changed nothing).
    """

    name: str
    keeps_gguf_blocks: bool
    needs_gguf_file: bool
    layer: type[nn.Module] | None
    quantize_model: Callable[[nn.Module], str | None]
