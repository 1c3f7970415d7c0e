"""Which models this server serves, and which one a request's `model` field names.

A request may name a model by its served name or its path, or leave `model` out (the
default model of its task). Naming the other task's model is a 400 saying which endpoints
serve it; naming no served model is a 404 listing them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from server.errors import APIError
from server.state import ServerState

if TYPE_CHECKING:
    from engine.serving.async_embedder import AsyncEmbedder
    from engine.serving.async_engine import AsyncEngine
    from server.text import RequestText

Task = Literal["generate", "embed"]

_TASK_ROUTES = {
    "generate": "Text generation (/v1/completions, /v1/chat/completions)",
    "embed": "Embeddings (/v1/embeddings, /embed)",
}


def embedding_model_names(state: ServerState) -> set[str]:
    embedder_config = state.config.embedder
    names = {embedder_config.model if embedder_config is not None else None}
    if state.embedder is not None:
        names.add(state.embedder.model_name)
    return {n for n in names if n}


def generation_model_names(state: ServerState) -> set[str]:
    names = {state.config.model_name, state.config.engine.model}
    if state.engine is not None:
        names.add(state.engine.model_name)
    return {n for n in names if n}


def check_model(state: ServerState, model: str | None, task: Task) -> None:
    """400 if `model` is served for the other task, 404 if it is not served at all (None: the default)."""
    if model is None:
        return
    own, other = (
        (generation_model_names(state), embedding_model_names(state))
        if task == "generate"
        else (embedding_model_names(state), generation_model_names(state))
    )
    if model in own:
        return
    if model in other:
        kind, use = (
            ("an embedding model", "/v1/embeddings or /embed")
            if task == "generate"
            else ("a generation model", "/v1/completions or /v1/chat/completions")
        )
        servers = ", ".join(repr(n) for n in sorted(own)) or "no model on this server"
        raise APIError(
            400,
            f"model {model!r} is {kind}: use {use} with it. {_TASK_ROUTES[task]}: served by {servers}.",
            param="model",
            code="wrong_model_task",
        )
    served = [state.config.model_name, *sorted(embedding_model_names(state))]
    raise APIError(
        404,
        f"the model {model!r} does not exist; served models: {', '.join(served)}",
        type="not_found_error",
        param="model",
        code="model_not_found",
    )


def generation_engine(state: ServerState, model: str | None) -> AsyncEngine:
    """The AsyncEngine serving `model` (None: the default one); 400/404/503 otherwise."""
    check_model(state, model, "generate")
    engine = state.engine
    if engine is None:
        raise APIError(503, "the generation model is not loaded", type="service_unavailable")
    if not engine.is_healthy:
        raise APIError(503, "the generation engine is not running", type="service_unavailable")
    return engine


def request_text(state: ServerState) -> RequestText:
    """Where the generation model's request text is tokenized (set with the engine); 503 before."""
    if state.text is None:
        raise APIError(503, "the generation model is not loaded", type="service_unavailable")
    return state.text


def embedding_engine(state: ServerState, model: str | None) -> AsyncEmbedder:
    """The AsyncEmbedder serving `model` (None: the served one); 400/404/503 otherwise."""
    check_model(state, model, "embed")
    embedder = state.embedder
    if embedder is None:
        if state.config.embedder is not None:
            raise APIError(503, "the embedding model is not loaded yet", type="service_unavailable")
        raise APIError(
            404,
            "this server serves no embedding model (start it with --embedding-model)",
            type="not_found_error",
            param="model",
            code="model_not_found",
        )
    if not embedder.is_healthy:
        raise APIError(503, "the embedding model is not running", type="service_unavailable")
    return embedder
