"""Greedy bursts against steps one at a time: decode time per token of the same greedy requests, in one process.

    python -m engine.bench.greedy_burst [--model smollm2-135m-instruct] [--burst 8] [--streams 1,4]
        [--rounds 5] [--output-tokens 128] [--kv-cache-memory-mib 256]

Two engines of the same model, one with `--greedy-burst N` (no time cap: every burst N steps) and the baseline
with `--greedy-burst 1`; each round, in each engine in turn, `--streams` greedy requests of 110 random prompt
tokens are prefilled and then decoded to `--output-tokens`, timed from the first decode step. The engines
alternate within a round, so both see the same state of the machine, and their tokens are checked equal.
Prints a Markdown table of medians and the ratio of the baseline's time to the bursts'.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from tqdm import tqdm

from engine.config import EngineConfig
from engine.engine_core import LLMEngine
from engine.llm import LLM
from engine.params import SamplingParams

PROMPT_TOKENS = 110


def decode(engine: LLMEngine, prompts: list[list[int]], output_tokens: int) -> tuple[float, list[list[int]]]:
    """(seconds from the first decode step to the last token, each request's tokens after the first)."""
    params = SamplingParams(temperature=0, max_tokens=output_tokens + 1, ignore_eos=True)
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    tokens: dict[str, list[int]] = {request_id: [] for request_id in ids}
    while any(not tokens[i] for i in ids):  # the prefill steps, to each request's first token
        for output in engine.step():
            tokens[output.request_id].extend(output.outputs[0].token_ids)
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens[output.request_id].extend(output.outputs[0].token_ids)
    return time.perf_counter() - started, [tokens[i][1:] for i in ids]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--burst", type=int, default=8, help="steps a burst runs (the bursting engine's)")
    parser.add_argument("--streams", default="1,4", help="comma-separated numbers of requests decoding together")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--kv-cache-memory-mib", type=int, default=256)
    args = parser.parse_args(argv)
    streams = [int(n) for n in args.streams.split(",")]

    def build(burst: int) -> LLMEngine:
        config = EngineConfig(
            model=args.model,
            quantization=args.quantization,
            max_model_len=PROMPT_TOKENS + args.output_tokens + 8,
            kv_cache_memory_bytes=args.kv_cache_memory_mib << 20,
            enable_prefix_caching=False,
            greedy_burst=burst,
            greedy_burst_ms=0,
        )
        return LLM.from_config(config).engine

    engines = {f"bursts of {args.burst}": build(args.burst), "a step at a time (baseline)": build(1)}
    if next(iter(engines.values())).runner.greedy_burst is None:
        parser.error(f"{args.model} cannot burst here (see the log's 'greedy bursts off' line)")
    rng = random.Random(0)
    vocab = next(iter(engines.values())).vocab_size

    def prompts(count: int) -> list[list[int]]:
        return [[rng.randrange(100, vocab) for _ in range(PROMPT_TOKENS)] for _ in range(count)]

    for engine in engines.values():  # warm-up: the kernels' first calls
        decode(engine, prompts(1), 8)
    seconds: dict[tuple[str, int], list[float]] = {}
    with tqdm(total=args.rounds * len(streams) * len(engines), desc="decode runs") as progress:
        for _ in range(args.rounds):
            for count in streams:
                batch = prompts(count)
                outputs = []
                for name, engine in engines.items():
                    elapsed, tokens = decode(engine, batch, args.output_tokens)
                    seconds.setdefault((name, count), []).append(elapsed)
                    outputs.append(tokens)
                    progress.update()
                if outputs[0] != outputs[1]:
                    raise AssertionError("the bursting engine's tokens differ from the baseline's")

    print(f"\nGreedy decode, {args.model}, {args.output_tokens} tokens a request, median of {args.rounds} rounds\n")
    print("| requests | engine | ms a token (per request) | baseline / this |")
    print("| ---: | --- | ---: | ---: |")
    for count in streams:
        base = statistics.median(seconds[("a step at a time (baseline)", count)])
        for name in engines:
            median = statistics.median(seconds[(name, count)])
            print(f"| {count} | {name} | {median / args.output_tokens * 1e3:.2f} | {base / median:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
