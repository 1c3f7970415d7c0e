"""Seeded generation workloads the engine tests share: prompts of random lengths, mixed greedy and
seeded sampling parameters."""

from __future__ import annotations

import random

from engine.llm import LLM
from engine.params import SamplingParams

WORDS = "the quick brown fox jumps over lazy dog hello world paged cache blocks keys values".split()


def random_prompts(llm: LLM, count: int, seed: int = 0) -> list[list[int]]:
    """`count` prompts of 2 to 40 words, as token ids."""
    rng = random.Random(seed)
    return [llm.tokenizer.encode(" ".join(rng.choices(WORDS, k=rng.randint(2, 40)))) for _ in range(count)]


def mixed_params(i: int, seeded: bool) -> SamplingParams:
    """Request i's parameters: 12 to 16 tokens, EOS ignored; greedy, or sampled with its own seed."""
    if seeded:
        return SamplingParams(
            temperature=0.9, top_p=0.95, top_k=50, seed=1000 + i, max_tokens=12 + i % 5, ignore_eos=True
        )
    return SamplingParams(temperature=0, max_tokens=12 + i % 5, ignore_eos=True)
