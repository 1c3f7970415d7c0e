"""The native SiLU-times-up kernel (engine/ops/silu.c, which the fused decode step runs) against float64 math
rounded as the kernel promises, and against torch's F.silu."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine.ops.loader import I64, PTR, bind
from tests.support.native_kernels import needs_kernels

pytestmark = needs_kernels


def silu_times(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    kernel = bind("silu", "kv_silu_times", [PTR, PTR, PTR, I64], None)
    out = torch.empty_like(gate)
    kernel(gate.data_ptr(), up.data_ptr(), out.data_ptr(), gate.numel())
    return out


def rounded_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """e^-g in float64 rounded once to float32, then the float32 add, division and product."""
    g = gate.numpy()
    with np.errstate(over="ignore", invalid="ignore"):
        e = np.exp(-g.astype(np.float64)).astype(np.float32)
        return torch.from_numpy(g / (np.float32(1) + e) * up.numpy())


@pytest.mark.parametrize("n", [1, 7, 8, 13, 5632])
def test_equals_the_correctly_rounded_form_bit_for_bit(n):
    generator = torch.Generator().manual_seed(n)
    gate = torch.randn(n, generator=generator) * 6
    up = torch.randn(n, generator=generator)
    assert torch.equal(silu_times(gate, up), rounded_reference(gate, up))


def test_extremes():
    # past float's exponent range both ways, the edges of the clamp, zeros, and values whose e^-g is subnormal
    gate = torch.tensor([0.0, -0.0, 88.0, 89.0, 95.0, 103.5, 110.0, -88.7, -89.0, -100.0, -200.0, 1e-30, -1e-30, 3e38])
    up = torch.ones_like(gate)
    got, expected = silu_times(gate, up), rounded_reference(gate, up)
    assert torch.equal(got, expected), (got, expected)
    assert got[6] == 110.0 and got[9] == 0.0  # e^-110 rounds to 0; e^100 to infinity


def test_close_to_torch_silu():
    gate = torch.linspace(-30, 30, 100_003)
    up = torch.rand(100_003) + 0.5
    got, torch_value = silu_times(gate, up), F.silu(gate) * up
    assert torch.allclose(got, torch_value, rtol=4e-7, atol=1e-30)
    assert (got == torch_value).float().mean() > 0.9  # the same float32 numbers for most gates
