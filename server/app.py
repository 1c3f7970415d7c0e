"""create_app(config): the FastAPI app, its lifespan (models load in the background) and error handlers.

app.state holds everything the routes share: config, engine (AsyncEngine), embedder
(AsyncEmbedder or None), metrics, is_ready, load_error.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.config import EmbedderConfig, EngineConfig
from engine.errors import (
    EngineDeadError,
    EngineStepError,
    InvalidRequestError,
    KVServeError,
    QueueFullError,
    RequestTimeoutError,
)
from engine.serving.async_engine import AsyncEngine
from engine.serving.torch_thread import single_torch_thread
from server.config import ServerConfig
from server.errors import APIError
from server.metrics import ServerMetrics
from server.middleware import KVServeMiddleware
from server.routes import embeddings as embedding_routes
from server.routes import native, openai

logger = logging.getLogger(__name__)

EngineFactory = Callable[[EngineConfig], Any]
EmbedderFactory = Callable[[EmbedderConfig], Any]


def _default_engine_factory(engine_config: EngineConfig) -> Any:
    from engine.core.llm_engine import LLMEngine

    return LLMEngine.from_config(engine_config)


def _default_embedder_factory(embedder_config: EmbedderConfig) -> Any:
    from engine.serving.async_embedder import AsyncEmbedder

    return AsyncEmbedder.from_config(embedder_config)


def create_app(
    config: ServerConfig,
    *,
    engine_factory: EngineFactory | None = None,
    embedder_factory: EmbedderFactory | None = None,
    on_fatal: Callable[[BaseException], None] | None = None,
) -> FastAPI:
    """engine_factory(EngineConfig) -> LLMEngine (default: LLMEngine.from_config) and
    embedder_factory(EmbedderConfig) -> AsyncEmbedder (default: AsyncEmbedder.from_config) run on the
    server's one torch thread (engine/serving/torch_thread.py), off the event loop so /health answers meanwhile.
    on_fatal(exc) is called when a model fails to load (the CLI stops the server with it).
    """
    engine_factory = engine_factory or _default_engine_factory
    embedder_factory = embedder_factory or _default_embedder_factory

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        torch_thread = single_torch_thread()
        load_task = asyncio.create_task(_load_models(app, engine_factory, embedder_factory, on_fatal, torch_thread))
        try:
            yield
        finally:
            if not load_task.done():
                load_task.cancel()
                await asyncio.gather(load_task, return_exceptions=True)
            app.state.is_ready = False
            if app.state.engine is not None:
                await app.state.engine.stop()
            if app.state.embedder is not None:
                await app.state.embedder.stop()
            # Waits for a job still running (a model load cancelled above), off the event loop.
            await asyncio.get_running_loop().run_in_executor(None, torch_thread.shutdown, True)
            logger.info("kvserve stopped")

    app = FastAPI(title="kvserve", summary="OpenAI-compatible LLM inference server", lifespan=lifespan)
    app.state.config = config
    app.state.engine = None
    app.state.embedder = None
    app.state.is_ready = False
    app.state.load_error = None
    app.state.metrics = ServerMetrics(
        config.model_name, lambda: app.state.engine.stats() if app.state.engine is not None else None
    )

    app.include_router(openai.router)
    app.include_router(native.router)
    app.include_router(embedding_routes.router)
    _install_error_handlers(app)

    # Added last = outermost: CORS answers preflights before auth sees them.
    app.add_middleware(
        KVServeMiddleware,
        is_ready=lambda: app.state.is_ready,
        api_key=config.api_key,
        max_request_bytes=config.max_request_bytes,
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


async def _load_models(
    app: FastAPI,
    engine_factory: EngineFactory,
    embedder_factory: EmbedderFactory,
    on_fatal: Callable[[BaseException], None] | None,
    torch_thread: Executor,
) -> None:
    config: ServerConfig = app.state.config
    loop = asyncio.get_running_loop()
    try:
        logger.info("loading generation model %s", config.engine.model)
        llm_engine = await loop.run_in_executor(torch_thread, engine_factory, config.engine)
        engine = AsyncEngine(
            llm_engine, max_queued_requests=config.max_queued_requests, request_timeout=config.request_timeout
        )
        await engine.start(torch_thread)
        app.state.engine = engine
        if config.embedder is not None:
            logger.info("loading embedding model %s", config.embedder.model)
            embedder = await loop.run_in_executor(torch_thread, embedder_factory, config.embedder)
            await embedder.start(torch_thread)
            app.state.embedder = embedder
        app.state.is_ready = True
        logger.info("kvserve ready: serving %s", config.model_name)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        logger.exception("model loading failed")
        app.state.load_error = f"model loading failed: {exc}"
        if on_fatal is not None:
            on_fatal(exc)


def api_error_for(exc: BaseException) -> APIError:
    """The one mapping from exceptions to the OpenAI error shape."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return APIError(400, exc.message, param=exc.param, code=type(exc).__name__)
    if isinstance(exc, QueueFullError):
        return APIError(
            429,
            str(exc),
            type="rate_limit_error",
            code="queue_full",
            headers={"Retry-After": str(max(1, round(exc.retry_after)))},
        )
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), type="service_unavailable", code="engine_dead")
    if isinstance(exc, RequestTimeoutError):
        return APIError(504, str(exc), type="timeout_error", code="request_timeout")
    if isinstance(exc, EngineStepError):
        return APIError(500, str(exc), type="internal_error", code="engine_step_failed")
    return APIError(500, "internal server error", type="internal_error")


def _validation_message(errors: list[dict]) -> tuple[str, str | None]:
    parts = []
    first_param = None
    for error in errors:
        loc = [str(p) for p in error.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        first_param = first_param or param
        if error.get("type") == "json_invalid":
            return f"request body is not valid JSON: {error.get('ctx', {}).get('error', error.get('msg'))}", None
        if error.get("type") == "extra_forbidden":
            parts.append(f"unsupported field '{param}'")
        elif error.get("type") == "missing":
            parts.append(f"missing required field '{param}'")
        else:
            parts.append(f"{param}: {error.get('msg')}" if param else str(error.get("msg")))
    return "; ".join(parts) or "invalid request", first_param


def _install_error_handlers(app: FastAPI) -> None:
    def render(error: APIError) -> JSONResponse:
        return JSONResponse(error.to_body(), status_code=error.status_code, headers=error.headers)

    @app.exception_handler(RequestValidationError)
    async def _on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(list(exc.errors()))
        return render(APIError(400, message, param=param, code="invalid_request"))

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kinds = {401: "authentication_error", 404: "not_found_error", 413: "invalid_request_error"}
        error = APIError(
            exc.status_code,
            str(exc.detail),
            type=kinds.get(exc.status_code, "invalid_request_error"),
            headers=dict(exc.headers or {}),
        )
        return render(error)

    @app.exception_handler(APIError)
    async def _on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return render(exc)

    @app.exception_handler(KVServeError)
    async def _on_engine_error(request: Request, exc: KVServeError) -> JSONResponse:
        error = api_error_for(exc)
        if error.status_code >= 500:
            logger.error("request %s failed: %s", getattr(request.state, "request_id", "-"), exc)
        return render(error)
