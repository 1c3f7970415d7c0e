"""What structured output costs: grammar-mask time per step, and output tokens/s with a JSON schema
on every request vs the same workload unconstrained, in one run on one engine.

    python -m engine.bench.structured [--model smollm2-135m-instruct] [--batches 1 32] [--max-tokens 64]

Each batch size runs the same prompts twice, greedy: unconstrained, then with the JSON schema below
on every request (`SamplingParams.structured`). Output tokens/s counts the tokens each run really
generated (a schema's output ends when its JSON closes). The mask cost is timed directly:
`apply_grammar_masks` over that many fresh matchers, on logits as wide as the model's vocabulary.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from tqdm import tqdm

from engine.config import EngineConfig
from engine.llm import LLM
from engine.params import SamplingParams
from engine.structured.masks import apply_grammar_masks
from engine.structured.spec import StructuredOutput

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "year": {"type": "integer"},
        "genres": {"type": "array", "items": {"enum": ["drama", "comedy", "action", "documentary"]}},
        "summary": {"type": "string"},
    },
    "required": ["title", "year", "genres", "summary"],
}
TOPICS = ["a film about the sea", "a comedy set in Paris", "a documentary on bees", "an action film in space"]


def tokens_per_second(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, int]:
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    num_tokens = sum(len(sample.token_ids) for samples in results for sample in samples)
    return num_tokens / elapsed, num_tokens


def mask_ms(llm: LLM, spec: StructuredOutput, batch: int, repeats: int = 20) -> float:
    grammar = llm.engine.grammar
    assert grammar is not None
    matchers = [grammar.matcher(spec) for _ in range(batch)]
    logits = torch.zeros(batch, llm.engine.vocab_size)
    apply_grammar_masks(logits, matchers, llm.engine.eos_token_ids)  # the lexer is built on first use
    start = time.perf_counter()
    for _ in range(repeats):
        apply_grammar_masks(logits, matchers, llm.engine.eos_token_ids)
    return (time.perf_counter() - start) / repeats * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    llm = LLM.from_config(EngineConfig(model=args.model, quantization="auto"))  # as `kvserve serve` loads it
    spec = StructuredOutput(json=json.dumps(SCHEMA))
    rows = []
    for batch in tqdm(args.batches, desc="batch sizes"):
        texts = [f"Describe {TOPICS[i % len(TOPICS)]} as JSON (request {i})." for i in range(batch)]
        prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
        free = SamplingParams(temperature=0, max_tokens=args.max_tokens)
        tokens_per_second(llm, prompts[:1], free)  # warm-up
        free_tps, free_tokens = tokens_per_second(llm, prompts, free)
        constrained = SamplingParams(temperature=0, max_tokens=args.max_tokens, structured=spec)
        json_tps, json_tokens = tokens_per_second(llm, prompts, constrained)
        rows.append((batch, free_tps, free_tokens, json_tps, json_tokens, mask_ms(llm, spec, batch)))
    print("| batch | unconstrained tok/s | JSON schema tok/s | ratio | tokens (free / JSON) | mask ms per step |")
    print("| --- | --- | --- | --- | --- | --- |")
    for batch, free_tps, free_tokens, json_tps, json_tokens, ms in rows:
        print(
            f"| {batch} | {free_tps:.1f} | {json_tps:.1f} | {json_tps / free_tps:.2f}x | "
            f"{free_tokens} / {json_tokens} | {ms:.2f} |"
        )


if __name__ == "__main__":
    main()
