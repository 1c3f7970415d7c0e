"""Greedy tokens and their logprobs from a checkpoint (a folder or a GGUF file) loaded as the engine loads it,
for tests that hold a GGUF file equal to the folder it was written from."""

from __future__ import annotations

from pathlib import Path

from engine.config import EngineConfig
from engine.engine_core import LLMEngine
from engine.models.weights import load_checkpoint
from engine.params import SamplingParams


def greedy_from_checkpoint(
    checkpoint: str | Path, prompts: list[list[int]], max_tokens: int = 8, **config: object
) -> list[tuple[list[int], list[float]]]:
    """(token ids, logprobs) of max_tokens greedy tokens after each prompt (token ids: no tokenizer needed).
    With quantization="gguf", a GGUF file's matrices stay in its blocks, as the server loads them."""
    model_config, state = load_checkpoint(checkpoint, keep_gguf_blocks=config.get("quantization") == "gguf")
    engine_config = EngineConfig(model=str(checkpoint), **{"num_blocks": 96, "block_size": 4, **config})
    return greedy_on(LLMEngine(engine_config, model_config, state, eos_token_ids=()), prompts, max_tokens)


def greedy_on(engine: LLMEngine, prompts: list[list[int]], max_tokens: int = 8) -> list[tuple[list[int], list[float]]]:
    """(token ids, logprobs) of max_tokens greedy tokens after each prompt, from an engine already built."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    done: dict[str, tuple[list[int], list[float]]] = {i: ([], []) for i in ids}
    while engine.has_unfinished_requests():
        for output in engine.step():  # each step's output holds the tokens it added
            tokens, logprobs = done[output.request_id]
            tokens.extend(output.outputs[0].token_ids)
            logprobs.extend(e.logprob for e in output.outputs[0].logprobs)
    return [done[i] for i in ids]
