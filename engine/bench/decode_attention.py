"""The native decode attention kernel over each KV cache format, against the float32 cache in the same process.

    python -m engine.bench.decode_attention [--seqs 32] [--context 1024] [--shapes smollm2,qwen3,gemma3,...]

For each model shape (query heads / KV heads / head size) and cache format: milliseconds of one decode step's
attention for one layer (best of --repeats) over a paged cache of --context tokens per sequence, the GB/s of
cache it reads, and the ratio to the float32 cache; where heads of 96, 128 or 256 values run in 512-bit registers
(a CPU with AVX-512), also the 8-wide way's milliseconds, timed in turn with it, and its time over the 512-bit's.
Ratios, not absolute times, are the point: this machine's speed varies. The CPU's features are printed above the
table.
"""

from __future__ import annotations

import argparse

import torch
from tqdm import tqdm

from engine.bench.gguf_linear import best_ms
from engine.ops import kv_format
from engine.ops.cpu_features import cpu_features
from engine.ops.decode_attention import (
    WIDE_HEAD_SIZES,
    decode_attention_native,
    store_rows,
    takes_wide,
    use_wide_attention,
    wide_attention,
)

# name -> (query heads, KV heads, head size): SmolLM2-135M, Qwen3-0.6B, Gemma-3-1B, LLaMA-3-8B, Phi-3-mini.
SHAPES = {
    "smollm2": (9, 3, 64),
    "qwen3": (16, 8, 128),
    "gemma3": (4, 1, 256),
    "llama3-8b": (32, 8, 128),
    "phi3": (32, 32, 96),
}
FORMATS = ("float32", "float16", "bfloat16", "int8")
BLOCK_SIZE = 16


def measure(
    shape: tuple[int, int, int], num_seqs: int, context: int, formats: tuple[str, ...], repeats: int
) -> list[dict[str, float | str]]:
    """One dict per format: ms per step, cache GB/s and the float32 cache's ms over this format's."""
    num_heads, num_kv_heads, head_dim = shape
    blocks_per_seq = context // BLOCK_SIZE
    num_blocks = num_seqs * blocks_per_seq
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(num_blocks * BLOCK_SIZE, num_kv_heads, head_dim, generator=generator)
    values = torch.randn(num_blocks * BLOCK_SIZE, num_kv_heads, head_dim, generator=generator)
    query = torch.randn(num_seqs, num_heads, head_dim, generator=generator)
    # Each sequence's blocks spread over the pool, as after a while of serving.
    tables = torch.randperm(num_blocks, generator=generator).view(num_seqs, blocks_per_seq)
    slots = torch.arange(num_blocks * BLOCK_SIZE)
    rows = []
    for name in formats:
        row = kv_format.row_length(name, head_dim)
        key_cache = torch.empty(num_blocks, BLOCK_SIZE, num_kv_heads, row, dtype=kv_format.KV_TORCH_DTYPES[name])
        value_cache = torch.empty_like(key_cache)
        store_rows(key_cache, keys, slots)
        store_rows(value_cache, values, slots)

        def step(key_cache=key_cache, value_cache=value_cache) -> None:
            decode_attention_native(query, key_cache, value_cache, tables, None, head_dim**-0.5)

        row = {"format": name}
        if takes_wide(head_dim):
            row["ms"], row["8-wide ms"] = _both_ways(step, repeats)
        else:
            row["ms"] = best_ms(step, repeats)
        row["GB/s"] = 2 * key_cache.nbytes / row["ms"] / 1e6
        rows.append(row)
    baseline = rows[0]["ms"]
    for row in rows:
        row["speed-up"] = baseline / row["ms"]
    return rows


def _both_ways(step, repeats: int) -> tuple[float, float]:
    """Best milliseconds of the 512-bit way and of the 8-wide way, timed in turn (the machine's speed drifts)."""
    best = {True: float("inf"), False: float("inf")}
    try:
        for _ in range(repeats):
            for wide in (True, False):
                use_wide_attention("decode_attention", wide)
                best[wide] = min(best[wide], best_ms(step, 1))
    finally:
        use_wide_attention("decode_attention", True)
    return best[True], best[False]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, default=32, help="sequences in the step")
    parser.add_argument("--context", type=int, default=1024, help="cached tokens per sequence (a multiple of 16)")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--formats", default=",".join(FORMATS), help="cache formats; the first is the baseline")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    print(f"CPU: {' '.join(cpu_features()) or 'unknown'}; {torch.get_num_threads()} threads")
    print(f"{args.seqs} sequences x {args.context} cached tokens, block size {BLOCK_SIZE}, one layer,", end=" ")
    print(f"best of {args.repeats}")
    print(
        f"heads of {', '.join(map(str, WIDE_HEAD_SIZES))} in 512-bit registers: {'on' if wide_attention() else 'off'}"
    )
    print("\n| shape (heads / KV heads / head size) | cache | ms | cache GB/s | × first | 8-wide ms | × 8-wide |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    formats = tuple(args.formats.split(","))
    for name in tqdm(args.shapes.split(","), desc="shapes", leave=False):
        shape = SHAPES[name]
        for row in measure(shape, args.seqs, args.context, formats, args.repeats):
            label = f"{name} ({shape[0]} / {shape[1]} / {shape[2]})"
            narrow = row.get("8-wide ms")
            versus = f"{narrow:.2f} | {narrow / row['ms']:.2f}×" if narrow else "— | —"
            cells = f"{row['ms']:.2f} | {row['GB/s']:.1f} | {row['speed-up']:.2f}× | {versus}"
            print(f"| {label} | {row['format']} | {cells} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
