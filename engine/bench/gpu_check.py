"""The GPU half of the checks, one program: the Triton kernels in 16 bits against the torch path, then throughput.

    python -m engine.bench.gpu_check [--model smollm2-135m-instruct] [--dry-run] [--bandwidth 4.8e12]

1. Triton kernels: random paged steps (decode and prefill, a window with sinks, grouped-query heads) with
   float16 and bfloat16 queries over caches of the same dtype and over int8 caches, each against
   `paged_attention_torch` in float32 over the values the same cache holds. Prints each case's largest
   error and fails past its tolerance. The dispatch (engine/attention/paged.py TRITON_CHECKED_DTYPES) takes
   a dtype's Triton kernels only once this has passed for it on a GPU.
2. Throughput of the engine on the model: prefill tokens/s of one prompt, decode tokens/s at 1, 32 and 128
   streams, each beside the memory-bandwidth roofline of a decode step (every weight byte and every
   stream's KV bytes read once per step at --bandwidth bytes/s: an H200's HBM3e is 4.8e12).

--dry-run runs the same steps on the CPU in tiny sizes: the kernels in Triton's interpreter (TRITON_INTERPRET=1,
set before triton is imported), 1 and 2 streams, a 16-token prompt. CI runs it (tests/engine/test_gpu_check.py)
so the program cannot rot between the GPU runs it is for. scripts/gpu_check.sh runs it with the GPU-marked tests.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

logger = logging.getLogger(__name__)

# Largest |error| allowed against the float32 torch path, by query dtype (the kernels accumulate in float32;
# these are the dtypes' own rounding of the output and of P before P @ V).
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 2e-2}


@dataclass(frozen=True)
class KernelCase:
    kernel: str  # "decode" or "prefill"
    query_dtype: torch.dtype
    cache_format: str  # a kv_format name
    max_error: float
    # False where the result cannot be trusted here: Triton's interpreter computes bfloat16 tl.dot wrongly
    # (the prefill kernel's products), so a dry run reports those cases without holding them to the tolerance.
    checkable: bool = True

    @property
    def passed(self) -> bool:
        return not self.checkable or self.max_error <= TOLERANCE[self.query_dtype]

    @property
    def verdict(self) -> str:
        if not self.checkable:
            return "not checkable in the interpreter"
        return "ok" if self.passed else "FAILED"


def _random_step(device: torch.device, decode: bool, gen: torch.Generator, head_dim: int, block_size: int):
    """(queries [T, 6, D] float32, keys and values caches float32, metadata): three sequences, 2 KV heads."""
    from engine.attention.metadata import build_attention_metadata
    from engine.attention.paged import write_kv

    totals = [70, 23, 41]
    counts = [1, 1, 1] if decode else [30, 23, 5]
    num_blocks = 1 + sum(-(-t // block_size) for t in totals)
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = []
    for total in totals:
        tables.append([order.pop() for _ in range(-(-total // block_size))])
    shape = (num_blocks, block_size, 2, head_dim)
    key_cache, value_cache = torch.zeros(shape), torch.zeros(shape)
    everything = build_attention_metadata([0] * 3, totals, tables, block_size, None, 0, torch.device("cpu"))
    write_kv(
        key_cache,
        value_cache,
        torch.randn(sum(totals), 2, head_dim, generator=gen),
        torch.randn(sum(totals), 2, head_dim, generator=gen),
        everything.slot_mapping,
    )
    starts = [t - c for t, c in zip(totals, counts)]
    meta = build_attention_metadata(starts, counts, tables, block_size, 32, 4, device)
    queries = torch.randn(sum(counts), 6, head_dim, generator=gen)
    return queries.to(device), key_cache.to(device), value_cache.to(device), meta


def check_kernels(device: torch.device, head_dim: int, block_size: int, interpreted: bool) -> list[KernelCase]:
    """Every (kernel, query dtype, cache format) case's largest error against the float32 torch path."""
    from engine.attention import triton_decode, triton_prefill
    from engine.attention.paged import paged_attention_torch
    from engine.ops import kv_format

    gen = torch.Generator().manual_seed(0)
    cases = []
    plan = [(k, d, f) for k in ("decode", "prefill") for d in TOLERANCE for f in ("same", "int8")]
    for kernel, dtype, cache_format in tqdm(plan, desc="Triton kernels", unit="case"):
        queries, keys, values, meta = _random_step(device, kernel == "decode", gen, head_dim, block_size)
        name = kv_format.format_of_dtype(dtype) if cache_format == "same" else cache_format
        caches = [kv_format.encode(cache, kv_format.KV_TORCH_DTYPES[name]) for cache in (keys, values)]
        held = [kv_format.read(cache, torch.float32) for cache in caches]
        scale = head_dim**-0.5
        expected = paged_attention_torch(queries, *held, meta, scale)
        run = triton_decode.triton_paged_decode if kernel == "decode" else triton_prefill.triton_paged_prefill
        out = run(queries.to(dtype), *caches, meta, scale)
        error = (out.float() - expected).abs().max().item()
        checkable = not (interpreted and kernel == "prefill" and dtype == torch.bfloat16)
        cases.append(KernelCase(kernel, dtype, name, error, checkable))
    return cases


@dataclass(frozen=True)
class ThroughputRow:
    name: str
    tokens_per_second: float
    roofline: float | None  # tokens/s if each step only read its bytes at the bandwidth; None for prefill


def _bytes_of(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def measure_throughput(
    model: str, device: str, streams: list[int], prefill_tokens: int, decode_steps: int, bandwidth: float
) -> list[ThroughputRow]:
    from engine.bench.bench_engine import _prompt, kvserve_decode, kvserve_prefill
    from engine.config import EngineConfig
    from engine.hub.models_hub import resolve_model
    from engine.llm import LLM

    dtype = "bfloat16" if device.startswith("cuda") else "float32"
    config = EngineConfig(model=resolve_model(model), device=device, dtype=dtype, max_num_seqs=max(streams))
    engine = LLM.from_config(config).engine
    weight_bytes = _bytes_of(engine.runner.model)
    rows = [
        ThroughputRow(
            f"prefill, {prefill_tokens} tokens", kvserve_prefill(engine, _prompt(engine, prefill_tokens, 0)), None
        )
    ]
    context = 64 + decode_steps // 2  # the mean context of a stream over the measured steps
    for count in tqdm(streams, desc="decode", unit="batch"):
        prompts = [_prompt(engine, 64, seed) for seed in range(count)]
        step_bytes = weight_bytes + count * context * engine.kv_bytes_per_token
        roofline = count * bandwidth / step_bytes
        rows.append(ThroughputRow(f"decode, {count} streams", kvserve_decode(engine, prompts, decode_steps), roofline))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dry-run", action="store_true", help="the same steps on the CPU, in tiny sizes")
    parser.add_argument("--bandwidth", type=float, default=4.8e12, help="memory bandwidth for the roofline, bytes/s")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels' modules import triton
    elif not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run on a CPU", file=sys.stderr)
        return 2
    device = "cpu" if args.dry_run else "cuda"
    started = time.perf_counter()
    print(f"# GPU check ({'dry run on the CPU' if args.dry_run else torch.cuda.get_device_name()})\n")
    head_dim = 32 if args.dry_run else 128
    cases = check_kernels(torch.device(device), head_dim, block_size=16, interpreted=args.dry_run)
    print("| kernel | query | cache | largest error vs float32 torch | tolerance | |")
    print("| --- | --- | --- | ---: | ---: | --- |")
    for case in cases:
        dtype = str(case.query_dtype).removeprefix("torch.")
        error, tolerance = f"{case.max_error:.2e}", f"{TOLERANCE[case.query_dtype]:.0e}"
        print(f"| {case.kernel} | {dtype} | {case.cache_format} | {error} | {tolerance} | {case.verdict} |")
    streams = [1, 2] if args.dry_run else [1, 32, 128]
    prefill_tokens, decode_steps = (16, 4) if args.dry_run else (512, 64)
    rows = measure_throughput(args.model, device, streams, prefill_tokens, decode_steps, args.bandwidth)
    print(f"\n| {args.model} on {device} | tokens/s | roofline at {args.bandwidth:.2g} B/s | share |")
    print("| --- | ---: | ---: | ---: |")
    for row in rows:
        roofline = f"{row.roofline:,.0f}" if row.roofline else ""
        share = f"{row.tokens_per_second / row.roofline:.1%}" if row.roofline else ""
        print(f"| {row.name} | {row.tokens_per_second:,.1f} | {roofline} | {share} |")
    print(f"\n{time.perf_counter() - started:.0f} s")
    return 0 if all(case.passed for case in cases) else 1


if __name__ == "__main__":
    raise SystemExit(main())
