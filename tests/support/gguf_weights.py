"""Random weights in GGUF blocks, for the kernel tests: quantized by the `gguf` package (the format llama.cpp
writes), or random blocks of the types it cannot write (K-quants, IQ4)."""

from __future__ import annotations

import gguf
import numpy as np
import torch

from engine.bench.random_gguf import RANDOM_BLOCK_TYPES, random_blocks
from engine.ops.gguf_linear import BlockWeight


def block_weight(qtype: str, out_features: int, in_features: int, seed: int = 0) -> tuple[BlockWeight, torch.Tensor]:
    """A [out_features, in_features] weight in `qtype` blocks, and its values as the `gguf` package decodes them."""
    kind = gguf.GGMLQuantizationType[qtype]
    if qtype in RANDOM_BLOCK_TYPES:
        raw = random_blocks(np.random.default_rng(seed), qtype, out_features, in_features, 1.0)
    else:
        generator = torch.Generator().manual_seed(seed)
        raw = gguf.quants.quantize(torch.randn(out_features, in_features, generator=generator).numpy(), kind)
    decoded = torch.from_numpy(gguf.quants.dequantize(raw, kind).copy())
    return BlockWeight(qtype, torch.from_numpy(raw.copy()), in_features), decoded
