"""Weight-only int8: the AVX2 kernel against the plain reference, and the engine in int8; the quantization
modes, resolve() and the layers' kernel weights (engine/quantization/)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from engine import quantization
from engine.config import CPU_FLOAT32_QUANTIZATIONS, QUANTIZATION_MODES, EngineConfig, SpeculativeConfig
from engine.llm import LLM
from engine.ops.int8_linear import (
    MAX_KERNEL_ROWS,
    available,
    dequantize_int8,
    int8_linear_native,
    int8_linear_reference,
    int8_linear_torch,
    quantize_int8,
)
from engine.params import SamplingParams
from engine.quantization import INT8_PER_CHANNEL, KernelWeight, kernel_weight
from engine.quantization.int8 import Int8Linear, quantize_linears
from tests.support.native_kernels import KERNELS_EXPECTED, needs_kernels


def _reference64(x, quantized, scale, bias):
    return int8_linear_reference(x.double(), quantized, scale.double(), None if bias is None else bias.double())


def test_quantize_rounds_each_channel_to_its_scale():
    weight = torch.randn(33, 70)
    weight[5] = 0
    quantized, scale = quantize_int8(weight)
    assert quantized.dtype == torch.int8 and quantized.abs().max() <= 127
    assert scale[5] == 1 and (quantized[5] == 0).all()
    error = (dequantize_int8(quantized, scale) - weight).abs()
    assert (error <= scale[:, None] / 2 + 1e-7).all()


def test_kernel_builds_where_it_should():
    # A machine with gcc and AVX2 (CI, this project's laptops) must not silently fall back.
    assert available() == KERNELS_EXPECTED


@needs_kernels
@pytest.mark.parametrize(
    "rows,out_features,in_features",
    [(1, 7, 13), (1, 1536, 576), (1, 5, 600), (2, 9, 576), (3, 576, 1536), (5, 33, 100), (16, 40, 17), (48, 130, 64)],
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_matches_reference(rows, out_features, in_features, with_bias):
    torch.manual_seed(rows * 1000 + out_features)
    linear = nn.Linear(in_features, out_features, bias=with_bias)
    layer = Int8Linear(linear)
    x = torch.randn(rows, in_features) * 3
    got = int8_linear_native(x, layer.quantized, layer.scale, layer.bias)
    expected = _reference64(x, layer.quantized, layer.scale, layer.bias)
    # The kernel rounds each activation row to int16: relative error ~1e-5 of the row's products.
    assert (got.double() - expected).abs().max() <= 1e-4 * expected.abs().max()


@needs_kernels
def test_kernel_rows_do_not_depend_on_each_other():
    torch.manual_seed(1)
    layer = Int8Linear(nn.Linear(300, 45))
    x = torch.randn(11, 300)
    x[3] *= 1000  # a row with a far larger scale must not change its neighbours
    together = int8_linear_native(x, layer.quantized, layer.scale, layer.bias)
    for i in range(11):
        alone = int8_linear_native(x[i : i + 1], layer.quantized, layer.scale, layer.bias)
        assert torch.equal(together[i], alone[0])


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2], ids=["row path", "tile path"])
def test_kernel_long_rows_do_not_overflow_int32(rows):
    # 20,000 products of 32767 * 127 sum to ~8e10: int32 accumulators must be flushed on the way.
    in_features = 20000
    quantized = torch.full((5, in_features), 127, dtype=torch.int8)
    scale = torch.ones(5)
    x = torch.ones(rows, in_features)
    got = int8_linear_native(x, quantized, scale, None)
    assert torch.allclose(got, torch.full((rows, 5), 127.0 * in_features), rtol=1e-6)


@needs_kernels
def test_small_and_large_batches_compute_the_same_model():
    torch.manual_seed(2)
    layer = Int8Linear(nn.Linear(96, 64))
    x = torch.randn(MAX_KERNEL_ROWS + 10, 96)
    large = layer(x)  # float32 BLAS with the kernel's arithmetic
    small = torch.cat([layer(x[i : i + 1]) for i in range(x.shape[0])])  # the kernel
    # Same int16-rounded rows, same integer weights: only float32 summation order differs.
    assert (large - small).abs().max() <= 1e-6 * large.abs().max()
    expected = _reference64(x, layer.quantized, layer.scale, layer.bias)
    assert (large.double() - expected).abs().max() <= 1e-4 * expected.abs().max()


def test_torch_path_matches_reference_without_the_kernel():
    torch.manual_seed(3)
    layer = Int8Linear(nn.Linear(50, 20))
    x = torch.randn(7, 50)
    got = int8_linear_torch(x, layer.dequantized, layer.bias)
    expected = _reference64(x, layer.quantized, layer.scale, layer.bias)
    assert (got.double() - expected).abs().max() <= 1e-4 * expected.abs().max()


def test_quantize_linears_replaces_every_linear():
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.ReLU(), nn.Linear(8, 4)))
    assert quantize_linears(model) == 2
    assert isinstance(model[0], Int8Linear) and isinstance(model[1][1], Int8Linear)
    assert model(torch.randn(3, 8)).shape == (3, 4)


def _resolved(gguf_or_folder: Path, **config) -> str:
    return quantization.resolve(EngineConfig(model="m", **config), gguf_or_folder).name


def test_auto_means_the_gguf_blocks_for_gguf_on_cpu_float32():
    gguf, folder = Path("model.Q4_1.gguf"), Path("some-model")
    assert _resolved(gguf, quantization="auto") == "gguf"
    assert _resolved(gguf, quantization="int8") == "int8"
    with pytest.raises(ValueError, match="needs a .gguf"):
        _resolved(folder, quantization="gguf")
    with pytest.raises(ValueError, match="gguf runs on CPU"):
        EngineConfig(model="m", quantization="gguf", device="cuda")
    assert _resolved(folder, quantization="auto") == "none"
    assert _resolved(gguf, quantization="auto", dtype="bfloat16") == "none"
    assert _resolved(gguf, quantization="none") == "none"
    with pytest.raises(ValueError, match="int8 runs on CPU"):
        EngineConfig(model="m", quantization="int8", dtype="bfloat16")
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(model="m", quantization="int4")


def test_the_cpu_features_say_where_bfloat16_runs_and_the_prefill_dtype_is_float32_by_default():
    from engine.ops import cpu_features

    zen4 = "processor : 0\nflags\t\t: fpu sse avx2 fma avx512f avx512bw avx512vl avx512_vnni avx512_bf16\nbugs : x\n"
    haswell = "flags : fpu avx f16c avx2 fma\n"
    assert cpu_features.parse_cpuinfo(zen4) == (
        "avx2",
        "fma",
        "avx512f",
        "avx512bw",
        "avx512vl",
        "avx512_vnni",
        "avx512_bf16",
    )
    assert cpu_features.has_bf16_products(cpu_features.parse_cpuinfo(zen4))
    assert not cpu_features.has_bf16_products(cpu_features.parse_cpuinfo(haswell))
    assert cpu_features.has_bf16_products(("amx_tile", "amx_bf16"))
    # which of them VNNI builds need: tests/unit/test_kernel_builds.py (the loader's ISA_BUILDS)
    assert set(cpu_features.cpu_features()) <= set(cpu_features.KNOWN)

    assert EngineConfig(model="m").prefill_dtype == "float32"  # the decode kernel's numbers by default
    # applied to a model's GGUF layers, with its warning: tests/unit/test_gguf_linear.py
    with pytest.raises(ValueError, match="prefill_dtype must be one of"):
        EngineConfig(model="m", prefill_dtype="float16")


def test_the_method_table_has_one_entry_per_mode_config_accepts():
    assert quantization.MODES == QUANTIZATION_MODES == ("none", "int8", "gguf", "auto")
    assert (*quantization.METHODS, quantization.AUTO) == QUANTIZATION_MODES
    table = {name: (m.keeps_gguf_blocks, m.needs_gguf_file) for name, m in quantization.METHODS.items()}
    assert table == {"none": (False, False), "int8": (False, False), "gguf": (True, True)}
    assert quantization.method("gguf").layer.__name__ == "GgufLinear"
    assert quantization.method("int8").layer is Int8Linear and quantization.method("none").layer is None
    with pytest.raises(ValueError, match="auto names no method"):
        quantization.method("auto")
    with pytest.raises(ValueError, match="draft quantization must be one of"):
        SpeculativeConfig(draft_quantization="int4")
    # the methods with a layer of their own run on CPU in float32 only; none and auto run anywhere
    for name, entry in quantization.METHODS.items():
        assert (name in CPU_FLOAT32_QUANTIZATIONS) == (entry.layer is not None)
    assert EngineConfig(model="m", device="cuda", dtype="bfloat16", quantization="auto").quantization == "auto"
    assert _resolved(Path("model.gguf"), device="cuda", dtype="bfloat16", quantization="auto") == "none"


def test_each_method_replaces_the_linears_it_owns():
    def model() -> nn.Module:
        return nn.Sequential(nn.Linear(8, 8), nn.Embedding(5, 8), nn.Linear(8, 4))

    untouched = model()
    assert quantization.method("none").quantize_model(untouched) is None
    assert isinstance(untouched[0], nn.Linear) and not isinstance(untouched[0], Int8Linear)
    int8_model = model()
    assert quantization.method("int8").quantize_model(int8_model) == "int8 2 linear layers"
    assert isinstance(int8_model[2], Int8Linear) and isinstance(int8_model[1], nn.Embedding)
    # gguf: no layer here came from blocks, so every linear becomes int8
    gguf_model = model()
    line = quantization.method("gguf").quantize_model(gguf_model)
    assert line == "GGUF blocks none; int8 2 linear layers 0.0 MiB (with float32 copies for prefill)"


def test_int8_layer_tells_the_fused_kernel_its_weight():
    layer = Int8Linear(nn.Linear(16, 6))
    weight = kernel_weight(layer)
    assert weight == KernelWeight(
        INT8_PER_CHANNEL, layer.quantized.data_ptr(), layer.scale.data_ptr(), layer.bias.data_ptr(), 6
    )
    assert kernel_weight(Int8Linear(nn.Linear(16, 6, bias=False))).bias is None
    assert kernel_weight(nn.Linear(16, 6)) is None  # float weights: the kernel reads only quantized ones
    assert quantization.native_linear_ops(nn.Sequential(layer)) == (("int8_linear",) if available() else ())
    assert quantization.native_linear_ops(nn.Sequential(nn.Linear(2, 2))) == ()


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_int8_engine_batched_equals_alone(tiny_llama_dir, seeded):
    engine = LLM.from_config(
        EngineConfig(model=tiny_llama_dir, block_size=8, max_num_batched_tokens=64, quantization="int8")
    )
    words = "the quick brown fox jumps over lazy dog hello world".split()
    prompts = [engine.tokenizer.encode(" ".join(words[: 2 + i % 9] * (1 + i % 3))) for i in range(12)]
    params = [
        SamplingParams(temperature=0.9 if seeded else 0, seed=i, max_tokens=10 + i % 4, ignore_eos=True)
        for i in range(12)
    ]
    together = engine.generate(prompts, params)
    alone = [engine.generate([p], [sp])[0] for p, sp in zip(prompts, params)]
    assert [t[0].token_ids for t in together] == [a[0].token_ids for a in alone]
    assert engine.engine.stats().num_used_blocks == 0


def test_int8_engine_logits_stay_close_to_float32(tiny_llama_dir):
    float_engine = LLM.from_config(EngineConfig(model=tiny_llama_dir))
    int8_engine = LLM.from_config(EngineConfig(model=tiny_llama_dir, quantization="int8"))
    prompt = float_engine.tokenizer.encode("the quick brown fox jumps over the lazy dog")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
    expected = float_engine.generate([prompt], params)[0][0]
    got = int8_engine.generate([prompt], params)[0][0]
    # Tiny random weights have no outliers, so per-channel int8 keeps greedy choices here.
    assert got.token_ids == expected.token_ids


def test_rounding_rows_matches_the_kernel_grid_in_torch():
    from engine.ops.int8_linear import round_rows_int16

    torch.manual_seed(4)
    x = torch.randn(9, 70) * torch.logspace(-3, 3, 9)[:, None]
    x[4] = 0
    amax = x.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 32767.0, torch.ones_like(amax))
    expected = torch.round(x * (1.0 / scale)).clamp(-32767, 32767) * scale
    assert torch.equal(round_rows_int16(x), expected)
