"""What scoring the prompt costs: a prefill with prompt logprobs against the same prefill without.

    python -m engine.bench.prompt_logprobs [--model smollm2-135m-instruct] [--num-tokens 1024] [--repeats 3]

Runs one request of `--num-tokens` prompt tokens and one generated token through the engine,
with prompt_logprobs=k for k in 0 and 5 and without (the baseline), in the same process, best of
`--repeats`, with the prefix cache off so every run computes the whole prompt. Prints a Markdown
table of seconds and the ratio to the baseline.
"""

from __future__ import annotations

import argparse
import random
import time

from tqdm import tqdm

from engine.config import EngineConfig
from engine.llm import LLM
from engine.params import SamplingParams


def best_seconds(llm: LLM, prompt_ids: list[int], params: SamplingParams, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        llm.generate([prompt_ids], params)
        best = min(best, time.perf_counter() - started)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--num-tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    config = EngineConfig(
        model=args.model,
        quantization=args.quantization,
        enable_prefix_caching=False,
        max_model_len=args.num_tokens + 16,
    )
    llm = LLM.from_config(config)
    rng = random.Random(0)
    prompt_ids = [rng.randrange(100, llm.engine.vocab_size) for _ in range(args.num_tokens)]
    cases = [("no prompt logprobs (baseline)", None), ("prompt_logprobs=0", 0), ("prompt_logprobs=5", 5)]
    llm.generate([prompt_ids[:64]], SamplingParams(max_tokens=1, prompt_logprobs=1))  # warm-up
    rows = []
    for name, k in tqdm(cases, desc="prefills"):
        params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=k)
        rows.append((name, best_seconds(llm, prompt_ids, params, args.repeats)))
    baseline = rows[0][1]
    quantization = llm.engine.config.quantization
    print(f"\nPrefill of {args.num_tokens} tokens, {args.model} ({quantization}), best of {args.repeats}\n")
    print("| request | seconds | vs baseline |\n| --- | ---: | ---: |")
    for name, seconds in rows:
        print(f"| {name} | {seconds:.3f} | {seconds / baseline:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
