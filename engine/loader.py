"""Checkpoint -> engine: find a generation model, resolve its quantization, load its weights and tokenizer,
and build the LLMEngine (with the draft model of draft speculation, when there is one).

The offline `LLM` (engine/llm.py) and the server both load through `load_generation`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import NamedTuple

import torch

from engine import quantization
from engine.config import EngineConfig, ModelConfig
from engine.engine_core import LLMEngine
from engine.errors import ModelLoadError
from engine.hub.models_hub import resolve_or_download
from engine.models import registry
from engine.models.weights import load_checkpoint
from engine.text.tokenizer import NO_TEMPLATE, Tokenizer, check_tokenizer_directory, read_chat_template

logger = logging.getLogger(__name__)


class LoadedGeneration(NamedTuple):
    """A loaded generation model: the engine core (its config has quantization resolved) and its tokenizer."""

    engine: LLMEngine
    tokenizer: Tokenizer


def load_generation(config: EngineConfig) -> LoadedGeneration:
    """Load `config.model` (an alias, a local directory or .gguf file, or a Hub id) and build its engine.

    Sets torch's thread count first when `config.num_threads` says one. Raises ModelLoadError (or
    ModelNotAvailableError) when the model cannot be found or read, or `config.tokenizer` /
    `config.chat_template` cannot be used (checked before the weights load where the files alone tell).
    """
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    chat_template = read_chat_template(config.chat_template) if config.chat_template else None
    if config.tokenizer:
        check_tokenizer_directory(config.tokenizer)
    path = resolve_or_download(config.model)
    started = time.monotonic()
    config, model_config, state_dict = _load_weights(config, path)
    tokenizer = _load_tokenizer(config, path, model_config, chat_template)
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
    return LoadedGeneration(engine, tokenizer)


def _load_weights(config: EngineConfig, path: Path) -> tuple[EngineConfig, ModelConfig, dict]:
    """The checkpoint's architecture and weights as `config`'s quantization resolves for it; the config
    comes back with that method named."""
    method = quantization.resolve(config, path)
    model_config, state_dict = load_checkpoint(path, keep_gguf_blocks=method.keeps_gguf_blocks)
    check_quantization_applies(model_config.architecture, method.name, path)
    return dataclasses.replace(config, quantization=method.name), model_config, state_dict


def check_quantization_applies(architecture: str, method_name: str, source: Path) -> None:
    """ModelLoadError unless the registry says `architecture` runs under quantization `method_name`."""
    entry = registry.lookup(architecture, source)
    if method_name not in entry.quantization_modes:
        raise ModelLoadError(
            f"{source}: {architecture} does not run under quantization {method_name!r}; "
            f"it runs under {', '.join(entry.quantization_modes)}"
        )


def _load_tokenizer(
    config: EngineConfig, path: Path, model_config: ModelConfig, chat_template: str | None
) -> Tokenizer:
    """The model's tokenizer, or config.tokenizer's in its place (refused when it has ids past the model's
    embedding table), with chat_template (config.chat_template's text) in place of its own template."""
    eos_token_ids = _config_eos_token_ids(model_config, path)
    if config.tokenizer:
        tokenizer = Tokenizer.from_directory(config.tokenizer, eos_token_ids)
        if tokenizer.id_limit > model_config.vocab_size:
            raise ModelLoadError(
                f"--tokenizer {config.tokenizer}: its ids go up to {tokenizer.id_limit - 1}, past {config.model}'s "
                f"embedding table of {model_config.vocab_size} tokens; it is not this model's tokenizer"
            )
    else:
        tokenizer = Tokenizer.from_path(path, eos_token_ids)
    if chat_template is not None:
        tokenizer.set_chat_template(chat_template, f"the file {config.chat_template}")
    if tokenizer.chat_template_source == NO_TEMPLATE:
        logger.info("%s has no chat template: chat requests are refused (--chat-template FILE gives one)", config.model)
    else:
        logger.info("chat template of %s: from %s", config.model, tokenizer.chat_template_source)
    return tokenizer


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
    draft_config, model_config, state_dict = _load_weights(draft_config, path)
    draft_vocabulary = Tokenizer.from_path(path).vocabulary()
    if draft_vocabulary != tokenizer.vocabulary():
        raise ModelLoadError(
            f"the draft model {config.speculative.draft_model} has a different tokenizer from {config.model}; "
            "speculative decoding needs a draft model with the same vocabulary"
        )
    logger.info("draft model %s (%s) loaded", config.speculative.draft_model, model_config.architecture)
    return draft_config, model_config, state_dict
