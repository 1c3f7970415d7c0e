"""The native RMSNorm kernel against torch.rms_norm (the reference), and the per-tensor dispatch."""

from __future__ import annotations

import pytest
import torch

from engine.ops.rms_norm import available, rms_norm, rms_norm_native, rms_norm_torch
from tests.support.native_kernels import KERNELS_EXPECTED, needs_kernels

IMPLEMENTATIONS = [
    pytest.param(rms_norm, id="dispatch"),
    pytest.param(rms_norm_torch, id="torch"),
    pytest.param(rms_norm_native, id="native", marks=needs_kernels),
]


def test_kernel_builds_where_it_should():
    assert available() == KERNELS_EXPECTED


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("shape", [(1, 576), (7, 64), (3, 5, 33), (512, 576)])
def test_matches_torch(shape, implementation):
    torch.manual_seed(sum(shape))
    x = torch.randn(shape) * 5
    weight = torch.randn(shape[-1])
    expected = torch.rms_norm(x.double(), weight.shape, weight.double(), 1e-5)
    got = implementation(x, weight, 1e-5)
    assert got.shape == x.shape and got.dtype == torch.float32
    assert (got.double() - expected).abs().max() <= 1e-6 * expected.abs().max()


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_non_contiguous_input_and_zero_rows(implementation):
    x = torch.randn(6, 40)[:, ::2]
    x[2] = 0
    weight = torch.ones(20)
    got = implementation(x, weight, 1e-6)
    assert torch.allclose(got, torch.rms_norm(x, weight.shape, weight, 1e-6), atol=1e-6)
    assert (got[2] == 0).all()


def test_other_dtypes_use_torch():
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    weight = torch.ones(16, dtype=torch.bfloat16)
    assert torch.equal(rms_norm(x, weight, 1e-6), torch.rms_norm(x, weight.shape, weight, 1e-6))


@needs_kernels
def test_float32_cpu_tensors_dispatch_to_the_kernel(monkeypatch):
    calls = []
    monkeypatch.setattr("engine.ops.rms_norm.rms_norm_native", lambda *args: calls.append(args) or args[0])
    x = torch.randn(3, 8)
    assert rms_norm(x, torch.ones(8), 1e-6) is x and len(calls) == 1
