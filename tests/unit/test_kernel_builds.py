"""The native kernels' instruction-set builds (engine/ops/loader.py ISA_BUILDS): the best one the CPU runs is
chosen, each compiles, and every build this CPU runs gives the baseline AVX2 build's numbers bit for bit
(VNNI's dot products are the same integer sums)."""

from __future__ import annotations

import ctypes
import logging

import pytest
import torch

from engine.ops import cpu_features, gguf_linear, loader
from engine.ops.gguf_linear import BLOCK_TYPES, pack
from tests.support.gguf_weights import block_weight
from tests.support.native_kernels import needs_kernels

VNNI_BUILDS = [isa for isa in loader.ISA_BUILDS if isa != loader.BASELINE_ISA]


@pytest.fixture
def features(monkeypatch):
    """Set the CPU features the loader sees; the choice is recomputed, and forgotten afterwards."""

    def use(*names: str, asked: str | None = None) -> str:
        monkeypatch.setattr(loader, "cpu_features", lambda: names)
        if asked is None:
            monkeypatch.delenv(loader.ISA_ENV, raising=False)
        else:
            monkeypatch.setenv(loader.ISA_ENV, asked)
        loader.chosen_isa.cache_clear()
        return loader.chosen_isa()

    yield use
    loader.chosen_isa.cache_clear()


def test_the_best_build_the_cpu_runs_is_chosen_and_an_asked_one_it_cannot_run_is_not(features, caplog):
    avx2 = ("avx2", "fma", "f16c")
    assert features(*avx2) == "avx2"
    assert features(*avx2, "avx512f", "avx512vl", "avx512_vnni") == "avx512vnni"
    assert features(*avx2, "avx512f", "avx512_vnni") == "avx2"  # VNNI on 256-bit registers needs VL
    assert features(*avx2, "avx_vnni") == "avxvnni"
    assert features(*avx2, "avx512f", "avx512vl", "avx512_vnni", "avx_vnni") == "avxvnni"
    assert features(*avx2, "avx512f", "avx512vl", "avx512_vnni", "avx_vnni", asked="avx2") == "avx2"
    assert features(*avx2, "avx512f", "avx512vl", "avx512_vnni", asked="avx512vnni") == "avx512vnni"
    zen4 = "flags\t\t: fpu sse avx2 fma f16c avx512f avx512bw avx512vl avx512_vnni avx512_bf16\n"
    assert features(*cpu_features.parse_cpuinfo(zen4)) == "avx512vnni"
    assert features(*cpu_features.parse_cpuinfo("flags : fpu avx f16c avx2 fma\n")) == "avx2"
    with caplog.at_level(logging.WARNING, logger=loader.__name__):
        assert features(*avx2, asked="avxvnni") == "avx2"
        assert features(*avx2, "avx_vnni", asked="sse2") == "avxvnni"
    assert [r.getMessage().split(" is not")[0] for r in caplog.records] == [
        f"{loader.ISA_ENV}=avxvnni",
        f"{loader.ISA_ENV}=sse2",
    ]
    names = {loader.library_path("gguf_blocks", isa).name for isa in loader.ISA_BUILDS}
    assert len(names) == len(loader.ISA_BUILDS)  # one cached file per build
    assert loader.library_path("gguf_blocks", "avx2").name.startswith("gguf_blocks-")  # the baseline's name as before
    assert loader.library_path("gguf_blocks", "avxvnni").name.startswith("gguf_blocks-avxvnni-")


def _gemm(build: ctypes.CDLL):
    function = build.kv_gguf_gemm
    function.argtypes = [loader.PTR, loader.I64, loader.I64, ctypes.c_int, loader.PTR, loader.PTR, loader.PTR]
    function.argtypes += [loader.I64, ctypes.c_int]
    function.restype = ctypes.c_int
    return function


@needs_kernels
@pytest.mark.parametrize("isa", VNNI_BUILDS)
def test_a_vnni_build_gives_the_avx2_builds_numbers_bit_for_bit(isa):
    built = loader.prebuild("gguf_blocks")
    assert loader.library_path("gguf_blocks", isa) in built  # every build compiles, whatever this CPU runs
    if not loader._runs_here(isa):
        pytest.skip(f"this CPU lacks {', '.join(loader.ISA_BUILDS[isa][1])} (the {isa} build compiled, not run)")
    libraries = [ctypes.CDLL(str(loader.library_path("gguf_blocks", b))) for b in ("avx2", isa)]
    assert [library.kv_gguf_uses_vnni() for library in libraries] == [0, 1]
    baseline, vnni = (_gemm(library) for library in libraries)
    for qtype in BLOCK_TYPES:
        in_features = 512 if BLOCK_TYPES[qtype][2] == 256 else 32 * 7  # 7 blocks: the file layout; 8: paired
        for width in (in_features, 512):
            weight = block_weight(qtype, 37, width, seed=1)[0]
            layouts = [pack(weight, interleaved=False), pack(weight)]
            # the 256-bit register-tiled kernel, where the AVX2 build takes the type (Q8_0, IQ4_NL: signed pairs)
            if libraries[0].kv_gguf_interleaved_narrow_takes(BLOCK_TYPES[qtype][0]):
                layouts.append(gguf_linear.interleave(weight, wide=False))
            x = torch.randn(9, width) * 3
            bias = torch.randn(37)
            for packed in layouts:
                outputs = []
                for gemm in (baseline, vnni):
                    y = torch.empty(9, 37)
                    args = (x.data_ptr(), 9, width, packed.kernel_type, packed.blocks.data_ptr(), bias.data_ptr())
                    assert gemm(*args, y.data_ptr(), 37, 2) == 0
                    outputs.append(y)
                assert torch.equal(outputs[0], outputs[1]), (qtype, width, packed.kernel_type)
                if gguf_linear.available() and loader.chosen_isa() == isa:  # the build the layers run
                    assert torch.equal(outputs[1], gguf_linear.gguf_linear_native(x, packed, bias))


@needs_kernels
@pytest.mark.parametrize("isa", VNNI_BUILDS)
def test_the_int8_kernels_vnni_build_gives_the_avx2_builds_numbers_bit_for_bit(isa):
    from engine.ops.int8_linear import quantize_int8

    loader.prebuild("int8_gemm")
    if not loader._runs_here(isa):
        pytest.skip(f"this CPU lacks {', '.join(loader.ISA_BUILDS[isa][1])}")
    quantized, scale = quantize_int8(torch.randn(45, 4100, generator=torch.Generator().manual_seed(2)))
    outputs = []
    for build in ("avx2", isa):
        gemm = ctypes.CDLL(str(loader.library_path("int8_gemm", build))).kv_int8_gemm
        gemm.argtypes = [loader.PTR, loader.I64, loader.I64, loader.PTR, loader.PTR, loader.PTR, loader.PTR]
        gemm.argtypes += [loader.I64, ctypes.c_int]
        for rows in (1, 5):  # one row streams each weight row alone; more go through the tiles
            x = torch.randn(rows, 4100, generator=torch.Generator().manual_seed(rows))
            y = torch.empty(rows, 45)
            weights = (quantized.data_ptr(), scale.data_ptr(), None)
            assert gemm(x.data_ptr(), rows, 4100, *weights, y.data_ptr(), 45, 2) == 0
            outputs.append(y)
    assert torch.equal(outputs[0], outputs[2]) and torch.equal(outputs[1], outputs[3])
