"""What prefix-cache block hashing costs per 1,000 prompt tokens.

    python -m engine.bench.prefix_hash [--block-size 16] [--num-tokens 4096] [--repeats 50]

Prints a Markdown table: microseconds per 1,000 tokens to hash every full
block of a prompt with the sha256 chain the KV cache manager uses, beside
Python's built-in hash((parent, tokens)) chain as a baseline, in the same run.
Both include slicing the token list into per-block tuples, as the manager does.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

from engine.core.block_pool import hash_block_tokens, root_block_hash


def builtin_chain(token_ids: list[int], block_size: int) -> list[int]:
    hashes: list[int] = []
    parent: int | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start : start + block_size])))
        hashes.append(parent)
    return hashes


def sha256_chain(token_ids: list[int], block_size: int) -> list[bytes]:
    hashes: list[bytes] = []
    parent = root_block_hash(b"bench")
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, tuple(token_ids[start : start + block_size]))
        hashes.append(parent)
    return hashes


def us_per_1000_tokens(
    chain: Callable[[list[int], int], list], token_ids: list[int], block_size: int, repeats: int
) -> float:
    """Best of `repeats` runs over the whole prompt, scaled to 1,000 tokens."""
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        chain(token_ids, block_size)
        best = min(best, time.perf_counter() - started)
    return best * 1e6 * 1000 / len(token_ids)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args(argv)
    rng = random.Random(0)
    token_ids = [rng.randrange(300, 150_000) for _ in range(args.num_tokens)]
    rows = [
        (
            "hash((parent, tokens)) (baseline)",
            us_per_1000_tokens(builtin_chain, token_ids, args.block_size, args.repeats),
        ),
        ("sha256 chain", us_per_1000_tokens(sha256_chain, token_ids, args.block_size, args.repeats)),
    ]
    print(f"\nPrefix-cache block hashing: {args.num_tokens} tokens, block size {args.block_size}\n")
    print("| hash | µs per 1,000 tokens |\n| --- | ---: |")
    for name, us in rows:
        print(f"| {name} | {us:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
