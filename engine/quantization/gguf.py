"""gguf: a .gguf file's matrices of a type with a block kernel (Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K /
Q6_K / IQ4_NL / IQ4_XS) stay in the file's own blocks (CPU, float32).

The checkpoint loader keeps those matrices as BlockWeight (engine/models/weights.py), and the model's
load_weights puts a GgufLinear (or GgufEmbedding) in place of each layer they fill (`linear_over_blocks`,
`embedding_over_blocks`). After load, every nn.Linear left (a type with no block kernel, or a fused
projection whose parts differ in type) becomes int8. The products and row lookups run in
engine/ops/gguf_linear.py.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import ClassVar

import torch
from torch import nn

from engine.errors import ModelLoadError
from engine.ops import gguf_linear
from engine.ops.gguf_linear import BlockParts, BlockWeight, PackedWeight, dequantize_rows, pack
from engine.quantization import int8
from engine.quantization.int8 import Int8Linear
from engine.quantization.method import KernelWeight, QuantizationMethod


class _BlockBuffers(nn.Module):
    """What GgufLinear and GgufEmbedding hold: a PackedWeight's blocks as a buffer, with its type."""

    def __init__(self, weight: PackedWeight) -> None:
        super().__init__()
        self.qtype = weight.qtype
        self.kernel_type = weight.kernel_type
        self.in_features = weight.in_features
        self.out_features = weight.out_features
        self.register_buffer("blocks", weight.blocks)

    @property
    def packed(self) -> PackedWeight:
        return PackedWeight(self.qtype, self.blocks, self.in_features, self.kernel_type, self.out_features)


class GgufLinear(_BlockBuffers):
    """Drop-in for nn.Linear over a weight kept as GGUF blocks (CPU, float32 activations)."""

    native_op: ClassVar[str] = "gguf_linear"  # the engine/ops kernel its decode-sized products run in

    def __init__(self, weight: PackedWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__(weight)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        # The dtype of products over more rows than the integer kernel takes; set once at load
        # (engine.quantization.apply_prefill_dtype).
        self.prefill_dtype = torch.float32

    @staticmethod
    def has_native_op() -> bool:
        """Whether `native_op` runs natively on this machine."""
        return gguf_linear.available()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        leading = x.shape[:-1]
        flat = x.reshape(-1, self.in_features).float()
        out = gguf_linear.gguf_linear_forward(flat, self.packed, self.bias, self.prefill_dtype)
        return out.view(*leading, self.out_features)

    def kernel_weight(self) -> KernelWeight:
        bias = self.bias.data_ptr() if self.bias is not None else None
        return KernelWeight(self.kernel_type, self.blocks.data_ptr(), None, bias, self.out_features)

    def extra_repr(self) -> str:
        dtype = str(self.prefill_dtype).removeprefix("torch.")
        prefill = "" if self.prefill_dtype == torch.float32 else f", prefill in {dtype}"
        return f"in_features={self.in_features}, out_features={self.out_features}, GGUF {self.qtype} blocks{prefill}"


class GgufEmbedding(_BlockBuffers):
    """Drop-in for nn.Embedding over a table kept as GGUF blocks: looked-up rows are dequantized."""

    def __init__(self, weight: PackedWeight) -> None:
        super().__init__(weight)
        self.num_embeddings, self.embedding_dim = weight.out_features, weight.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise IndexError(f"token id out of range for a vocabulary of {self.num_embeddings}")
        return dequantize_rows(self.packed, rows=flat).view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, GGUF {self.qtype} blocks"


class GgufPartsLinear(nn.Module):
    """Drop-in for nn.Linear over a fused projection whose parts are GGUF blocks of different types: each
    part a GgufLinear, the outputs side by side (the fused kernel reads the parts one after the other)."""

    def __init__(self, parts: list[GgufLinear]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(part.out_features for part in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)

    def kernel_weight(self) -> KernelWeight:
        following = None
        for part in reversed(self.parts):
            following = dataclasses.replace(part.kernel_weight(), next=following)
        return following

    def extra_repr(self) -> str:
        kinds = " + ".join(part.qtype for part in self.parts)
        return f"in_features={self.in_features}, out_features={self.out_features}, GGUF {kinds} blocks"


def is_blocks(weight: object) -> bool:
    """Whether a loaded weight is GGUF blocks (as the file stores them, or packed for the kernel, or a fused
    projection's parts in blocks of their own types)."""
    return isinstance(weight, BlockWeight | PackedWeight | BlockParts)


def linear_over_blocks(
    linear: nn.Linear, weight: BlockWeight | BlockParts | PackedWeight, bias: torch.Tensor | None, label: str
) -> GgufLinear | GgufPartsLinear:
    """The layer that takes `linear`'s place (a PackedWeight is shared as is: a tied output layer reads the
    embedding table's blocks; BlockParts become one GgufLinear per part, each with its slice of the bias)."""
    shape = (weight.out_features, weight.in_features)
    if tuple(linear.weight.shape) != shape:
        raise ModelLoadError(f"weight {label!r} has shape {shape}, expected {tuple(linear.weight.shape)}")
    if isinstance(weight, BlockParts):
        sizes = [part.out_features for part in weight.parts]
        biases = bias.split(sizes) if bias is not None else [None] * len(sizes)
        return GgufPartsLinear([GgufLinear(pack(part), b) for part, b in zip(weight.parts, biases, strict=True)])
    return GgufLinear(weight if isinstance(weight, PackedWeight) else pack(weight), bias)


def embedding_over_blocks(embedding: nn.Embedding, weight: BlockWeight, label: str) -> GgufEmbedding:
    """The GgufEmbedding that takes `embedding`'s place."""
    if weight.shape != tuple(embedding.weight.shape):
        raise ModelLoadError(f"weight {label!r} has shape {weight.shape}")
    return GgufEmbedding(pack(weight))


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:.1f} MiB"


def quantize_model(model: nn.Module) -> str:
    """The layers the file's blocks filled are GGUF layers already; every nn.Linear left becomes int8.
    Returns the load log's line: the block types kept, with their layers and bytes (a table shared by the
    embedding and a tied output layer counted once), and the int8 layers with theirs."""
    layers: Counter[str] = Counter()
    held: dict[int, tuple[str, int]] = {}  # blocks' data pointer -> (type, bytes)
    for module in model.modules():
        if isinstance(module, GgufLinear | GgufEmbedding):
            layers[module.qtype] += 1
            held[module.blocks.data_ptr()] = (module.qtype, module.blocks.nbytes)
    type_bytes: Counter[str] = Counter()
    for qtype, num_bytes in held.values():
        type_bytes[qtype] += num_bytes
    kept = ", ".join(f"{t} {layers[t]} layers {_mib(type_bytes[t])}" for t in sorted(layers)) or "none"
    count = int8.quantize_linears(model)
    int8_layers = [m for m in model.modules() if isinstance(m, Int8Linear)]
    int8_bytes = sum(b.nbytes for m in int8_layers for b in m.buffers())
    left = f"int8 {count} linear layers {_mib(int8_bytes)} (with float32 copies for prefill)" if count else "int8 none"
    return f"GGUF blocks {kept}; {left}"


METHOD = QuantizationMethod(
    name="gguf",
    keeps_gguf_blocks=True,
    needs_gguf_file=True,
    layer=GgufLinear,
    quantize_model=quantize_model,
)
