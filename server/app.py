"""create_app(config): the FastAPI app, its lifespan (models load in the background), its routers,
error handlers (server/errors.py) and middleware.

`app.state.kvserve` holds the one `ServerState` (server/state.py) the routes share: config,
metrics, engine (AsyncEngine, once loaded), embedder (AsyncEncoder, once loaded; None when no
embedding model is served), reranker (an AsyncEncoder over the Reranker, once loaded; None when no
rerank model is served), is_ready and load_error. Routes read it through `Depends(get_state)`;
code holding the app reads it with `state_of(app)`. Only the lifespan writes it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from engine import (
    AsyncEncoder,
    AsyncEngine,
    Embedder,
    LoadedGeneration,
    ModelLoadError,
    RequestLimits,
    Reranker,
    TextWorker,
    TorchWorker,
    load_generation,
)
from engine.config import EmbedderConfig, EngineConfig, RerankerConfig
from server.config import ServerConfig
from server.errors import install_error_handlers
from server.http.access import ApiKeys
from server.http.middleware import AdmissionMiddleware
from server.http.openapi import install_openapi
from server.openai.reasoning import think_tokens
from server.openai.text import RequestText
from server.playground import attention, kv_cache
from server.playground import routes as playground
from server.routes import (
    chat,
    completions,
    embeddings,
    health,
    messages,
    models,
    ollama,
    ollama_embed,
    ollama_models,
    rerank,
    responses,
    tokenize,
)
from server.state import ServerState, attach_state

logger = logging.getLogger(__name__)

EngineFactory = Callable[[EngineConfig], Any]
EmbedderFactory = Callable[[EmbedderConfig], Any]
RerankerFactory = Callable[[RerankerConfig], Any]


def _default_engine_factory(engine_config: EngineConfig) -> LoadedGeneration:
    return load_generation(engine_config)


def _default_embedder_factory(embedder_config: EmbedderConfig) -> Embedder:
    return Embedder(embedder_config)


def _default_reranker_factory(reranker_config: RerankerConfig) -> Reranker:
    return Reranker(reranker_config)


def create_app(
    config: ServerConfig,
    *,
    engine_factory: EngineFactory | None = None,
    embedder_factory: EmbedderFactory | None = None,
    reranker_factory: RerankerFactory | None = None,
    on_fatal: Callable[[BaseException], None] | None = None,
) -> FastAPI:
    """engine_factory(EngineConfig) -> an object with `.engine` (the LLMEngine) and `.tokenizer`
    (default: engine.load_generation, the loader the offline LLM uses too),
    embedder_factory(EmbedderConfig) -> Embedder (default: Embedder) and
    reranker_factory(RerankerConfig) -> Reranker (default: Reranker) run on the server's one torch
    worker (engine/serving/torch_worker.py), off the event loop so /health answers meanwhile.
    on_fatal(exc) is called when a model fails to load (the CLI stops the server with it).
    """
    engine_factory = engine_factory or _default_engine_factory
    embedder_factory = embedder_factory or _default_embedder_factory
    reranker_factory = reranker_factory or _default_reranker_factory

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        worker = TorchWorker()
        text_worker = TextWorker()
        load_task = asyncio.create_task(
            _load_models(state, engine_factory, embedder_factory, reranker_factory, on_fatal, worker, text_worker)
        )
        try:
            yield
        finally:
            if not load_task.done():
                load_task.cancel()
                await asyncio.gather(load_task, return_exceptions=True)
                state.shutdown.interrupted_load = True
            state.is_ready = False
            await stop_requests(state)
            await text_worker.stop()
            if state.shutdown.interrupted_load:
                # A model load cannot be interrupted (torch, file reads, a download): the stop does not
                # wait for it; the CLI ends the process without joining the torch thread.
                logger.info("kvserve stopped while loading its models")
            else:
                await worker.stop()  # waits (off the event loop) for the job still running, if any
                logger.info("kvserve stopped")

    app = FastAPI(title="kvserve", summary="OpenAI-compatible LLM inference server", lifespan=lifespan)
    state = ServerState(config=config)
    attach_state(app, state)

    for router in (
        completions.router,
        chat.router,
        responses.router,
        messages.router,
        ollama.router,
        ollama_models.router,
        ollama_embed.router,
        models.router,
        tokenize.router,
        health.router,
        embeddings.router,
        rerank.router,
    ):
        app.include_router(router)
    if config.playground:
        for router in (playground.router, attention.router, kv_cache.router):
            app.include_router(router)
    install_error_handlers(app)
    install_openapi(app)  # GET /openapi.json and /docs: every status, body and content type each route answers

    # Added last = outermost: CORS answers preflights before auth sees them.
    app.add_middleware(
        AdmissionMiddleware,
        is_ready=lambda: state.is_ready,
        shutdown=state.shutdown,
        api_keys=ApiKeys(config.api_keys, config.admin_api_keys, config.prefix_cache_scope),
        max_request_bytes=config.max_request_bytes,
        playground=config.playground,
    )
    if config.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.allowed_origins),
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["*"],
            expose_headers=["X-Request-Id"],
        )
    return app


async def stop_requests(state: ServerState) -> None:
    """Enter the stopping phase (server/shutdown.py) and stop the engine, the embedder and the reranker: every request
    still in them fails with EngineDeadError, which server/serving.py answers as 503 `shutting_down`
    (a stream: an error event, then `data: [DONE]`). Idempotent."""
    state.shutdown.begin_stopping()
    if state.engine is not None:
        await state.engine.stop()
    if state.embedder is not None:
        await state.embedder.stop()
    if state.reranker is not None:
        await state.reranker.stop()


async def _load_models(
    state: ServerState,
    engine_factory: EngineFactory,
    embedder_factory: EmbedderFactory,
    reranker_factory: RerankerFactory,
    on_fatal: Callable[[BaseException], None] | None,
    worker: TorchWorker,
    text_worker: TextWorker,
) -> None:
    config = state.config
    # Generation, embeddings and reranking are clients of one worker, with the same limits.
    limits = RequestLimits(config.max_queued_requests, config.request_timeout)
    try:
        logger.info("loading generation model %s", config.engine.model)
        generation = await worker.run(engine_factory, config.engine)
        # The loop detokenizes with the engine's tokenizer; the text worker encodes with its own copy.
        text_tokenizer = await text_worker.run(0, generation.tokenizer.copy)
        reasoning = think_tokens(config.reasoning_parser, generation.tokenizer.vocabulary())
        engine = AsyncEngine(generation.engine, generation.tokenizer, limits=limits)
        await engine.start(worker)
        state.text = RequestText(text_worker, text_tokenizer)
        state.reasoning = reasoning
        state.engine = engine
        if config.embedder is not None:
            logger.info("loading embedding model %s", config.embedder.model)
            embedder = AsyncEncoder(await worker.run(embedder_factory, config.embedder), limits=limits)
            await embedder.start(worker, text_worker)
            state.embedder = embedder
        if config.reranker is not None:
            logger.info("loading rerank model %s", config.reranker.model)
            reranker = AsyncEncoder(await worker.run(reranker_factory, config.reranker), limits=limits, what="rerank")
            await reranker.start(worker, text_worker)
            state.reranker = reranker
        state.is_ready = True
        logger.info("kvserve ready: serving %s", config.model_name)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        if isinstance(exc, ModelLoadError):
            # Refused for a reason the message gives whole (an architecture not served, a file that is
            # not a model): one line, no traceback.
            logger.error("model loading failed: %s", exc)
        else:
            logger.exception("model loading failed")
        state.load_error = f"model loading failed: {exc}"
        if on_fatal is not None:
            on_fatal(exc)
