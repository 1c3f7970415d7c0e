"""Offline generation: load a model and its tokenizer, run prompts to completion in one thread.

`LLM` pairs the text-free engine core with the tokenizer and the same output
processor the server uses, so offline results (and the tests built on them)
see exactly the text and stop-string handling that streamed requests see.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import EngineConfig, ModelConfig
from engine.engine_core import LLMEngine
from engine.errors import ModelLoadError
from engine.hub.models_hub import resolve_or_download
from engine.models.weights import load_checkpoint
from engine.ops.int8_linear import resolve_quantization
from engine.outputs import GenerationResult
from engine.params import SamplingParams
from engine.serving.output_processor import OutputProcessor
from engine.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


def _config_eos_token_ids(model_config: ModelConfig, path: Path) -> tuple[int, ...]:
    """EOS ids that the model's config and generation_config.json name (the tokenizer adds its own)."""
    ids: list[int] = []
    sources = [getattr(model_config.hf_config, "eos_token_id", None)]
    gen_config = path / "generation_config.json" if path.is_dir() else None
    if gen_config is not None and gen_config.is_file():
        sources.append(json.loads(gen_config.read_text()).get("eos_token_id"))
    for source in sources:
        ids.extend(source if isinstance(source, list) else [source] if source is not None else [])
    return tuple(int(i) for i in ids)


def _load_draft_model(config: EngineConfig, tokenizer: Tokenizer) -> tuple[EngineConfig, ModelConfig, dict]:
    """The draft model of config.speculative: its config, architecture and weights, checked to share the
    target's tokenizer (a draft token must mean the same text to both models)."""
    assert config.speculative is not None and config.speculative.draft_model
    path = resolve_or_download(config.speculative.draft_model)
    draft_config = dataclasses.replace(
        config,
        model=config.speculative.draft_model,
        speculative=None,
        quantization=config.speculative.draft_quantization,
    )
    draft_config = dataclasses.replace(draft_config, quantization=resolve_quantization(draft_config, path))
    model_config, state_dict = load_checkpoint(path, keep_gguf_blocks=draft_config.quantization == "gguf")
    draft_vocabulary = Tokenizer.from_path(path).vocabulary()
    if draft_vocabulary != tokenizer.vocabulary():
        raise ModelLoadError(
            f"the draft model {config.speculative.draft_model} has a different tokenizer from {config.model}; "
            "speculative decoding needs a draft model with the same vocabulary"
        )
    logger.info("draft model %s (%s) loaded", config.speculative.draft_model, model_config.architecture)
    return draft_config, model_config, state_dict


@dataclass
class LLM:
    """A loaded generation model: the engine core and the tokenizer that goes with it."""

    engine: LLMEngine
    tokenizer: Tokenizer

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        path = resolve_or_download(config.model)
        config = dataclasses.replace(config, quantization=resolve_quantization(config, path))
        started = time.monotonic()
        model_config, state_dict = load_checkpoint(path, keep_gguf_blocks=config.quantization == "gguf")
        tokenizer = Tokenizer.from_path(path, _config_eos_token_ids(model_config, path))
        grammar = tokenizer.grammar_compiler(model_config.vocab_size)
        draft = _load_draft_model(config, tokenizer) if config.speculative and config.speculative.draft_model else None
        engine = LLMEngine(config, model_config, state_dict, tokenizer.eos_token_ids, grammar, draft)
        logger.info(
            "loaded %s (%s, quantization %s) in %.1f s",
            config.model,
            model_config.architecture,
            config.quantization,
            time.monotonic() - started,
        )
        return cls(engine, tokenizer)

    def generate(
        self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[list[GenerationResult]]:
        """Every prompt's samples, in input order. Text prompts are encoded with the model's tokenizer."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        processor = OutputProcessor(self.tokenizer)
        request_ids = []
        for prompt, sampling in zip(prompts, params_list):
            prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            request_id = self.engine.add_request(prompt_ids, sampling)
            processor.add_request(request_id, prompt_ids, sampling)
            request_ids.append(request_id)
        results: dict[str, dict[int, GenerationResult]] = {rid: {} for rid in request_ids}
        prompt_logprobs: dict[str, list] = {}
        while self.engine.has_unfinished_requests():
            processed = processor.process(self.engine.step())
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
