"""The GGUF block products against float32 BLAS and the int8 kernel, on one weight shape, same process.

    python -m engine.bench.gguf_linear [--shape 11264,2048] [--types Q4_0,Q4_1,Q8_0] [--rows 1,8,64,128,512]
                                       [--stream-mb 300]

For each block type and row count: the integer kernel (`gguf_linear_native`: the register-tiled one over
interleaved rows where the CPU has AVX-512 VNNI, and then the row kernel beside it), the tiled dequantize-and-BLAS
path (`gguf_linear_tiled`, in float32 and in bfloat16: `--prefill-dtype`), float32 BLAS on the dequantized
weight (the baseline) and the per-channel int8 kernel (up to its 48 rows), best of --repeats, with GMAC/s and
the speed-up over float32; with --stream-mb, the integer kernel again over that many MB of distinct copies of
each weight, which a cache cannot hold (GB/s of blocks read from memory). The default shape is a 1.1B LLaMA's
fused gate/up projection (TinyLlama's FFN 5632 x 2, hidden 2048). Weights are random normal, quantized by the
`gguf` package (K-quants and IQ4: random blocks of the type). Ratios, not absolute times, are the point: this
machine's speed varies. The CPU's features are printed above the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable

import numpy as np
import torch

from engine.bench.random_gguf import RANDOM_BLOCK_TYPES, random_blocks
from engine.ops import gguf_linear, int8_linear
from engine.ops.cpu_features import cpu_features
from engine.ops.gguf_linear import BlockWeight, pack


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of `repeats` calls of fn, in milliseconds, after one warm-up call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best * 1e3


def _time_paths(
    x: torch.Tensor,
    weight: gguf_linear.PackedWeight,
    row_weight: gguf_linear.PackedWeight,
    dequantized: torch.Tensor,
    quantized: torch.Tensor,
    scale: torch.Tensor,
    repeats: int,
) -> dict[str, float | None]:
    """Milliseconds of each path for the rows of x (None where a path does not run)."""
    fits_int8 = int8_linear.available() and x.shape[0] <= int8_linear.MAX_KERNEL_ROWS
    return {
        "kernel_ms": best_ms(lambda: gguf_linear.gguf_linear_native(x, weight, None), repeats)
        if gguf_linear.available()
        else None,
        "row_kernel_ms": best_ms(lambda: gguf_linear.gguf_linear_native(x, row_weight, None), repeats)
        if gguf_linear.available() and row_weight is not weight
        else None,
        "tiled_ms": best_ms(lambda: gguf_linear.gguf_linear_tiled(x, weight, None), repeats),
        "tiled_bf16_ms": best_ms(lambda: gguf_linear.gguf_linear_tiled(x, weight, None, torch.bfloat16), repeats),
        "float32_ms": best_ms(lambda: x @ dequantized.t(), repeats),
        "int8_ms": best_ms(lambda: int8_linear.int8_linear_native(x, quantized, scale, None), repeats)
        if fits_int8
        else None,
    }


def measure(
    out_features: int, in_features: int, qtypes: list[str], row_counts: list[int], repeats: int = 5
) -> list[dict[str, float | int | str | None]]:
    """One dict per (type, rows): milliseconds of each path (None where a path does not run)."""
    dense = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(0))
    quantized, scale = int8_linear.quantize_int8(dense)
    results = []
    for qtype in qtypes:
        blocks = _blocks(qtype, out_features, in_features, dense)
        weight = pack(blocks)
        row_weight = pack(blocks, interleaved=False) if weight.is_interleaved else weight
        dequantized = gguf_linear.dequantize_rows(weight)
        for rows in row_counts:
            row = {"type": qtype, "rows": rows, "macs": rows * out_features * in_features}
            x = torch.randn(rows, in_features)
            row.update(_time_paths(x, weight, row_weight, dequantized, quantized, scale, repeats))
            results.append(row)
    return results


def streamed(
    out_features: int, in_features: int, qtypes: list[str], row_counts: list[int], megabytes: int, repeats: int
) -> list[dict[str, float | int | str]]:
    """The integer kernel over distinct copies of each weight, `megabytes` of blocks in all, one after another as
    a decode step reads its layers: past the last-level cache, so the blocks come from memory (the table above
    reuses one weight, which stays in cache). One dict per (type, rows): ms for all copies and GB/s of blocks."""
    results = []
    for qtype in qtypes:
        one = pack(_blocks(qtype, out_features, in_features, torch.randn(out_features, in_features)))
        count = max(1, megabytes * 2**20 // one.blocks.nbytes)
        copies = [one] + [dataclasses.replace(one, blocks=one.blocks.clone()) for _ in range(count - 1)]
        total = sum(c.blocks.nbytes for c in copies)
        for rows in row_counts:
            x = torch.randn(rows, in_features)

            def run_all(x: torch.Tensor = x, copies: list = copies) -> None:
                for weight in copies:
                    gguf_linear.gguf_linear_native(x, weight, None)

            ms = best_ms(run_all, repeats)
            results.append({"type": qtype, "rows": rows, "copies": len(copies), "ms": ms, "gb_s": total / ms / 1e6})
    return results


def _blocks(qtype: str, out_features: int, in_features: int, dense: torch.Tensor) -> BlockWeight:
    import gguf

    if qtype in RANDOM_BLOCK_TYPES:  # types the gguf package cannot write: random blocks of the type
        raw = random_blocks(np.random.default_rng(0), qtype, out_features, in_features, 1.0)
    else:
        raw = gguf.quants.quantize(dense.numpy(), gguf.GGMLQuantizationType[qtype])
    return BlockWeight(qtype, torch.from_numpy(raw.copy()), in_features)


def markdown(results: list[dict[str, float | int | str | None]]) -> str:
    def cell(ms: float | None, macs: int, baseline: float) -> str:
        if ms is None:
            return "—"
        return f"{ms:.2f} ({macs / ms / 1e6:.0f} GMAC/s, {baseline / ms:.2f}×)"

    lines = [
        "| type | rows | GGUF kernel | GGUF row kernel | GGUF tiled | GGUF tiled bfloat16 | float32 BLAS "
        "| int8 kernel |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        macs, base = int(r["macs"]), float(r["float32_ms"])
        lines.append(
            f"| {r['type']} | {r['rows']} | {cell(r['kernel_ms'], macs, base)} "
            f"| {cell(r['row_kernel_ms'], macs, base)} | {cell(r['tiled_ms'], macs, base)} "
            f"| {cell(r['tiled_bf16_ms'], macs, base)} "
            f"| {cell(r['float32_ms'], macs, base)} | {cell(r['int8_ms'], macs, base)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="11264,2048", help="out_features,in_features of the weight")
    parser.add_argument("--types", default="Q4_0,Q4_1,Q8_0")
    parser.add_argument("--rows", default="1,8,64,128,512")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--stream-mb", type=int, default=0, help="also time the kernel over this many MB of distinct weights (0: not)"
    )
    args = parser.parse_args(argv)
    out_features, in_features = (int(v) for v in args.shape.split(","))
    qtypes = [t.strip() for t in args.types.split(",")]
    row_counts = [int(r) for r in args.rows.split(",")]
    results = measure(out_features, in_features, qtypes, row_counts, args.repeats)
    threads = torch.get_num_threads()
    print(f"Weight [{out_features}, {in_features}], {threads} threads, CPU {' '.join(cpu_features())}")
    print("ms (GMAC/s, × float32)\n")
    print(markdown(results))
    if args.stream_mb > 0 and gguf_linear.available():
        print(f"\nThe integer kernel over {args.stream_mb} MB of distinct copies of each weight (blocks from memory)\n")
        print("| type | rows | copies | ms | GB/s of blocks |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for r in streamed(out_features, in_features, qtypes, row_counts, args.stream_mb, args.repeats):
            print(f"| {r['type']} | {r['rows']} | {r['copies']} | {r['ms']:.2f} | {r['gb_s']:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
