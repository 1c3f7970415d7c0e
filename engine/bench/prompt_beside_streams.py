"""A long prompt arriving while streams decode: its time to the first token and the streams' longest pause.

    python -m engine.bench.prompt_beside_streams [--model smollm2-135m-instruct] [--prompt-tokens 2048,4000]
        [--streams 8] [--rounds 3] [--threshold 512]

Two engines of the same model in this process, one with `--long-prefill-token-threshold` (a long prompt
computes at most that many tokens a step while other requests run) and one without the cap (the baseline):
each round, in each engine, `--streams` sequences start decoding, then one long prompt of random tokens
arrives (a new one each round, so nothing is cached) and is run to its first token. Every decoding stream
waits for each step, so the step that takes longest is the streams' longest pause. The engines alternate
within a round, so both see the same state of the machine. Prints a Markdown table of medians and the ratio
to the baseline.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass

from tqdm import tqdm

from engine.config import EngineConfig
from engine.engine_core import LLMEngine
from engine.llm import LLM
from engine.params import SamplingParams

WARM_STEPS = 4  # decode steps before the long prompt arrives: the streams are running, their prompts done


@dataclass(frozen=True)
class Arrival:
    """One long prompt's arrival: seconds to its first token, the longest step meanwhile, and the steps."""

    ttft: float
    longest_step: float
    steps: int


def prompt_beside_streams(engine: LLMEngine, prompt_ids: list[int], num_streams: int, rng: random.Random) -> Arrival:
    """Start num_streams decoding sequences, add the prompt, step until it has its first token, then abort
    the streams."""
    streams = [
        engine.add_request(
            [rng.randrange(100, engine.vocab_size) for _ in range(64)],
            SamplingParams(temperature=0, max_tokens=engine.max_model_len - 64, ignore_eos=True),
        )
        for _ in range(num_streams)
    ]
    for _ in range(WARM_STEPS):
        engine.step()
    started = time.perf_counter()
    request_id = engine.add_request(prompt_ids, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    steps: list[float] = []
    while True:
        step_started = time.perf_counter()
        outputs = engine.step()
        steps.append(time.perf_counter() - step_started)
        if any(out.request_id == request_id for out in outputs):
            break
    ttft = time.perf_counter() - started
    for stream in streams:
        engine.abort(stream)
    while engine.has_unfinished_requests():
        engine.step()
    return Arrival(ttft, max(steps), len(steps))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--prompt-tokens", default="2048,4000", help="comma-separated lengths of the long prompt")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threshold", type=int, default=512, help="the capped engine's threshold")
    args = parser.parse_args(argv)
    lengths = [int(n) for n in args.prompt_tokens.split(",")]

    def build(threshold: int) -> LLMEngine:
        config = EngineConfig(
            model=args.model,
            quantization=args.quantization,
            enable_prefix_caching=False,
            max_model_len=max(lengths) + 128,
            long_prefill_token_threshold=threshold,
        )
        return LLM.from_config(config).engine

    engines = {f"threshold {args.threshold}": build(args.threshold), "no cap (baseline)": build(0)}
    rng = random.Random(0)
    vocab = engines["no cap (baseline)"].vocab_size  # the same model in both
    results: dict[tuple[str, int], list[Arrival]] = {}
    for engine in engines.values():  # warm-up: the kernels' first calls
        prompt_beside_streams(engine, [rng.randrange(100, vocab) for _ in range(min(lengths))], 2, rng)
    with tqdm(total=args.rounds * len(lengths) * len(engines), desc="long prompts") as progress:
        for _ in range(args.rounds):
            for length in lengths:
                prompt_ids = [rng.randrange(100, vocab) for _ in range(length)]
                for name, engine in engines.items():
                    arrival = prompt_beside_streams(engine, prompt_ids, args.streams, rng)
                    results.setdefault((name, length), []).append(arrival)
                    progress.update()

    print(f"\nA long prompt beside {args.streams} decoding streams, {args.model}, median of {args.rounds} rounds\n")
    print("| prompt tokens | engine | steps | TTFT s | vs baseline | longest step s | vs baseline |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for length in lengths:
        base = results[("no cap (baseline)", length)]
        base_ttft = statistics.median(a.ttft for a in base)
        base_step = statistics.median(a.longest_step for a in base)
        for name in engines:
            runs = results[(name, length)]
            ttft = statistics.median(a.ttft for a in runs)
            step = statistics.median(a.longest_step for a in runs)
            print(
                f"| {length} | {name} | {runs[0].steps} | {ttft:.2f} | {ttft / base_ttft:.2f}x | "
                f"{step:.2f} | {step / base_step:.2f}x |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
