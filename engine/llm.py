"""Offline generation: load a model and its tokenizer, run prompts to completion in one thread.

`LLM` pairs the text-free engine core with the tokenizer and the same output
processor the server uses, so offline results (and the tests built on them)
see exactly the text and stop-string handling that streamed requests see.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.engine_core import LLMEngine
from engine.loader import load_generation
from engine.outputs import GenerationResult
from engine.params import SamplingParams
from engine.serving.output_processor import OutputProcessor, RequestTextState
from engine.text.tokenizer import Tokenizer


@dataclass
class LLM:
    """A loaded generation model: the engine core and the tokenizer that goes with it."""

    engine: LLMEngine
    tokenizer: Tokenizer

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        """Load the model, its tokenizer and its engine (engine/loader.py), on a thread that ends with the load.

        A thread that runs the native kernels keeps an OpenMP team while it lives; with a second team beside
        the one that steps, the runtime counts more threads than cores and makes every parallel region wait to
        be woken. Loaded on the caller's thread and generating on another (a web app's worker thread), decode
        steps of the default model took 8.7-9.3 ms instead of 3.6 on 2 cores."""
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-load") as loader:
            engine, tokenizer = loader.submit(load_generation, config).result()
        return cls(engine, tokenizer)

    def generate(
        self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[list[GenerationResult]]:
        """Every prompt's samples, in input order. Text prompts are encoded with the model's tokenizer."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        processor = OutputProcessor(self.tokenizer)
        texts: dict[str, RequestTextState] = {}
        request_ids = []
        for prompt, sampling in zip(prompts, params_list):
            prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            request_id = self.engine.add_request(prompt_ids, sampling)
            texts[request_id] = processor.new_request_text(prompt_ids, sampling)
            request_ids.append(request_id)
        results: dict[str, dict[int, GenerationResult]] = {rid: {} for rid in request_ids}
        prompt_logprobs: dict[str, list] = {}
        while self.engine.has_unfinished_requests():
            processed = processor.process(self.engine.step(), texts.get)
            for stopped in processed.stopped_samples:
                self.engine.stop_sample(stopped.request_id, stopped.index, stopped.stop_string)
            for out in processed.request_outputs:
                if out.prompt_logprobs is not None:
                    prompt_logprobs[out.request_id] = out.prompt_logprobs
                for completion in out.outputs:
                    slot = results[out.request_id].setdefault(
                        completion.index,
                        GenerationResult(out.request_id, completion.index, out.prompt_token_ids, [], "", ""),
                    )
                    slot.token_ids.extend(completion.token_ids)
                    slot.text += completion.text
                    if completion.logprobs is not None:
                        slot.logprobs = (slot.logprobs or []) + completion.logprobs
                    if completion.finish_reason:
                        slot.finish_reason = completion.finish_reason
        for rid, scored in prompt_logprobs.items():
            for result in results[rid].values():
                result.prompt_logprobs = scored
        return [[results[rid][i] for i in sorted(results[rid])] for rid in request_ids]
