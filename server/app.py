"""create_app(config): the FastAPI app, its lifespan (models load in the background), its routers,
error handlers (server/errors.py) and middleware.

`app.state.kvserve` holds the one `ServerState` (server/state.py) the routes share: config,
metrics, the model pool (server/catalogue/pool.py: every catalogue model, the defaults loaded at start,
the others on demand), is_ready and load_error. Routes read it through `Depends(get_state)`;
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
    Embedder,
    LoadedGeneration,
    ModelLoadError,
    Reranker,
    TextWorker,
    TorchWorker,
    load_generation,
)
from engine.config import EmbedderConfig, EngineConfig, RerankerConfig
from server.catalogue.pool import Factories, ModelPool
from server.config import ServerConfig
from server.errors import install_error_handlers
from server.http.access import ApiKeys
from server.http.middleware import AdmissionMiddleware
from server.http.openapi import install_openapi
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
    reranker_factory(RerankerConfig) -> Reranker (default: Reranker) run off the event loop so /health answers
    meanwhile: at start on the server's one torch worker (engine/serving/torch_worker.py), later (a model
    loaded on demand) on the pool's loader thread while the loaded models keep stepping.
    on_fatal(exc) is called when a default model fails to load (the CLI stops the server with it).
    """
    engine_factory = engine_factory or _default_engine_factory
    embedder_factory = embedder_factory or _default_embedder_factory
    reranker_factory = reranker_factory or _default_reranker_factory

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        worker = TorchWorker()
        text_worker = TextWorker()
        load_task = asyncio.create_task(_load_models(state, on_fatal, worker, text_worker))
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
    state.models = ModelPool(config, Factories(engine_factory, embedder_factory, reranker_factory))
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
    """Enter the stopping phase (server/shutdown.py) and stop every loaded model: every request still in one
    fails with EngineDeadError, which server/serving.py answers as 503 `shutting_down` (a stream: an error
    event, then `data: [DONE]`). Idempotent."""
    state.shutdown.begin_stopping()
    await state.models.stop()


async def _load_models(
    state: ServerState,
    on_fatal: Callable[[BaseException], None] | None,
    worker: TorchWorker,
    text_worker: TextWorker,
) -> None:
    try:
        await state.models.start(worker, text_worker)
        state.is_ready = True
        others = len(state.models.entries) - sum(entry.preload for entry in state.models.entries)
        more = f" (and {others} more model{'s' * (others != 1)} on demand)" if others else ""
        logger.info("kvserve ready: serving %s%s", state.models.entries[0].name, more)
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
