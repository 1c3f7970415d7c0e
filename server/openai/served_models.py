"""Which models this server serves, and which one a request's `model` field names.

A request may name a model by its served name or its path, or leave `model` out (the
default model of its task). Naming another task's model is a 400 saying which endpoints
serve it; naming no served model is a 404 listing them. The tasks: generation, embeddings
and reranking (a cross-encoder, engine/pooling/reranker.py, batched by an AsyncEncoder of its own).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from server.errors import APIError, clip
from server.state import ServerState

if TYPE_CHECKING:
    from engine import AsyncEncoder, AsyncEngine
    from server.openai.text import RequestText

Task = Literal["generate", "embed", "rerank"]

_TASK_ROUTES = {
    "generate": "Text generation (/v1/completions, /v1/chat/completions)",
    "embed": "Embeddings (/v1/embeddings, /embed)",
    "rerank": "Reranking (/v1/rerank, /rerank, /v1/score)",
}
# task -> (what a model of it is, the endpoints to use it with)
_TASK_MODELS = {
    "generate": ("a generation model", "/v1/completions or /v1/chat/completions"),
    "embed": ("an embedding model", "/v1/embeddings or /embed"),
    "rerank": ("a rerank model", "/v1/rerank, /rerank or /v1/score"),
}


def embedding_model_names(state: ServerState) -> set[str]:
    embedder_config = state.config.embedder
    names = {embedder_config.model if embedder_config is not None else None}
    if state.embedder is not None:
        names.add(state.embedder.model_name)
    return {n for n in names if n}


def rerank_model_names(state: ServerState) -> set[str]:
    reranker_config = state.config.reranker
    names = {reranker_config.model if reranker_config is not None else None}
    if state.reranker is not None:
        names.add(state.reranker.model_name)
    return {n for n in names if n}


def generation_model_names(state: ServerState) -> set[str]:
    names = {*state.config.model_names, state.config.engine.model}
    if state.engine is not None:
        names.add(state.engine.model_name)
    return {n for n in names if n}


def _model_names(state: ServerState, task: Task) -> set[str]:
    if task == "generate":
        return generation_model_names(state)
    return embedding_model_names(state) if task == "embed" else rerank_model_names(state)


def check_model(state: ServerState, model: str | None, task: Task) -> None:
    """400 if `model` is served for another task, 404 if it is not served at all (None: the default)."""
    if model is None:
        return
    own = _model_names(state, task)
    if model in own:
        return
    for other in _TASK_ROUTES:
        if other != task and model in _model_names(state, other):
            kind, use = _TASK_MODELS[other]
            servers = ", ".join(repr(n) for n in sorted(own)) or "no model on this server"
            raise APIError(
                400,
                f"model {clip(model)!r} is {kind}: use {use} with it. {_TASK_ROUTES[task]}: served by {servers}.",
                param="model",
                code="wrong_model_task",
            )
    served = [*state.config.model_names, *sorted(embedding_model_names(state)), *sorted(rerank_model_names(state))]
    raise APIError(
        404,
        f"the model {clip(model)!r} does not exist; served models: {', '.join(served)}",
        type="not_found_error",
        param="model",
        code="model_not_found",
    )


def generation_engine(state: ServerState, model: str | None) -> AsyncEngine:
    """The AsyncEngine serving `model` (None: the default one); 400/404/503 otherwise."""
    check_model(state, model, "generate")
    engine = state.engine
    if engine is None:
        raise APIError(503, "the generation model is not loaded", type="service_unavailable", code="model_loading")
    if not engine.is_healthy:
        raise APIError(503, "the generation engine is not running", type="service_unavailable")
    return engine


def request_text(state: ServerState) -> RequestText:
    """Where the generation model's request text is tokenized (set with the engine); 503 before."""
    if state.text is None:
        raise APIError(503, "the generation model is not loaded", type="service_unavailable", code="model_loading")
    return state.text


def embedding_engine(state: ServerState, model: str | None) -> AsyncEncoder:
    """The AsyncEncoder serving `model` (None: the served one); 400/404/503 otherwise."""
    check_model(state, model, "embed")
    return _encoder(state.embedder, state.config.embedder is not None, "embedding", "--embedding-model")


def rerank_engine(state: ServerState, model: str | None) -> AsyncEncoder:
    """The AsyncEncoder batching the rerank model `model` (None: the served one); 400/404/503 otherwise."""
    check_model(state, model, "rerank")
    return _encoder(state.reranker, state.config.reranker is not None, "rerank", "--rerank-model")


def _encoder(batcher: AsyncEncoder | None, is_configured: bool, what: str, flag: str) -> AsyncEncoder:
    """An encoder model's batcher once it is loaded and running: 503 while loading or stopped, 404 if not served."""
    if batcher is None:
        if is_configured:
            raise APIError(503, f"the {what} model is not loaded yet", type="service_unavailable", code="model_loading")
        raise APIError(
            404,
            f"this server serves no {what} model (start it with {flag})",
            type="not_found_error",
            param="model",
            code="model_not_found",
        )
    if not batcher.is_healthy:
        raise APIError(503, f"the {what} model is not running", type="service_unavailable")
    return batcher
