"""The native RMSNorm kernel against torch.rms_norm (the reference)."""

from __future__ import annotations

import pytest
import torch

from engine.ops.rms_norm import rms_norm, rms_norm_kernel
from tests.support.native_kernels import KERNELS_EXPECTED


def test_kernel_builds_where_it_should():
    assert (rms_norm_kernel() is not None) == KERNELS_EXPECTED


@pytest.mark.parametrize("shape", [(1, 576), (7, 64), (3, 5, 33), (512, 576)])
def test_matches_torch(shape):
    torch.manual_seed(sum(shape))
    x = torch.randn(shape) * 5
    weight = torch.randn(shape[-1])
    expected = torch.rms_norm(x.double(), weight.shape, weight.double(), 1e-5)
    got = rms_norm(x, weight, 1e-5)
    assert got.shape == x.shape and got.dtype == torch.float32
    assert (got.double() - expected).abs().max() <= 1e-6 * expected.abs().max()


def test_non_contiguous_input_and_zero_rows():
    x = torch.randn(6, 40)[:, ::2]
    x[2] = 0
    weight = torch.ones(20)
    got = rms_norm(x, weight, 1e-6)
    assert torch.allclose(got, torch.rms_norm(x, weight.shape, weight, 1e-6), atol=1e-6)
    assert (got[2] == 0).all()


def test_other_dtypes_use_torch():
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    weight = torch.ones(16, dtype=torch.bfloat16)
    assert torch.equal(rms_norm(x, weight, 1e-6), torch.rms_norm(x, weight.shape, weight, 1e-6))
