"""Products and row lookups over a GGUF file's own quantized blocks: the AVX2 kernels, the tiled
BLAS path and the torch reference (the layers that hold the blocks are engine/quantization/gguf.py).

A GGUF weight of type Q4_0, Q4_1, Q5_0, Q5_1 or Q8_0 stays in memory exactly as
the file stores it: each row of K weights is K / 32 blocks, one fp16 scale (and for
Q4_1 / Q5_1 an fp16 offset) per 32 weights, so a 4-bit model takes 4.5 or 5 bits per
weight, a 5-bit one 5.5 or 6, and nothing else (no float32 copy). The K-quant types
Q4_K, Q5_K and Q6_K (4.5, 5.5 and 6.5625 bits) hold blocks of 256 weights with 6- or
8-bit scales per sub-block of 32 or 16 (engine/ops/gguf_kquants.c). IQ4_NL (4.5 bits, blocks of 32)
and IQ4_XS (4.25 bits, blocks of 256 with 6-bit scales per 32) hold 4-bit indices into a fixed grid of
16 values (IQ4_VALUES). The model runs the file's numbers, not a re-quantization of them.

At load (`pack`), weights are interleaved in groups of 16 rows (`interleave`: the same bytes and numbers,
arranged so one 512-bit register holds the same 4 weights of 16 rows, or a 256-bit one those of 8;
engine/ops/gguf_interleaved.c): every type on a CPU with AVX-512 VNNI, the 32-weight types on the others
(`interleaved_types`); the rest keep the row kernel's layout: 4-bit blocks repacked in pairs (the same bytes
and numbers, arranged so the kernel unpacks 64 weights with two masks), the others as the file stores them.

Products: each activation row is rounded to blocks of 32 int8 values with one
scale per block (the layout of Q8_0; blocks of 256 for the K-quant types, as
llama.cpp rounds them for each type), then
- decode-sized batches (M <= MAX_KERNEL_ROWS) run integer dot products in the
  AVX2 kernel `engine/ops/gguf_blocks.c` (`gguf_linear_native`), which reads the
  4-bit blocks straight from memory; interleaved weights run every batch in the register-tiled
  kernel (16 or 8 weight rows times up to 8 or 4 activation rows per pass), which keeps up with
  float32 BLAS at large M and runs 2-5x the row kernel at 8-128 rows;
- larger ones (prefill) are compute-bound: the weight is dequantized one tile of
  rows at a time into a small float32 buffer and multiplied in BLAS with the same
  rounded activations (`gguf_linear_tiled`), so a row gets the kernel's numbers,
  to float32 rounding, whichever path its batch took (or in bfloat16, where the CPU multiplies it
  several times faster: `--prefill-dtype`).
`gguf_linear_forward` picks the path. `gguf_linear_reference` is the plain
definition both are tested against: the rounded activations times the
dequantized weight, in torch.

Accuracy (docs/engine/kernels.md, tests/unit/test_gguf_linear.py): the weights are exactly the
file's; activation rounding adds at most d / 2 = max|x over the block| / 254 per
element, as llama.cpp's CPU backend does for these types.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.ops.loader import I64, PTR, avx512_kernels_allowed, bind

# GGML type name -> (type id as in GGUF files, bytes per block, weights per block).
BLOCK_TYPES = {
    "Q4_0": (2, 18, 32),
    "Q4_1": (3, 20, 32),
    "Q5_0": (6, 22, 32),
    "Q5_1": (7, 24, 32),
    "Q8_0": (8, 34, 32),
    "Q4_K": (12, 144, 256),
    "Q5_K": (13, 176, 256),
    "Q6_K": (14, 210, 256),
    "IQ4_NL": (20, 18, 32),
    "IQ4_XS": (23, 136, 256),
}
# The 16 values an IQ4_NL / IQ4_XS weight's 4-bit index picks (times its block's scale): denser near zero.
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
BLOCK = 32
SUPER_BLOCK = 256  # weights per block of the K-quants and IQ4_XS
# The kernel's flag for 4-bit blocks repacked in pairs (gguf_blocks.c KV_PAIRED).
PAIRED = 0x100
# The kernel's flag for blocks interleaved in groups of GROUP_ROWS weight rows for the register-tiled products
# (gguf_interleaved.c KV_INTERLEAVED: 512-bit with AVX-512 VNNI, else 256-bit); the last group is padded with zero
# rows.
INTERLEAVED = 0x200
# With INTERLEAVED: the 256-bit kernel, even where the CPU runs the 512-bit one (gguf_interleaved.c KV_NARROW).
NARROW = 0x400
GROUP_ROWS = 16
# The types with an interleaved layout (every type with a block kernel).
INTERLEAVED_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS")
# Up to this many rows the integer kernel beats dequantize-and-BLAS: on 2 AVX2 cores, an
# [11264, 2048] Q4_0 product took 25 ms in the kernel and 27 ms tiled at 64 rows, 55 and 43 at 128.
MAX_KERNEL_ROWS = 64
# Float32 bytes of one dequantized weight tile in the BLAS path: small enough to stay in cache. On 2 AVX2
# cores an [11264, 2048] Q4_0 product took 174 ms at 512 rows with 4 MiB tiles, 186 with 2 MiB and 195
# for one BLAS call on the whole float32 weight; 46-47 ms at 110 rows with either tile size.
TILE_BYTES = 4 << 20


@dataclass(frozen=True)
class BlockWeight:
    """A [out_features, in_features] weight held as GGUF blocks: uint8 [out_features, row_bytes]."""

    qtype: str
    blocks: torch.Tensor
    in_features: int

    def __post_init__(self) -> None:
        if self.qtype not in BLOCK_TYPES:
            raise ValueError(f"GGUF type {self.qtype} has no block kernel (supported: {', '.join(BLOCK_TYPES)})")
        _, block_bytes, block = BLOCK_TYPES[self.qtype]
        expected = self.in_features // block * block_bytes
        if self.in_features % block or self.blocks.dtype != torch.uint8 or self.blocks.shape[-1] != expected:
            raise ValueError(f"{self.qtype} blocks of shape {tuple(self.blocks.shape)} do not hold {self.in_features}")

    @property
    def out_features(self) -> int:
        return self.blocks.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def type_id(self) -> int:
        return BLOCK_TYPES[self.qtype][0]

    @property
    def activation_block(self) -> int:
        """How many activation values share one rounding scale in this type's products."""
        return BLOCK_TYPES[self.qtype][2]

    def dequantize(self) -> torch.Tensor:
        """float32 [out_features, in_features]."""
        return dequantize_reference(self)


@dataclass(frozen=True)
class BlockParts:
    """A fused projection's weights stacked by rows whose parts keep blocks of different types (a GGUF file's
    Q4_K q and k with a Q6_K v): each part stays in its own type."""

    parts: tuple[BlockWeight, ...]

    @property
    def in_features(self) -> int:
        return self.parts[0].in_features

    @property
    def out_features(self) -> int:
        return sum(part.out_features for part in self.parts)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    def dequantize(self) -> torch.Tensor:
        """float32 [out_features, in_features]."""
        return torch.cat([part.dequantize() for part in self.parts])


def cat_weights(parts: list[BlockWeight]) -> BlockWeight | None:
    """The parts stacked by rows (e.g. q, k and v into one projection), or None when their types differ."""
    if len({(p.qtype, p.in_features) for p in parts}) != 1:
        return None
    return BlockWeight(parts[0].qtype, torch.cat([p.blocks for p in parts]).contiguous(), parts[0].in_features)


def _fp16_field(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """[..., nb, block_bytes] uint8 -> the fp16 stored at `offset` of each block, as float32 [..., nb, 1]."""
    return blocks[..., offset : offset + 2].contiguous().view(torch.float16).float()


def _k_scales_and_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., 12] uint8 -> the 8 six-bit sub-block scales and minimums of Q4_K / Q5_K, as float32 [..., 8, 1]."""
    p = packed.to(torch.int32)
    first, second, low = p[..., 0:4], p[..., 4:8], p[..., 8:12]
    scales = torch.cat([first & 63, (low & 0x0F) | (first >> 6) << 4], dim=-1)
    mins = torch.cat([second & 63, (low >> 4) | (second >> 6) << 4], dim=-1)
    return scales.float().unsqueeze(-1), mins.float().unsqueeze(-1)


def _iq4_values(indices: torch.Tensor) -> torch.Tensor:
    """[..., 16] uint8 indices, weight j in the low nibble of byte j and j + 16 in its high one -> float32
    [..., 32] grid values."""
    q = torch.cat([indices & 0x0F, indices >> 4], dim=-1).long()
    return torch.tensor(IQ4_VALUES, dtype=torch.float32)[q]


def _dequantize_k_reference(qtype: str, blocks: torch.Tensor) -> torch.Tensor:
    """[..., 256-weight blocks, block bytes] uint8 -> float32 [..., blocks, 256]."""
    if qtype == "IQ4_XS":  # fp16 d | scales_h (16 bits) | scales_l [4] | qs [128], 16 bytes per sub-block
        d = _fp16_field(blocks, 0).unsqueeze(-1)
        high = blocks[..., 2:4].to(torch.int32)
        high = (high[..., 0:1] | high[..., 1:2] << 8) >> (2 * torch.arange(8)) & 3
        low = blocks[..., 4:8].to(torch.int32).repeat_interleave(2, dim=-1) >> (4 * (torch.arange(8) % 2)) & 0x0F
        scales = ((low | high << 4) - 32).float().unsqueeze(-1)  # [..., 8, 1]
        return ((d * scales) * _iq4_values(blocks[..., 8:].unflatten(-1, (8, 16)))).flatten(-2)
    if qtype == "Q6_K":  # ql [128] | qh [64] | int8 scales [16] | fp16 d
        ql, qh = blocks[..., :128].to(torch.int32), blocks[..., 128:192].to(torch.int32)
        scales = blocks[..., 192:208].contiguous().view(torch.int8).float()
        d = _fp16_field(blocks, 208)
        halves = []
        for h in range(2):  # 128 weights each: group g (32 weights) from ql's nibble g // 2 and qh's bits 2g, 2g + 1
            low, high = ql[..., 64 * h : 64 * h + 64], qh[..., 32 * h : 32 * h + 32]
            for g in range(4):
                nibble = (low[..., 32 * (g % 2) : 32 * (g % 2) + 32] >> (4 * (g // 2))) & 0x0F
                halves.append((nibble | ((high >> (2 * g)) & 3) << 4) - 32)
        q = torch.cat(halves, dim=-1).float().unflatten(-1, (16, 16))
        return ((d.unsqueeze(-1) * scales.unsqueeze(-1)) * q).flatten(-2)
    # Q4_K: fp16 d | fp16 dmin | scales [12] | qs [128]; Q5_K puts qh [32] before qs
    d, dmin = _fp16_field(blocks, 0).unsqueeze(-1), _fp16_field(blocks, 2).unsqueeze(-1)
    scales, mins = _k_scales_and_mins(blocks[..., 4:16])
    qs = blocks[..., -128:].to(torch.int32).unflatten(-1, (4, 32))  # 64 weights per 32 bytes: low nibbles first
    q = torch.stack([qs & 0x0F, qs >> 4], dim=-2).flatten(-3, -2)  # [..., 8 sub-blocks, 32]
    if qtype == "Q5_K":  # bit j of qh[l]: the fifth bit of weight l of sub-block j
        qh = blocks[..., 16:48].to(torch.int32).unsqueeze(-2)
        q = q | ((qh >> torch.arange(8).view(8, 1)) & 1) << 4
    return ((d * scales) * q.float() - dmin * mins).flatten(-2)


def dequantize_reference(weight: BlockWeight) -> torch.Tensor:
    """The plain definition of each block type's values, in torch: float32 [N, K]."""
    n, k = weight.shape
    _, block_bytes, block = BLOCK_TYPES[weight.qtype]
    blocks = weight.blocks.view(n, k // block, block_bytes)
    if block == SUPER_BLOCK:
        return _dequantize_k_reference(weight.qtype, blocks).reshape(n, k)
    d = _fp16_field(blocks, 0)
    if weight.qtype == "Q8_0":
        return (blocks[..., 2:].contiguous().view(torch.int8).float() * d).reshape(n, k)
    if weight.qtype == "IQ4_NL":
        return (d * _iq4_values(blocks[..., 2:])).reshape(n, k)
    packed = blocks[..., -16:]  # weight j in the low nibble of byte j, weight j + 16 in the high one
    q = torch.cat([packed & 0x0F, packed >> 4], dim=-1).float()
    if weight.qtype in ("Q5_0", "Q5_1"):  # bit j of the 4 bytes before qs: weight j's fifth bit
        high = blocks[..., -20:-16].contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # little-endian
        q = q + 16 * ((high >> torch.arange(BLOCK)) & 1).float()
    if weight.qtype in ("Q4_0", "Q5_0"):
        offset = 8 if weight.qtype == "Q4_0" else 16
        return ((q - offset) * d).reshape(n, k)
    return (q * d + _fp16_field(blocks, 2)).reshape(n, k)


def round_activations_reference(x: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """x [M, K] float32 -> each block of `block` values rounded to int8 with scale d = max|block| / 127,
    back in float."""
    blocks = x.float().reshape(*x.shape[:-1], -1, block)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127.0
    inverse = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    return (torch.round(blocks * inverse).clamp_(-127, 127) * d).reshape(x.shape)


def gguf_linear_reference(x: torch.Tensor, weight: BlockWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] -> [M, N]: the rounded activations times the dequantized weight."""
    return F.linear(round_activations_reference(x, weight.activation_block), weight.dequantize(), bias)


@dataclass(frozen=True)
class PackedWeight:
    """A BlockWeight in the layout the kernel reads: `kernel_type` is the GGML type id, with PAIRED set when
    4-bit blocks were repacked in pairs, or INTERLEAVED when rows were interleaved in groups (then only the native
    functions can read `blocks`, and an interleaved `blocks` has the rows of whole groups: `out_features` or
    more)."""

    qtype: str
    blocks: torch.Tensor
    in_features: int
    kernel_type: int
    out_features: int = -1  # -1: blocks' row count

    def __post_init__(self) -> None:
        if self.out_features < 0:
            object.__setattr__(self, "out_features", self.blocks.shape[0])

    @property
    def is_interleaved(self) -> bool:
        return bool(self.kernel_type & INTERLEAVED)

    @property
    def activation_block(self) -> int:
        """How many activation values share one rounding scale in this type's products."""
        return BLOCK_TYPES[self.qtype][2]


@functools.cache
def _gemm_kernel():
    """kv_gguf_gemm(x, rows, inner, type, blocks, bias, out, out_features, threads) -> status, or None."""
    argtypes = [PTR, I64, I64, ctypes.c_int, PTR, PTR, PTR, I64, ctypes.c_int]
    return bind("gguf_blocks", "kv_gguf_gemm", argtypes, ctypes.c_int)


@functools.cache
def _repack_kernel():
    """kv_gguf_repack(type, source, target, rows, inner, threads) -> status, or None."""
    return bind("gguf_blocks", "kv_gguf_repack", [ctypes.c_int, PTR, PTR, I64, I64, ctypes.c_int], ctypes.c_int)


@functools.cache
def _interleave_kernel():
    """kv_gguf_interleave(type, source, target, rows, inner, threads) -> status, or None."""
    return bind("gguf_blocks", "kv_gguf_interleave", [ctypes.c_int, PTR, PTR, I64, I64, ctypes.c_int], ctypes.c_int)


@functools.cache
def wide_products() -> bool:
    """Whether interleaved weights run in the 512-bit kernel: the native kernels load, the CPU has AVX-512 F, BW,
    VL and VNNI (the kernel's own check of the CPU, which holds where /proc/cpuinfo cannot be read), and
    KVSERVE_NATIVE_ISA does not name a 256-bit build."""
    if not avx512_kernels_allowed():
        return False
    supported = bind("gguf_blocks", "kv_gguf_interleaved_supported", [], ctypes.c_int)
    return supported is not None and bool(supported())


@functools.cache
def interleaved_types(wide: bool | None = None) -> tuple[str, ...]:
    """The types whose weights are interleaved for the register-tiled products on this machine: every
    INTERLEAVED_TYPES type for the 512-bit kernel (`wide`; default: wide_products()); for the 256-bit one, the
    32-weight types (the 256-weight types measured no faster there than the row kernel); none where the native
    kernels do not load."""
    if wide is None:
        wide = wide_products()
    takes = bind("gguf_blocks", "kv_gguf_interleaved_narrow_takes", [ctypes.c_int], ctypes.c_int)
    if takes is None:
        return ()
    return tuple(t for t in INTERLEAVED_TYPES if wide or takes(BLOCK_TYPES[t][0]))


@functools.cache
def _dequantize_kernel(dtype: torch.dtype = torch.float32):
    """kv_gguf_dequantize(type, blocks, inner, rows or NULL, num_rows, out, threads) -> status, or None; the
    bfloat16 one (kv_gguf_dequantize_bf16) for dtype bfloat16."""
    argtypes = [ctypes.c_int, PTR, I64, PTR, I64, PTR, ctypes.c_int]
    symbol = "kv_gguf_dequantize_bf16" if dtype == torch.bfloat16 else "kv_gguf_dequantize"
    return bind("gguf_blocks", symbol, argtypes, ctypes.c_int)


@functools.cache
def _round_kernel():
    """kv_gguf_round_activations(x, out, rows, cols, block, threads), or None."""
    return bind("gguf_blocks", "kv_gguf_round_activations", [PTR, PTR, I64, I64, I64, ctypes.c_int], None)


def available() -> bool:
    """Whether the native block kernels run on this machine."""
    return _gemm_kernel() is not None


def _check(status: int, what: str) -> None:
    if status == 1:
        raise MemoryError(f"the GGUF block kernel could not allocate its buffer for {what}")
    if status != 0:
        raise ValueError(f"the GGUF block kernel refused {what} (unknown type or a size it cannot hold)")


def interleave(weight: BlockWeight, wide: bool | None = None) -> PackedWeight:
    """The weight interleaved in groups of GROUP_ROWS rows for the register-tiled products, in the 512-bit kernel
    (`wide`; default: wide_products()) or the 256-bit one (a type of interleaved_types(wide)): the same bytes per
    row, the last group padded with zero rows."""
    if wide is None:
        wide = wide_products()
    if weight.qtype not in interleaved_types(wide):
        raise ValueError(f"{weight.qtype} weights are not interleaved on this machine")
    groups = -(-weight.out_features // GROUP_ROWS)
    source = weight.blocks.contiguous()
    target = torch.empty(groups * GROUP_ROWS, source.shape[1], dtype=torch.uint8)
    status = _interleave_kernel()(
        weight.type_id,
        source.data_ptr(),
        target.data_ptr(),
        weight.out_features,
        weight.in_features,
        torch.get_num_threads(),
    )
    _check(status, "interleaving")
    kernel_type = weight.type_id | INTERLEAVED | (0 if wide else NARROW)
    return PackedWeight(weight.qtype, target, weight.in_features, kernel_type, weight.out_features)


def pack(weight: BlockWeight, interleaved: bool | None = None) -> PackedWeight:
    """The weight in the kernel's layout: interleaved (`interleave`) where the native kernels load and take the
    type (interleaved_types(); `interleaved` False: never); else 4-bit blocks repacked in pairs
    where the kernel loads and a row holds an even number of blocks; otherwise the file's layout, unchanged."""
    if interleaved is not False and weight.qtype in interleaved_types():
        return interleave(weight)
    type_id = weight.type_id
    if not (available() and weight.qtype in ("Q4_0", "Q4_1") and weight.in_features % (2 * BLOCK) == 0):
        return PackedWeight(weight.qtype, weight.blocks, weight.in_features, type_id)
    source = weight.blocks.contiguous()
    target = torch.empty_like(source)
    status = _repack_kernel()(
        type_id, source.data_ptr(), target.data_ptr(), weight.out_features, weight.in_features, torch.get_num_threads()
    )
    _check(status, "repacking")
    return PackedWeight(weight.qtype, target, weight.in_features, type_id | PAIRED)


def gguf_linear_native(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] float32 on CPU -> [M, N] through the integer kernel."""
    x = x.contiguous()
    out = torch.empty(x.shape[0], weight.out_features, dtype=torch.float32)
    status = _gemm_kernel()(
        x.data_ptr(),
        x.shape[0],
        weight.in_features,
        weight.kernel_type,
        weight.blocks.data_ptr(),
        bias.data_ptr() if bias is not None else None,
        out.data_ptr(),
        weight.out_features,
        torch.get_num_threads(),
    )
    _check(status, "a product")
    return out


def dequantize_rows(
    weight: PackedWeight,
    rows: torch.Tensor | None = None,
    start: int = 0,
    stop: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Rows of the weight in float32 (or bfloat16, rounded to nearest even from the float32 values): the rows
    named by `rows` [R] int64, else rows start..stop."""
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"GGUF rows dequantize to float32 or bfloat16, not {dtype}")
    kernel = _dequantize_kernel(dtype)
    if kernel is None:  # then `pack` kept the file's layout
        picked = weight.blocks[rows] if rows is not None else weight.blocks[start:stop]
        return dequantize_reference(BlockWeight(weight.qtype, picked, weight.in_features)).to(dtype)
    if rows is None and weight.is_interleaved:  # an interleaved row's bytes are spread over its group: name the rows
        rows = torch.arange(start, weight.out_features if stop is None else stop)
    if rows is not None:
        rows = rows.to(torch.int64).contiguous()
        num_rows, source, row_pointer = rows.shape[0], weight.blocks, rows.data_ptr()
    else:
        source = weight.blocks[start:stop]
        num_rows, row_pointer = source.shape[0], None
    out = torch.empty(num_rows, weight.in_features, dtype=dtype)
    pointers = (source.data_ptr(), weight.in_features, row_pointer, num_rows, out.data_ptr())
    _check(kernel(weight.kernel_type, *pointers, torch.get_num_threads()), "dequantizing")
    return out


def round_activations(x: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """round_activations_reference, natively where the kernel loads."""
    kernel = _round_kernel()
    if kernel is None or x.dtype != torch.float32 or x.device.type != "cpu":
        return round_activations_reference(x, block)
    x = x.contiguous()
    out = torch.empty_like(x)
    kernel(x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], block, torch.get_num_threads())
    return out


def gguf_linear_tiled(
    x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The kernel's numbers for large M, one dequantized tile of weight rows at a time: in float32 BLAS (to
    float32 rounding), or with `dtype` bfloat16 the tile and the rounded activations cast to it and
    multiplied by oneDNN (float32 accumulation, each output rounded once to bfloat16: ~3 significant digits,
    several times float32's rate where the CPU has AVX-512 BF16 or AMX)."""
    rounded = round_activations(x.float(), weight.activation_block).to(dtype)
    out = torch.empty(x.shape[0], weight.out_features, dtype=torch.float32)
    tile = max(16, TILE_BYTES // (4 * weight.in_features))
    for start in range(0, weight.out_features, tile):
        stop = min(start + tile, weight.out_features)
        out[:, start:stop] = rounded @ dequantize_rows(weight, start=start, stop=stop, dtype=dtype).t()
    if bias is not None:
        out += bias
    return out


def gguf_linear_forward(
    x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None, prefill_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """x [M, K] float32 -> [M, N]: the integer kernel for decode-sized batches where it loads, and for every
    batch over interleaved rows unless a faster `prefill_dtype` is asked for; the tiled path in `prefill_dtype`
    otherwise (float32: the kernel's numbers)."""
    rows = x.shape[0]
    if weight.is_interleaved and (rows <= MAX_KERNEL_ROWS or prefill_dtype == torch.float32):
        return gguf_linear_native(x, weight, bias)
    if rows <= MAX_KERNEL_ROWS and available():
        return gguf_linear_native(x, weight, bias)
    return gguf_linear_tiled(x, weight, bias, prefill_dtype)
