"""The weight-only int8 product for fast CPU decoding: the AVX2 kernel, its torch path and the reference.

Each nn.Linear's weight [N, K] is rounded to int8 with one symmetric float32
scale per output channel (w ~= q * scale[n], q in -127..127); activations stay
float32. Decode-sized products (M <= MAX_KERNEL_ROWS) run in the AVX2 kernel
`engine/ops/int8_gemm.c` (`int8_linear_native`), which reads a quarter of
float32's weight bytes. Larger ones (prefill) are compute-bound and run in
float32 BLAS on the same numbers (`int8_linear_torch`: the activation rows
rounded to the kernel's int16 grid, times the dequantized int8 weight), so a
row gets the same result, to float32 rounding, whichever path its batch took:
sampling stays batch-invariant. The price is memory: float32 + int8 weights.
`int8_linear_reference` is the plain definition both are tested against; the
torch path also runs when the kernel cannot be built. `int8_linear_forward`
picks the path; the layer that holds the weights is engine/quantization/int8.py.

Accuracy (docs/engine/kernels.md, tests/unit/test_quantization.py): weight rounding is at most
scale/2 per weight; the kernel also rounds each activation row to int16 with
its own scale, which keeps rows independent of each other and adds an error of
at most max|x_m| / 65534 per element.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from engine.ops.loader import I64, PTR, bind

# Up to this many rows the kernel beats float32 BLAS (it reads 4x fewer weight
# bytes); above it the product is compute-bound and BLAS wins. Measured by the
# int8 table of `python -m engine.bench.bench_engine`.
MAX_KERNEL_ROWS = 48


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (int8 [N, K], float32 scale [N]); an all-zero row gets scale 1."""
    weight = weight.detach().float()
    amax = weight.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    quantized = torch.round(weight / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return quantized.contiguous(), scale.contiguous()


def dequantize_int8(quantized: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return quantized.float() * scale[:, None]


def int8_linear_reference(
    x: torch.Tensor, quantized: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [..., K] -> [..., N]: the product with the dequantized weight, in x's precision."""
    return F.linear(x, dequantize_int8(quantized, scale).to(x.dtype), None if bias is None else bias.to(x.dtype))


@functools.cache
def _kernel():
    """kv_int8_gemm(x, rows, inner, quantized, scale, bias, out, out_features, threads) -> status, or None."""
    argtypes = [PTR, I64, I64, PTR, PTR, PTR, PTR, I64, ctypes.c_int]
    return bind("int8_gemm", "kv_int8_gemm", argtypes, ctypes.c_int)


@functools.cache
def _round_rows_kernel():
    """kv_round_rows_int16(x, out, rows, cols, threads), or None when the library cannot be used."""
    return bind("int8_gemm", "kv_round_rows_int16", [PTR, PTR, I64, I64, ctypes.c_int], None)


def available() -> bool:
    """Whether int8_linear_native can run on this machine."""
    return _kernel() is not None


def round_rows_int16(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 -> each row rounded to the kernel's int16 grid (q * scale, scale = max|row| / 32767)."""
    rounder = _round_rows_kernel()
    if rounder is not None and x.dtype == torch.float32 and x.device.type == "cpu":
        x = x.contiguous()
        out = torch.empty_like(x)
        rounder(x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], torch.get_num_threads())
        return out
    amax = x.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 32767.0, torch.ones_like(amax))
    return torch.round(x * (1.0 / scale)).clamp_(-32767, 32767) * scale


def int8_linear_torch(x: torch.Tensor, dequantized: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The kernel's numbers in float32 BLAS: x [M, K] rounded like the kernel, dequantized weight [N, K]."""
    return F.linear(round_rows_int16(x), dequantized, bias)


def int8_linear_native(
    x: torch.Tensor, quantized: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [M, K] float32 on CPU -> [M, N] through the native kernel."""
    x = x.contiguous()
    rows, inner = x.shape
    out_features = quantized.shape[0]
    out = torch.empty(rows, out_features, dtype=torch.float32)
    status = _kernel()(
        x.data_ptr(),
        rows,
        inner,
        quantized.data_ptr(),
        scale.data_ptr(),
        bias.data_ptr() if bias is not None else None,
        out.data_ptr(),
        out_features,
        torch.get_num_threads(),
    )
    if status != 0:
        raise MemoryError("the int8 kernel could not allocate its activation buffer")
    return out


def int8_linear_forward(
    x: torch.Tensor,
    quantized: torch.Tensor,
    scale: torch.Tensor,
    dequantized: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """x [M, K] float32 -> [M, N]: the kernel for decode-sized batches where it loads, float32 BLAS on the
    same numbers otherwise (`dequantized` is dequantize_int8(quantized, scale), kept beside the int8 weight)."""
    if x.shape[0] <= MAX_KERNEL_ROWS and available():
        return int8_linear_native(x, quantized, scale, bias)
    return int8_linear_torch(x, dequantized, bias)
