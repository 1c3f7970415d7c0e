"""kvserve's engine, as its callers (the server, offline scripts) use it.

    from engine import LLM, SamplingParams, EngineConfig
    llm = LLM.from_config(EngineConfig(model="smollm2-135m-instruct"))
    results = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8))

The server runs the same engine under `AsyncEngine` (one step loop, per-request queues, text) and
embeddings and reranking under `AsyncEncoder`, on a `TorchWorker`; `engine.inspect` names what the
playground reads back (KV cache snapshots, attention weights). Everything else in the package is
internal: its layering is checked by tests/packaging/test_layering.py.

Each name is imported on first use (`__getattr__` below): `import engine.errors` or
`from engine import models_hub` runs this file first, and the light entry points (`kvserve pull`,
`kvserve models`) must start without importing torch, which the model, kernel and config modules do.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.config import EmbedderConfig, EngineConfig, RerankerConfig, SpeculativeConfig
    from engine.errors import (
        EngineDeadError,
        EngineStepError,
        ForeignTokenIdsError,
        InvalidRequestError,
        KVServeError,
        ModelLoadError,
        ModelNotAvailableError,
        PromptTooLongError,
        QueueFullError,
        RequestTimeoutError,
    )
    from engine.hub import models_hub
    from engine.hub.models_hub import DEFAULT_EMBEDDING_MODEL, DEFAULT_GENERATION_MODEL
    from engine.llm import LLM
    from engine.loader import LoadedGeneration, load_generation
    from engine.model_info import ModelInfo
    from engine.outputs import CompletionOutput, EngineStats, GenerationResult, RequestOutput, TokenLogprob
    from engine.params import SamplingParams
    from engine.pooling.embedder import Embedder, EmbedResult
    from engine.pooling.reranker import Reranker, RerankScores, TextPair, sigmoid
    from engine.serving.async_encoder import AsyncEncoder
    from engine.serving.async_engine import AsyncEngine, RequestStream
    from engine.serving.text_worker import TextWorker
    from engine.serving.torch_worker import RequestLimits, TorchWorker, wait_until
    from engine.structured.spec import StructuredOutput
    from engine.structured.thinking import ThinkingSpan
    from engine.text.tokenizer import Tokenizer

# Public name -> the module that defines it. A name equal to its module's last part is the module itself.
_EXPORTS: dict[str, str] = {
    # configs, frozen and validated on construction
    "EngineConfig": "engine.config",
    "EmbedderConfig": "engine.config",
    "RerankerConfig": "engine.config",
    "SpeculativeConfig": "engine.config",
    # errors: InvalidRequestError and its kinds are the caller's fault, the rest the engine's state
    "KVServeError": "engine.errors",
    "InvalidRequestError": "engine.errors",
    "PromptTooLongError": "engine.errors",
    "ForeignTokenIdsError": "engine.errors",
    "ModelLoadError": "engine.errors",
    "ModelNotAvailableError": "engine.errors",
    "QueueFullError": "engine.errors",
    "RequestTimeoutError": "engine.errors",
    "EngineDeadError": "engine.errors",
    "EngineStepError": "engine.errors",
    # the model cache: named models, `pull`, where a name resolves to
    "models_hub": "engine.hub.models_hub",
    "DEFAULT_GENERATION_MODEL": "engine.hub.models_hub",
    "DEFAULT_EMBEDDING_MODEL": "engine.hub.models_hub",
    # requests and what they produce
    "SamplingParams": "engine.params",
    "StructuredOutput": "engine.structured.spec",
    "ThinkingSpan": "engine.structured.thinking",
    "RequestOutput": "engine.outputs",
    "CompletionOutput": "engine.outputs",
    "TokenLogprob": "engine.outputs",
    "GenerationResult": "engine.outputs",
    "EngineStats": "engine.outputs",
    "ModelInfo": "engine.model_info",
    "Tokenizer": "engine.text.tokenizer",
    # generation: offline, and served
    "LLM": "engine.llm",
    "load_generation": "engine.loader",
    "LoadedGeneration": "engine.loader",
    "AsyncEngine": "engine.serving.async_engine",
    "RequestStream": "engine.serving.async_engine",
    # embeddings and reranking: the models, and the batcher that serves them
    "Embedder": "engine.pooling.embedder",
    "EmbedResult": "engine.pooling.embedder",
    "Reranker": "engine.pooling.reranker",
    "RerankScores": "engine.pooling.reranker",
    "TextPair": "engine.pooling.reranker",
    "sigmoid": "engine.pooling.reranker",
    "AsyncEncoder": "engine.serving.async_encoder",
    # the threads the served models run on, and the bounds on their queues
    "TorchWorker": "engine.serving.torch_worker",
    "RequestLimits": "engine.serving.torch_worker",
    "wait_until": "engine.serving.torch_worker",
    "TextWorker": "engine.serving.text_worker",
}

__all__ = [
    "DEFAULT_EMBEDDING_MODEL",
    "DEFAULT_GENERATION_MODEL",
    "LLM",
    "LoadedGeneration",
    "AsyncEncoder",
    "AsyncEngine",
    "CompletionOutput",
    "EmbedResult",
    "Embedder",
    "EmbedderConfig",
    "EngineConfig",
    "EngineDeadError",
    "EngineStats",
    "EngineStepError",
    "ForeignTokenIdsError",
    "GenerationResult",
    "InvalidRequestError",
    "KVServeError",
    "ModelInfo",
    "ModelLoadError",
    "ModelNotAvailableError",
    "PromptTooLongError",
    "QueueFullError",
    "RequestLimits",
    "RequestOutput",
    "RequestStream",
    "RequestTimeoutError",
    "RerankScores",
    "Reranker",
    "RerankerConfig",
    "SamplingParams",
    "SpeculativeConfig",
    "StructuredOutput",
    "TextPair",
    "TextWorker",
    "ThinkingSpan",
    "TokenLogprob",
    "Tokenizer",
    "TorchWorker",
    "load_generation",
    "models_hub",
    "sigmoid",
    "wait_until",
]


def __getattr__(name: str) -> Any:
    """Import the module that defines `name` (once: the value is kept in this module's namespace)."""
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(module_name)
    value = module if module_name.rsplit(".", 1)[-1] == name else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
