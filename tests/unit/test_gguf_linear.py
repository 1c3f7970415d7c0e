"""GGUF-block linear layers (engine/ops/gguf_linear.py, engine/quantization/gguf.py): the blocks decode as
the `gguf` package decodes them, and the AVX2 kernel, the register-tiled kernel over interleaved rows (where the
CPU has AVX-512 VNNI), the tiled BLAS path and the torch reference agree."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from engine.bench.random_gguf import RANDOM_BLOCK_TYPES, random_blocks
from engine.ops import gguf_linear
from engine.ops.gguf_linear import (
    BLOCK_TYPES,
    GROUP_ROWS,
    INTERLEAVED_TYPES,
    NARROW,
    PAIRED,
    BlockWeight,
    cat_weights,
    dequantize_reference,
    dequantize_rows,
    gguf_linear_native,
    gguf_linear_reference,
    gguf_linear_tiled,
    pack,
    round_activations,
    round_activations_reference,
)
from engine.ops.loader import unavailable_reason
from engine.quantization import kernel_weight
from engine.quantization.gguf import GgufEmbedding, GgufLinear
from tests.support.gguf_weights import block_weight

needs_kernel = pytest.mark.skipif(
    not gguf_linear.available(), reason=f"GGUF block kernel unavailable: {unavailable_reason('gguf_blocks')}"
)


K_QUANTS = ["Q4_K", "Q5_K", "Q6_K"]


def _layouts(weight: BlockWeight) -> list[gguf_linear.PackedWeight]:
    """The weight in each layout and kernel this machine runs: the row kernel's layout (file or paired), and the
    interleaved one for the 512-bit register-tiled kernel (where the CPU has AVX-512 VNNI) and for the 256-bit
    one (where its build's instructions take the type)."""
    layouts = [pack(weight, interleaved=False)]
    if gguf_linear.wide_products():
        layouts.append(gguf_linear.interleave(weight, wide=True))
    if weight.qtype in gguf_linear.interleaved_types(wide=False):
        layouts.append(gguf_linear.interleave(weight, wide=False))
        assert layouts[-1].kernel_type & NARROW
    assert pack(weight).is_interleaved == (weight.qtype in gguf_linear.interleaved_types())  # the default
    return layouts


def _in_features(qtype: str, blocks: int) -> int:
    return blocks * BLOCK_TYPES[qtype][2]


@pytest.mark.parametrize("qtype", list(BLOCK_TYPES))
@pytest.mark.parametrize("blocks", [3, 4])  # 3 blocks a row stay in the file's layout, 4 are paired (4-bit)
def test_blocks_decode_as_the_gguf_package_decodes_them(qtype, blocks):
    in_features = _in_features(qtype, blocks)
    weight, decoded = block_weight(qtype, 41, in_features)
    assert torch.equal(dequantize_reference(weight), decoded)
    for packed in _layouts(weight):
        if packed.is_interleaved:  # 41 rows: two whole groups of 16 and one padded with 7 zero rows
            assert packed.out_features == 41 and packed.blocks.nbytes == 48 * weight.blocks.shape[1]
        else:
            paired = gguf_linear.available() and qtype in ("Q4_0", "Q4_1") and blocks == 4
            assert bool(packed.kernel_type & PAIRED) == paired and packed.blocks.nbytes == weight.blocks.nbytes
        assert torch.equal(dequantize_rows(packed), decoded)  # native where the kernel loads
        assert torch.equal(dequantize_rows(packed, start=7, stop=19), decoded[7:19])
        picked = torch.tensor([40, 0, 5, 5])
        assert torch.equal(dequantize_rows(packed, rows=picked), decoded[picked])


@pytest.mark.parametrize("qtype", [q for q in BLOCK_TYPES if q not in RANDOM_BLOCK_TYPES])
def test_the_extremes_of_each_scale_decode_and_multiply_as_the_reference(qtype):
    """Blocks of zeros, of one repeated value, at the edge of fp16's range and in its subnormals, of one sign."""
    dense = torch.randn(6, 256)
    dense[0, :32] = 0.0
    dense[1, 32:64] = 3.0
    dense[2, 64:96] *= 2000.0  # scales near fp16's largest
    dense[3, 96:128] *= 1e-6  # subnormal fp16 scales
    dense[4] = dense[4].abs()
    dense[5] = -dense[5].abs()
    kind = gguf.GGMLQuantizationType[qtype]
    raw = gguf.quants.quantize(dense.numpy(), kind)
    weight = BlockWeight(qtype, torch.from_numpy(raw.copy()), 256)
    decoded = torch.from_numpy(gguf.quants.dequantize(raw, kind).copy())
    assert torch.equal(dequantize_reference(weight), decoded)
    for packed in _layouts(weight):
        assert torch.equal(dequantize_rows(packed), decoded)
        if gguf_linear.available():
            x = torch.randn(3, 256)
            expected = gguf_linear_reference(x, weight, None)
            scale = expected.abs().max()
            assert (gguf_linear_native(x, packed, None) - expected).abs().max() <= 1e-5 * scale


def _k_block_fields(qtype: str, blocks: np.ndarray) -> dict[str, np.ndarray]:
    """Views of the fields of [rows, n, block bytes] K-quant blocks: fp16 d (and dmin), the packed scales."""
    if qtype == "Q6_K":
        return {"d": blocks[..., 208:210], "scales": blocks[..., 192:208]}
    return {"d": blocks[..., 0:2], "dmin": blocks[..., 2:4], "scales": blocks[..., 4:16]}


def _assert_decode_and_products_follow_the_reference(qtype: str, raw: np.ndarray) -> None:
    """[rows, 512 weights' blocks]: decoded as the gguf package decodes them, natively too, and the kernel's
    products within float32 rounding of the reference, per output row (one row's scale may be huge)."""
    weight = BlockWeight(qtype, torch.from_numpy(raw.copy()), 512)
    decoded = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).copy())
    assert torch.isfinite(decoded).all()
    assert torch.equal(dequantize_reference(weight), decoded)
    for packed in _layouts(weight):
        assert torch.equal(dequantize_rows(packed), decoded)
        if gguf_linear.available():
            x = torch.randn(3, 512)
            expected = gguf_linear_reference(x, weight, None)
            scale = expected.abs().amax(dim=0, keepdim=True).clamp_min(1e-30)
            assert ((gguf_linear_native(x, packed, None) - expected).abs() <= 1e-5 * scale).all()


@pytest.mark.parametrize("qtype", K_QUANTS)
def test_the_extremes_of_each_k_quant_scale_decode_and_multiply_as_the_reference(qtype):
    """Super-scales of zero, near fp16's largest, subnormal and negative; sub-block scales all at their
    largest (6 bits: 63; Q6_K's int8: -128 and 127) and at zero; every weight bit set."""
    raw = random_blocks(np.random.default_rng(5), qtype, 6, 512, 1.0).reshape(6, 2, -1)
    fields = _k_block_fields(qtype, raw)
    for row, value in enumerate([0.0, 60000.0, 1e-7, -0.75]):
        fields["d"][row, 0] = np.array([value], dtype=np.float16).view(np.uint8)
    if "dmin" in fields:
        fields["dmin"][1, 1] = np.array([-3e4], dtype=np.float16).view(np.uint8)
    fields["scales"][4, 0] = 0xFF if qtype != "Q6_K" else np.array([-128, 127] * 8, dtype=np.int8).view(np.uint8)
    fields["scales"][4, 1] = 0
    raw[5, 0, :] = 0xFF
    raw[5, 0, -2:] = np.array([0.5], dtype=np.float16).view(np.uint8) if qtype == "Q6_K" else raw[5, 0, -2:]
    if qtype != "Q6_K":
        raw[5, 0, 0:4] = np.array([0.5, 0.25], dtype=np.float16).view(np.uint8)
    _assert_decode_and_products_follow_the_reference(qtype, raw.reshape(6, -1))


@pytest.mark.parametrize("qtype", ["IQ4_NL", "IQ4_XS"])
def test_the_extremes_of_each_iq4_scale_decode_and_multiply_as_the_reference(qtype):
    """Scales of zero, near fp16's largest, subnormal and negative; IQ4_XS's sub-block scales at both ends of
    their range (6 bits: -32 and 31 after the offset); every index at the grid's ends (0 and 15)."""
    block = BLOCK_TYPES[qtype][2]
    raw = random_blocks(np.random.default_rng(5), qtype, 6, 512, 1.0).reshape(6, 512 // block, -1)
    for row, value in enumerate([0.0, 60000.0, 1e-7, -0.75]):
        raw[row, 0, 0:2] = np.array([value], dtype=np.float16).view(np.uint8)
    if qtype == "IQ4_XS":  # scales_h [2 bytes] | scales_l [4]: every scale 63 (+31), then every scale 0 (-32)
        raw[4, 0, 2:8], raw[4, 1, 2:8] = 0xFF, 0
    raw[5, 0, -16:], raw[5, 1, -16:] = 0xFF, 0  # indices 15 (113) and 0 (-127)
    _assert_decode_and_products_follow_the_reference(qtype, raw.reshape(6, -1))


def test_random_iq4_blocks_spread_about_the_asked_deviation_around_zero():
    """The IQ4 grid is not centred (its mean is -5.9 of 67): the random scales' signs centre the weights."""
    for qtype in ("IQ4_NL", "IQ4_XS"):
        raw = random_blocks(np.random.default_rng(0), qtype, 64, 1024, 0.02)
        values = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype])
        assert 0.015 < values.std() < 0.025 and abs(values.mean()) < 0.002


@pytest.mark.parametrize("block", [32, 256])  # the 32-weight types' blocks and the K-quants'
def test_activation_rounding_is_per_block_and_within_half_a_step(block):
    x = torch.randn(5, 4 * block) * torch.linspace(0.01, 100, 4 * block)  # blocks of very different magnitudes
    x[2, block : 2 * block] = 0.0  # an all-zero block keeps zeros
    rounded = round_activations_reference(x, block)
    assert torch.equal(round_activations(x, block), rounded)
    step = x.reshape(5, 4, block).abs().amax(-1, keepdim=True) / 127
    error = (rounded - x).reshape(5, 4, block).abs()
    assert bool((error <= step / 2 + 1e-6 * step).all())
    assert torch.equal(rounded[2, block : 2 * block], torch.zeros(block))
    if block == 256:  # one scale per 256: a block of 32 small values next to large ones rounds coarser
        assert not torch.equal(rounded, round_activations_reference(x, 32))


@needs_kernel
@pytest.mark.parametrize("qtype", list(BLOCK_TYPES))
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 64])
@pytest.mark.parametrize("blocks", [5, 6])  # an odd and an even number of blocks a row
def test_the_kernel_matches_the_reference(qtype, rows, blocks):
    in_features = _in_features(qtype, blocks)
    weight, _ = block_weight(qtype, 70, in_features)
    x = torch.randn(rows, in_features)
    bias = torch.randn(70)
    expected = gguf_linear_reference(x, weight, bias)
    for packed in _layouts(weight):
        assert torch.allclose(gguf_linear_native(x, packed, bias), expected, rtol=1e-5, atol=1e-4)
        assert torch.allclose(gguf_linear_tiled(x, packed, bias), expected, rtol=1e-5, atol=1e-4)


@needs_kernel
@pytest.mark.parametrize("qtype", list(BLOCK_TYPES))
def test_a_rows_result_does_not_depend_on_its_batch(qtype):
    """Rows go through the row kernel in groups of up to 4 and through the register-tiled one in passes of up to
    8; each is summed in the same order in any group."""
    for packed in _layouts(block_weight(qtype, 33, 512, seed=1)[0]):
        x = torch.randn(11, 512)
        batched = gguf_linear_native(x, packed, None)
        one_by_one = torch.cat([gguf_linear_native(x[i : i + 1], packed, None) for i in range(11)])
        assert torch.equal(batched, one_by_one)


@pytest.mark.parametrize("qtype", INTERLEAVED_TYPES)
def test_interleaved_weights_take_the_integer_kernel_for_every_batch_unless_bfloat16_is_asked(qtype):
    """A prompt of any length and a decode row get the same numbers for the same input (batch invariance from
    prefill to decode), and --prefill-dtype bfloat16 still reaches the many-row products."""
    if qtype not in gguf_linear.interleaved_types():
        pytest.skip(f"{qtype} is not interleaved on this machine")
    in_features = _in_features(qtype, 2 if BLOCK_TYPES[qtype][2] == 256 else 6)
    weight, _ = block_weight(qtype, 2 * GROUP_ROWS + 3, in_features, seed=4)
    layer = GgufLinear(pack(weight), torch.randn(2 * GROUP_ROWS + 3))
    assert layer.packed.is_interleaved and layer.out_features == 2 * GROUP_ROWS + 3
    many = torch.randn(gguf_linear.MAX_KERNEL_ROWS + 9, in_features)
    out = layer(many)
    assert out.shape == (gguf_linear.MAX_KERNEL_ROWS + 9, 2 * GROUP_ROWS + 3)
    assert torch.equal(out[-3:], layer(many[-3:])) and torch.equal(out[:1], layer(many[:1]))
    assert torch.allclose(out, gguf_linear_reference(many, weight, layer.bias), rtol=1e-5, atol=1e-4)
    layer.prefill_dtype = torch.bfloat16
    assert not torch.equal(layer(many), out) and torch.equal(layer(many[:1]), out[:1])


def test_the_layer_takes_the_kernel_for_few_rows_and_tiles_for_many(monkeypatch):
    weight, decoded = block_weight("Q4_1", 300, 64)
    layer = GgufLinear(pack(weight, interleaved=False))
    monkeypatch.setattr(gguf_linear, "TILE_BYTES", 64 * 4 * 50)  # 50-row tiles: several tiles and a ragged end
    many = torch.randn(gguf_linear.MAX_KERNEL_ROWS + 3, 64)
    expected = gguf_linear_reference(many, weight, None)
    assert torch.allclose(layer(many), expected, rtol=1e-5, atol=1e-4)
    assert torch.allclose(layer(many[:2].view(1, 2, 64)), expected[:2].view(1, 2, 300), rtol=1e-5, atol=1e-4)
    assert layer.blocks.nbytes == 300 * 64 // 32 * 20  # the file's bytes, no float copy
    assert not any(buffer.is_floating_point() for buffer in layer.buffers())
    assert torch.allclose(decoded, weight.dequantize())


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "Q4_K", "Q6_K"])
def test_bfloat16_prefill_products_stay_within_bfloat16_rounding_of_the_reference(qtype):
    """Each weight and rounded activation cast to bfloat16 (8 significant bits), float32 accumulation, each
    output rounded once: the error is a few 2^-9 of the products' magnitudes, never float32's numbers."""
    in_features = _in_features(qtype, 2 if BLOCK_TYPES[qtype][2] == 256 else 8)
    weight, _ = block_weight(qtype, 40, in_features)
    x = torch.randn(gguf_linear.MAX_KERNEL_ROWS + 5, in_features)
    expected = gguf_linear_reference(x, weight, None)
    got = gguf_linear_tiled(x, pack(weight), None, torch.bfloat16)
    assert got.dtype == torch.float32 and not torch.equal(got, expected)
    magnitude = round_activations_reference(x, weight.activation_block).abs() @ weight.dequantize().abs().t()
    assert ((got - expected).abs() <= 2**-7 * magnitude + 1e-6).all()
    assert (got - expected).norm() / expected.norm() < 1e-2


@pytest.mark.parametrize("qtype", list(BLOCK_TYPES))
def test_rows_dequantize_to_bfloat16_as_torch_rounds_their_float32_values(qtype):
    packed = pack(block_weight(qtype, 21, _in_features(qtype, 2 if BLOCK_TYPES[qtype][2] == 256 else 6))[0])
    float32 = dequantize_rows(packed)
    assert torch.equal(dequantize_rows(packed, dtype=torch.bfloat16), float32.bfloat16())
    picked = torch.tensor([20, 0, 7])
    assert torch.equal(dequantize_rows(packed, rows=picked, dtype=torch.bfloat16), float32[picked].bfloat16())
    assert torch.equal(dequantize_rows(packed, start=3, stop=9, dtype=torch.bfloat16), float32[3:9].bfloat16())
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        dequantize_rows(packed, dtype=torch.float16)


def test_the_prefill_dtype_is_set_once_on_every_block_layer_and_reaches_only_many_row_products(monkeypatch, caplog):
    from torch import nn

    from engine import quantization
    from engine.config import EngineConfig

    weight, _ = block_weight("Q4_0", 48, 64)
    model = nn.Sequential(GgufLinear(pack(weight)), nn.Linear(4, 4), GgufLinear(pack(weight)))
    many, few = torch.randn(gguf_linear.MAX_KERNEL_ROWS + 1, 64), torch.randn(3, 64)
    float32_many, float32_few = model[0](many), model[0](few)
    bf16 = EngineConfig(model="m", prefill_dtype="bfloat16")
    assert quantization.apply_prefill_dtype(nn.Sequential(nn.Linear(4, 4)), bf16) is None  # no GGUF layers
    for present in (False, True):  # a warning only where the CPU would emulate bfloat16
        monkeypatch.setattr(quantization, "has_bf16_products", lambda present=present: present)
        caplog.clear()
        assert quantization.apply_prefill_dtype(model, EngineConfig(model="m")) == "float32"
        assert model[0].prefill_dtype == model[2].prefill_dtype == torch.float32
        assert quantization.apply_prefill_dtype(model, bf16) == "bfloat16"
        assert ("slower than float32 here" in caplog.text) is not present
    assert model[0].prefill_dtype == model[2].prefill_dtype == torch.bfloat16 and "prefill in bfloat16" in repr(
        model[0]
    )
    assert not torch.equal(model[0](many), float32_many)
    assert (model[0](many) - float32_many).norm() / float32_many.norm() < 1e-2
    if gguf_linear.available():  # decode-sized batches stay on the integer kernel
        assert torch.equal(model[0](few), float32_few)


def test_the_embedding_looks_up_decoded_rows_and_refuses_foreign_ids():
    weight, decoded = block_weight("Q8_0", 50, 64)
    table = GgufEmbedding(pack(weight))
    ids = torch.tensor([[3, 49], [0, 3]])
    assert torch.equal(table(ids), decoded[ids])
    with pytest.raises(IndexError):
        table(torch.tensor([50]))


def test_the_layer_tells_the_fused_kernel_its_blocks_and_type():
    weight, _ = block_weight("Q4_0", 8, 128)
    bias = torch.randn(8)
    layer = GgufLinear(pack(weight), bias)
    read = kernel_weight(layer)
    assert (read.block_type, read.weight, read.scale) == (layer.kernel_type, layer.blocks.data_ptr(), None)
    assert (read.bias, read.out_features) == (layer.bias.data_ptr(), 8)
    assert read.block_type & 0xFF == BLOCK_TYPES["Q4_0"][0]  # the GGML type id, PAIRED set where repacked
    assert kernel_weight(GgufLinear(pack(weight))).bias is None
    assert kernel_weight(GgufEmbedding(pack(weight))) is None  # a table, not a projection


def test_fused_projections_stay_blocks_only_when_their_types_match():
    q, _ = block_weight("Q4_0", 8, 64)
    k, _ = block_weight("Q4_0", 4, 64, seed=2)
    v, _ = block_weight("Q8_0", 4, 64, seed=3)
    fused = cat_weights([q, k])
    assert fused is not None and fused.shape == (12, 64) and torch.equal(fused.dequantize()[8:], k.dequantize())
    assert cat_weights([q, k, v]) is None


def test_malformed_blocks_are_refused():
    with pytest.raises(ValueError, match="no block kernel"):
        BlockWeight("IQ2_XS", torch.zeros(2, 74, dtype=torch.uint8), 256)
    with pytest.raises(ValueError, match="do not hold"):
        BlockWeight("Q6_K", torch.zeros(2, 210, dtype=torch.uint8), 128)  # rows of 256 weights at least
    with pytest.raises(ValueError, match="do not hold"):
        BlockWeight("Q4_0", torch.zeros(2, 17, dtype=torch.uint8), 32)


def test_the_benchmark_times_every_path_beside_float32(capsys):
    from engine.bench import gguf_linear as bench

    assert bench.main(["--shape", "64,128", "--types", "Q4_0,Q8_0", "--rows", "1,100", "--repeats", "1"]) == 0
    table = capsys.readouterr().out
    assert table.count("| Q4_0 |") == 2 and table.count("| Q8_0 |") == 2
    assert "| Q8_0 | 100 |" in table and table.rstrip().endswith("| — |")  # 100 rows: past the int8 kernel's 48


@needs_kernel
def test_the_benchmark_streams_distinct_copies_of_each_weight_from_memory():
    from engine.bench import gguf_linear as bench

    rows = bench.streamed(64, 256, ["Q4_0", "Q4_K"], [1, 3], megabytes=1, repeats=1)
    assert [(r["type"], r["rows"]) for r in rows] == [("Q4_0", 1), ("Q4_0", 3), ("Q4_K", 1), ("Q4_K", 3)]
    one_weight_bytes = {"Q4_0": 64 * 256 // 32 * 18, "Q4_K": 64 * 256 // 256 * 144}
    for r in rows:  # 1 MB of copies of the weight, each timed
        assert r["copies"] == 2**20 // one_weight_bytes[r["type"]] and r["ms"] > 0 and r["gb_s"] > 0


def test_naming_a_256_bit_kernel_build_keeps_the_products_off_the_512_bit_kernel(monkeypatch):
    weight, decoded = block_weight("Q4_0", 20, 128)
    x = torch.randn(3, 128)
    expected = gguf_linear_reference(x, weight, None)
    try:
        for build in ("avx2", "avxvnni", "avx512vnni"):
            monkeypatch.setenv("KVSERVE_NATIVE_ISA", build)
            gguf_linear.wide_products.cache_clear()
            gguf_linear.interleaved_types.cache_clear()
            packed = pack(weight)
            if build != "avx512vnni":
                assert not gguf_linear.wide_products()
            assert packed.is_interleaved == gguf_linear.available()
            assert bool(packed.kernel_type & NARROW) == (packed.is_interleaved and not gguf_linear.wide_products())
            assert torch.equal(dequantize_rows(packed), decoded)
            if gguf_linear.available():
                assert torch.allclose(gguf_linear_native(x, packed, None), expected, rtol=1e-5, atol=1e-4)
    finally:
        monkeypatch.delenv("KVSERVE_NATIVE_ISA")
        gguf_linear.wide_products.cache_clear()
        gguf_linear.interleaved_types.cache_clear()
