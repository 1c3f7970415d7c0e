"""Quantization of a generation model's linear layers: the method table, the one place `auto` is decided,
and one module per method.

- none (none.py): weights in the engine's dtype, on any device.
- int8 (int8.py): weight-only int8 linear layers (CPU, float32), put in place of nn.Linear after load.
- gguf (gguf.py): a GGUF file's matrices stay in its own blocks where a kernel exists for their type,
  swapped in while the weights load; the other linear layers become int8 (CPU, float32).
- auto: gguf for a GGUF file on CPU in float32, none otherwise (`resolve`).

`--prefill-dtype` is applied here too (`apply_prefill_dtype`): the dtype of the GGUF layers' large-batch
products, with a warning where the CPU would emulate bfloat16.

Each method is one QuantizationMethod (method.py): how its weights load and which layer replaces
nn.Linear. The names a user may set, and the CPU-float32 rule, are validated with the rest of the
config (engine/config.py QUANTIZATION_MODES, CPU_FLOAT32_QUANTIZATIONS), a layer below this package.
The kernels the layers call live in engine/ops.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from engine.config import QUANTIZATION_MODES, TORCH_DTYPES, EngineConfig
from engine.ops.cpu_features import has_bf16_products
from engine.quantization import gguf, int8, none
from engine.quantization.method import INT8_PER_CHANNEL, KernelWeight, QuantizationMethod, kernel_weight

__all__ = [
    "AUTO",
    "INT8_PER_CHANNEL",
    "METHODS",
    "MODES",
    "KernelWeight",
    "QuantizationMethod",
    "kernel_weight",
    "method",
    "native_linear_ops",
    "resolve",
    "apply_prefill_dtype",
]

# One entry per value of MODES but auto, in that order (tests/unit/test_quantization.py holds them equal).
METHODS: dict[str, QuantizationMethod] = {m.name: m for m in (none.METHOD, int8.METHOD, gguf.METHOD)}
AUTO = "auto"
MODES = QUANTIZATION_MODES
logger = logging.getLogger(__name__)


def method(name: str) -> QuantizationMethod:
    """The method of a resolved mode (any of MODES but auto, which `resolve` decides per checkpoint)."""
    if name == AUTO:
        raise ValueError("quantization auto names no method until resolve() has seen the checkpoint")
    if name not in METHODS:
        raise ValueError(f"quantization method must be one of {tuple(METHODS)}, got {name!r}")
    return METHODS[name]


def resolve(config: EngineConfig, checkpoint: str | Path) -> QuantizationMethod:
    """The method `config.quantization` means for this checkpoint (a .gguf file or a model directory):
    auto becomes gguf for a GGUF file on CPU in float32, none otherwise."""
    is_gguf = Path(checkpoint).suffix == ".gguf"
    if config.quantization == AUTO:
        on_cpu_float32 = config.device == "cpu" and config.dtype == "float32"
        return METHODS["gguf" if on_cpu_float32 and is_gguf else "none"]
    chosen = method(config.quantization)
    if chosen.needs_gguf_file and not is_gguf:
        raise ValueError(f"quantization {chosen.name} needs a .gguf model file, not {checkpoint}")
    return chosen


def apply_prefill_dtype(model: nn.Module, config: EngineConfig) -> str | None:
    """Sets `config.prefill_dtype` as the large-batch product dtype of `model`'s GGUF block layers, once at
    load; returns it, or None when the model has no such layers. bfloat16 on a CPU without AVX-512 BF16 or
    AMX runs (oneDNN emulates it) slower than float32: a warning says so."""
    layers = [m for m in model.modules() if isinstance(m, gguf.GgufLinear)]
    if not layers:
        return None
    dtype = TORCH_DTYPES[config.prefill_dtype]
    if dtype == torch.bfloat16 and config.device == "cpu" and not has_bf16_products():
        logger.warning("prefill dtype bfloat16 on a CPU without AVX-512 BF16 or AMX: slower than float32 here")
    for layer in layers:
        layer.prefill_dtype = dtype
    return config.prefill_dtype


def native_linear_ops(model: nn.Module) -> tuple[str, ...]:
    """The engine/ops kernels that `model`'s quantized linear layers call natively, in METHODS order."""
    modules = list(model.modules())
    layers = [m.layer for m in METHODS.values() if m.layer is not None]
    return tuple(
        layer.native_op
        for layer in layers
        if layer.has_native_op() and any(isinstance(module, layer) for module in modules)
    )
