"""Which code runs a model's decode-only steps, chosen once when the runner starts.

FUSED_NATIVE: every layer of the step in one native call (engine/models/fused_decode.py),
for the architectures whose registry entry has fused_decode, with int8 or GGUF-block linear
layers in float32 on CPU where the kernel loads.
TORCH_LAYERS: the model's own torch layers. Prefill and mixed steps always run those;
on float32 CPU tensors they call the native per-op kernels (RMSNorm, decode attention,
int8 products) where they load, and torch ops otherwise.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
from torch import nn

from engine.core.kv_layout import KVLayout
from engine.models import fused_decode, registry
from engine.models.llama import RMSNorm
from engine.ops import decode_attention, rms_norm
from engine.quantization import native_linear_ops


class DecodePath(enum.Enum):
    FUSED_NATIVE = "fused native decode"
    TORCH_LAYERS = "torch layers"


@dataclass(frozen=True)
class DecodePlan:
    """The runner's decode path, why it was chosen, and the per-op kernels its torch layers call."""

    path: DecodePath
    reason: str
    native_ops: tuple[str, ...]  # empty when the torch layers run torch ops only

    def describe(self) -> str:
        ops = "native " + ", ".join(self.native_ops) if self.native_ops else "torch ops only"
        return f"decode path: {self.path.value} ({self.reason}); the torch layers use {ops}"


def native_ops(model: nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[str, ...]:
    """The engine/ops kernels that `model`'s torch layers call natively: float32 CPU models only (their
    caches in any format)."""
    cache = kv_caches[0][0]
    weight = next(model.parameters(), None)
    if cache.device.type != "cpu" or weight is None or weight.dtype != torch.float32:
        return ()
    modules = list(model.modules())
    used = {
        "rms_norm": rms_norm.available() and any(isinstance(m, RMSNorm) for m in modules),
        "decode_attention": decode_attention.available(),
    }
    return tuple(name for name, is_used in used.items() if is_used) + native_linear_ops(model)


def choose_decode_path(
    model: nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], layout: KVLayout
) -> DecodePlan:
    """The fused path where `model` and its caches allow it and the kernel loads, else the torch layers.

    `model` is a registered decoder: its `config` is the ModelConfig it was built from. Only an
    architecture whose registry entry has fused_decode may take the fused path, whatever its class.
    """
    ops = native_ops(model, kv_caches)
    entry = registry.lookup(model.config.architecture)
    if not entry.fused_decode:
        return DecodePlan(DecodePath.TORCH_LAYERS, f"{entry.name} has no fused decode kernel", ops)
    reason = fused_decode.unsupported_reason(model, kv_caches)
    if reason is not None:
        return DecodePlan(DecodePath.TORCH_LAYERS, reason, ops)
    groups = f", {layout.num_groups} attention groups" if layout.num_groups > 1 else ""
    return DecodePlan(DecodePath.FUSED_NATIVE, f"a quantized float32 {entry.name} on CPU{groups}", ops)
