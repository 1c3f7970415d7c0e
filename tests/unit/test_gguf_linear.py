"""GGUF-block linear layers (engine/ops/gguf_linear.py, engine/quantization/gguf.py): the blocks decode as
the `gguf` package decodes them, and the AVX2 kernel, the tiled BLAS path and the torch reference agree."""

from __future__ import annotations

import gguf
import pytest
import torch

from engine.ops import gguf_linear
from engine.ops.gguf_linear import (
    BLOCK_TYPES,
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

needs_kernel = pytest.mark.skipif(
    not gguf_linear.available(), reason=f"GGUF block kernel unavailable: {unavailable_reason('gguf_blocks')}"
)


def _weight(qtype: str, out_features: int, in_features: int, seed: int = 0) -> tuple[BlockWeight, torch.Tensor]:
    """Blocks quantized by the gguf package (the format llama.cpp writes), and their values as it decodes them."""
    generator = torch.Generator().manual_seed(seed)
    dense = torch.randn(out_features, in_features, generator=generator).numpy()
    kind = gguf.GGMLQuantizationType[qtype]
    raw = gguf.quants.quantize(dense, kind)
    decoded = torch.from_numpy(gguf.quants.dequantize(raw, kind).copy())
    return BlockWeight(qtype, torch.from_numpy(raw.copy()), in_features), decoded


@pytest.mark.parametrize("qtype", list(BLOCK_TYPES))
@pytest.mark.parametrize("in_features", [96, 128])  # 3 blocks a row stay in the file's layout, 4 are paired
def test_blocks_decode_as_the_gguf_package_decodes_them(qtype, in_features):
    weight, decoded = _weight(qtype, 40, in_features)
    assert torch.equal(dequantize_reference(weight), decoded)
    packed = pack(weight)
    paired = gguf_linear.available() and qtype in ("Q4_0", "Q4_1") and in_features == 128
    assert bool(packed.kernel_type & PAIRED) == paired and packed.blocks.nbytes == weight.blocks.nbytes
    assert torch.equal(dequantize_rows(packed), decoded)  # native where the kernel loads
    assert torch.equal(dequantize_rows(packed, start=7, stop=19), decoded[7:19])
    picked = torch.tensor([39, 0, 5, 5])
    assert torch.equal(dequantize_rows(packed, rows=picked), decoded[picked])


@pytest.mark.parametrize("qtype", list(BLOCK_TYPES))
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
    assert torch.equal(dequantize_rows(pack(weight)), decoded)
    if gguf_linear.available():
        x = torch.randn(3, 256)
        expected = gguf_linear_reference(x, weight, None)
        scale = expected.abs().max()
        assert (gguf_linear_native(x, pack(weight), None) - expected).abs().max() <= 1e-5 * scale


def test_activation_rounding_is_per_block_of_32_and_within_half_a_step():
    x = torch.randn(5, 128) * torch.linspace(0.01, 100, 128)  # blocks of very different magnitudes
    x[2, 32:64] = 0.0  # an all-zero block keeps zeros
    rounded = round_activations_reference(x)
    assert torch.equal(round_activations(x), rounded)
    step = x.reshape(5, 4, 32).abs().amax(-1, keepdim=True) / 127
    error = (rounded - x).reshape(5, 4, 32).abs()
    assert bool((error <= step / 2 + 1e-6 * step).all())
    assert torch.equal(rounded[2, 32:64], torch.zeros(32))


@needs_kernel
@pytest.mark.parametrize("qtype", list(BLOCK_TYPES))
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 64])
@pytest.mark.parametrize("in_features", [160, 192])  # an odd and an even number of blocks a row
def test_the_kernel_matches_the_reference(qtype, rows, in_features):
    weight, _ = _weight(qtype, 70, in_features)
    x = torch.randn(rows, in_features)
    bias = torch.randn(70)
    expected = gguf_linear_reference(x, weight, bias)
    packed = pack(weight)
    assert torch.allclose(gguf_linear_native(x, packed, bias), expected, rtol=1e-5, atol=1e-4)
    assert torch.allclose(gguf_linear_tiled(x, packed, bias), expected, rtol=1e-5, atol=1e-4)


@needs_kernel
@pytest.mark.parametrize("qtype", list(BLOCK_TYPES))
def test_a_rows_result_does_not_depend_on_its_batch(qtype):
    """Rows go through the kernel in groups of up to 4; each is summed in the same order in any group."""
    packed = pack(_weight(qtype, 33, 256, seed=1)[0])
    x = torch.randn(11, 256)
    batched = gguf_linear_native(x, packed, None)
    one_by_one = torch.cat([gguf_linear_native(x[i : i + 1], packed, None) for i in range(11)])
    assert torch.equal(batched, one_by_one)


def test_the_layer_takes_the_kernel_for_few_rows_and_tiles_for_many(monkeypatch):
    weight, decoded = _weight("Q4_1", 300, 64)
    layer = GgufLinear(pack(weight))
    monkeypatch.setattr(gguf_linear, "TILE_BYTES", 64 * 4 * 50)  # 50-row tiles: several tiles and a ragged end
    many = torch.randn(gguf_linear.MAX_KERNEL_ROWS + 3, 64)
    expected = gguf_linear_reference(many, weight, None)
    assert torch.allclose(layer(many), expected, rtol=1e-5, atol=1e-4)
    assert torch.allclose(layer(many[:2].view(1, 2, 64)), expected[:2].view(1, 2, 300), rtol=1e-5, atol=1e-4)
    assert layer.blocks.nbytes == 300 * 64 // 32 * 20  # the file's bytes, no float copy
    assert not any(buffer.is_floating_point() for buffer in layer.buffers())
    assert torch.allclose(decoded, weight.dequantize())


def test_the_embedding_looks_up_decoded_rows_and_refuses_foreign_ids():
    weight, decoded = _weight("Q8_0", 50, 64)
    table = GgufEmbedding(pack(weight))
    ids = torch.tensor([[3, 49], [0, 3]])
    assert torch.equal(table(ids), decoded[ids])
    with pytest.raises(IndexError):
        table(torch.tensor([50]))


def test_the_layer_tells_the_fused_kernel_its_blocks_and_type():
    weight, _ = _weight("Q4_0", 8, 128)
    bias = torch.randn(8)
    layer = GgufLinear(pack(weight), bias)
    read = kernel_weight(layer)
    assert (read.block_type, read.weight, read.scale) == (layer.kernel_type, layer.blocks.data_ptr(), None)
    assert (read.bias, read.out_features) == (layer.bias.data_ptr(), 8)
    assert read.block_type & 0xFF == BLOCK_TYPES["Q4_0"][0]  # the GGML type id, PAIRED set where repacked
    assert kernel_weight(GgufLinear(pack(weight))).bias is None
    assert kernel_weight(GgufEmbedding(pack(weight))) is None  # a table, not a projection


def test_fused_projections_stay_blocks_only_when_their_types_match():
    q, _ = _weight("Q4_0", 8, 64)
    k, _ = _weight("Q4_0", 4, 64, seed=2)
    v, _ = _weight("Q8_0", 4, 64, seed=3)
    fused = cat_weights([q, k])
    assert fused is not None and fused.shape == (12, 64) and torch.equal(fused.dequantize()[8:], k.dequantize())
    assert cat_weights([q, k, v]) is None


def test_malformed_blocks_are_refused():
    with pytest.raises(ValueError, match="no block kernel"):
        BlockWeight("Q6_K", torch.zeros(2, 210, dtype=torch.uint8), 256)
    with pytest.raises(ValueError, match="do not hold"):
        BlockWeight("Q4_0", torch.zeros(2, 17, dtype=torch.uint8), 32)


def test_the_benchmark_times_every_path_beside_float32(capsys):
    from engine.bench import gguf_linear as bench

    assert bench.main(["--shape", "64,128", "--types", "Q4_0,Q8_0", "--rows", "1,100", "--repeats", "1"]) == 0
    table = capsys.readouterr().out
    assert table.count("| Q4_0 |") == 2 and table.count("| Q8_0 |") == 2
    assert "| Q8_0 | 100 |" in table and table.rstrip().endswith("| — |")  # 100 rows: past the int8 kernel's 48
