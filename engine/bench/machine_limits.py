"""Physical limits of this machine for a model: what no server can beat here.

Decode at batch 1 reads every weight once per token, so tokens/s <= memory bandwidth / weight bytes.
Large batches are bound by arithmetic instead, so tokens/s <= matrix-product rate / FLOPs per token.
Both rates are measured here with torch; the model's sizes come from its GGUF file.

Usage: python -m engine.bench.machine_limits [--model NAME | --gguf PATH] [--context 174] [--json]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from engine.bench.gguf_file import gguf_path
from engine.hub.models_hub import DEFAULT_GENERATION_MODEL
from engine.ops.cpu_features import cpu_features

# --------------------------------------------------------------------------- machine rates


@dataclass(frozen=True)
class MachineRates:
    read_bandwidth_gbs: float  # GB/s (1e9) reading a large tensor once (torch.sum)
    copy_bandwidth_gbs: float  # GB/s counting read + write of a large copy
    matmul_fp32_gflops: float
    matmul_bf16_gflops: float
    num_threads: int
    cpu_flags: tuple[str, ...]  # the SIMD features that decide which kernels are fast (engine/ops/cpu_features.py)


def _best_time(fn: Callable[[], object], repeats: int, slow_s: float = 1.0) -> float:
    """Best of `repeats` timed calls after a warm-up (page faults, thread pool start, kernel selection).

    A warm-up slower than `slow_s` is the answer itself: a dtype with no fast kernel on this CPU (bf16
    without AVX-512 BF16 runs at about 1 GFLOP/s) would otherwise take minutes to time.
    """
    t = time.perf_counter()
    fn()
    best = time.perf_counter() - t
    if best > slow_s:
        return best
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _measure_bandwidth(buffer_mib: int, repeats: int) -> tuple[float, float]:
    """(read GB/s, copy GB/s) over a buffer far larger than the caches."""
    import torch

    src = torch.ones(buffer_mib * 2**20 // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    nbytes = src.numel() * src.element_size()
    read_t = _best_time(lambda: src.sum(), repeats)
    copy_t = _best_time(lambda: dst.copy_(src), repeats)
    return nbytes / read_t / 1e9, 2 * nbytes / copy_t / 1e9  # a copy reads and writes every byte


def measure_rates(buffer_mib: int = 512, matmul_n: int = 1024, repeats: int = 5) -> MachineRates:
    import torch

    read_gbs, copy_gbs = _measure_bandwidth(buffer_mib, repeats)
    rates = {}
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(matmul_n, matmul_n).to(dtype)
        b = torch.randn(matmul_n, matmul_n).to(dtype)
        t = _best_time(lambda a=a, b=b: torch.matmul(a, b), repeats)
        rates[dtype] = 2 * matmul_n**3 / t / 1e9
    return MachineRates(
        read_bandwidth_gbs=read_gbs,
        copy_bandwidth_gbs=copy_gbs,
        matmul_fp32_gflops=rates[torch.float32],
        matmul_bf16_gflops=rates[torch.bfloat16],
        num_threads=torch.get_num_threads(),
        cpu_flags=cpu_features(),
    )


# --------------------------------------------------------------------------- model sizes


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_params: int  # all weights in the file
    num_params_read_per_token: int  # weights a decode step streams from memory (embedding gather excluded)
    stored_bytes_read_per_token: int  # the same weights in the file's own (quantized) formats
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    def kv_bytes_per_token_step(self, context: int, bytes_per_value: int = 2) -> int:
        """K and V of `context` positions read by one decode step, all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * context * bytes_per_value

    def flops_per_token(self, context: int) -> int:
        """Matrix products (2 FLOPs per weight) plus attention scores and mixing over `context` positions."""
        return 2 * self.num_params_read_per_token + 4 * self.num_layers * self.num_heads * self.head_dim * context


def read_gguf_shape(path: Path) -> ModelShape:
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = _field(reader, "general.architecture")
    arch = bytes(arch).decode() if not isinstance(arch, str) else arch

    def meta(key: str) -> int:
        return int(_field(reader, f"{arch}.{key}")[0])

    names = {t.name for t in reader.tensors}
    tied = "output.weight" not in names  # the head reuses token_embd: it is then read in full every step
    num_params = sum(int(t.n_elements) for t in reader.tensors)
    read = [t for t in reader.tensors if tied or t.name != "token_embd.weight"]
    num_layers = meta("block_count")
    num_heads = meta("attention.head_count")
    hidden = meta("embedding_length")
    return ModelShape(
        name=path.name,
        num_params=num_params,
        num_params_read_per_token=sum(int(t.n_elements) for t in read),
        stored_bytes_read_per_token=sum(int(t.n_bytes) for t in read),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=meta("attention.head_count_kv"),
        head_dim=hidden // num_heads,
    )


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    if field is None:
        raise KeyError(f"GGUF has no {key}")
    return field.parts[field.data[0]]


# --------------------------------------------------------------------------- limits


@dataclass(frozen=True)
class Limit:
    what: str
    value: float  # tokens/s (or seconds for the prefill row)
    unit: str
    basis: str


def compute_limits(
    shape: ModelShape, rates: MachineRates, context: int = 174, prefill_tokens: int = 512
) -> list[Limit]:
    """Upper bounds on tokens/s (lower bound on prefill time) for this model on this machine."""
    bw = rates.read_bandwidth_gbs * 1e9
    kv = shape.kv_bytes_per_token_step(context)
    weights = {
        "bf16": 2 * shape.num_params_read_per_token,
        "int8": shape.num_params_read_per_token,
        "GGUF as stored": shape.stored_bytes_read_per_token,
    }
    limits = [
        Limit(
            f"decode, batch 1, {label} weights",
            bw / (nbytes + kv),
            "tok/s",
            f"{(nbytes + kv) / 1e6:.0f} MB per step / {rates.read_bandwidth_gbs:.1f} GB/s",
        )
        for label, nbytes in weights.items()
    ]
    flops = shape.flops_per_token(context)
    for label, gflops in (("fp32", rates.matmul_fp32_gflops), ("bf16", rates.matmul_bf16_gflops)):
        limits.append(
            Limit(
                f"large batch, {label} matmul",
                gflops * 1e9 / flops,
                "tok/s",
                f"{flops / 1e6:.0f} MFLOP per token / {gflops:.1f} GFLOP/s",
            )
        )
    prefill_flops = shape.flops_per_token(prefill_tokens // 2) * prefill_tokens  # mean context is half the prompt
    best_label, best_gflops = max(
        (("fp32", rates.matmul_fp32_gflops), ("bf16", rates.matmul_bf16_gflops)), key=lambda item: item[1]
    )
    limits.append(
        Limit(
            f"prefill {prefill_tokens} tokens, {best_label} matmul",
            prefill_flops / (best_gflops * 1e9),
            "s (min TTFT)",
            f"{prefill_flops / 1e9:.0f} GFLOP / {best_gflops:.1f} GFLOP/s",
        )
    )
    return limits


def markdown(shape: ModelShape, rates: MachineRates, limits: list[Limit]) -> str:
    lines = [
        (
            f"Machine: {rates.num_threads} threads, read bandwidth {rates.read_bandwidth_gbs:.1f} GB/s "
            f"(copy {rates.copy_bandwidth_gbs:.1f} GB/s), matmul {rates.matmul_fp32_gflops:.0f} GFLOP/s fp32, "
            f"{rates.matmul_bf16_gflops:.1f} GFLOP/s bf16; CPU flags: {' '.join(rates.cpu_flags) or 'unknown'}."
        ),
        (
            f"Model: {shape.name}, {shape.num_params / 1e6:.1f} M parameters, "
            f"{shape.num_params_read_per_token / 1e6:.1f} M read per decode step "
            f"({shape.stored_bytes_read_per_token / 1e6:.0f} MB as stored in the GGUF)."
        ),
        "",
        "| limit | value | basis |",
        "| --- | --- | --- |",
    ]
    for lim in limits:
        value = f"{lim.value:.2f} {lim.unit}" if lim.value < 10 else f"{lim.value:,.0f} {lim.unit}"
        lines.append(f"| {lim.what} | {value} | {lim.basis} |")
    return "\n".join(lines)


def measure(path: Path, context: int = 174) -> dict[str, Any]:
    """Measure the rates, read the model, and return everything as one JSON-ready dict (+ Markdown)."""
    shape = read_gguf_shape(path)
    rates = measure_rates()
    limits = compute_limits(shape, rates, context=context)
    return {
        "model": asdict(shape),
        "machine": asdict(rates),
        "context": context,
        "limits": [asdict(lim) for lim in limits],
        "markdown": markdown(shape, rates, limits),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_GENERATION_MODEL, help="model name (its GGUF is read)")
    parser.add_argument("--gguf", type=Path, default=None, help="model GGUF (instead of --model)")
    parser.add_argument("--context", type=int, default=174, help="positions attended per decode step (KV reads)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON instead of Markdown")
    args = parser.parse_args(argv)
    report = measure(args.gguf or gguf_path(args.model), args.context)
    print(json.dumps(report, indent=2) if args.json else report["markdown"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
