"""Which catalogue model a request's `model` field names, loaded for it.

A request may name a model by one of its served names or its path, or leave `model` out (the default
model of its task). Naming another task's model is a 400 saying which endpoints serve it; naming no
served model is a 404 listing them. The tasks: generation, embeddings and reranking (a cross-encoder,
engine/pooling/reranker.py, batched by an AsyncEncoder of its own). A model that is not loaded loads
first (server/catalogue/pool.py), the request waiting for it; the request holds it until its answer ends.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from server.catalogue.entries import ModelEntry, Task
from server.catalogue.served import ServedGeneration
from server.errors import APIError, clip
from server.state import ServerState

if TYPE_CHECKING:
    from engine import AsyncEncoder

_TASK_ROUTES = {
    "generate": "Text generation (/v1/completions, /v1/chat/completions)",
    "embed": "Embeddings (/v1/embeddings, /embed)",
    "rerank": "Reranking (/v1/rerank, /rerank, /v1/score)",
}
# task -> (what a model of it is, the endpoints to use it with, the flag that serves one)
_TASK_MODELS = {
    "generate": ("a generation model", "/v1/completions or /v1/chat/completions", "--model"),
    "embed": ("an embedding model", "/v1/embeddings or /embed", "--embedding-model"),
    "rerank": ("a rerank model", "/v1/rerank, /rerank or /v1/score", "--rerank-model"),
}
_WHAT = {"generate": "generation", "embed": "embedding", "rerank": "rerank"}


def model_names(state: ServerState, task: Task) -> set[str]:
    """Every name (and path) a request may give for a model of `task`."""
    return {name for entry in state.models.entries if entry.task == task for name in (*entry.names, entry.config.model)}


def generation_model_names(state: ServerState) -> set[str]:
    return model_names(state, "generate")


def embedding_model_names(state: ServerState) -> set[str]:
    return model_names(state, "embed")


def model_entry(state: ServerState, model: str | None, task: Task) -> ModelEntry:
    """The catalogue entry `model` names for `task` (None: the task's default); 400 if it is another task's
    model, 404 if no model has that name (or none of the task is served)."""
    if model is None:
        entry = state.models.default(task)
        if entry is None:
            raise APIError(
                404,
                f"this server serves no {_WHAT[task]} model (start it with {_TASK_MODELS[task][2]})",
                type="not_found_error",
                param="model",
                code="model_not_found",
            )
        return entry
    entry = state.models.find(model)
    if entry is None:
        served = ", ".join(name for e in state.models.entries for name in e.names)
        raise APIError(
            404,
            f"the model {clip(model)!r} does not exist; served models: {served}",
            type="not_found_error",
            param="model",
            code="model_not_found",
        )
    if entry.task != task:
        kind, use, _ = _TASK_MODELS[entry.task]
        own = sorted(e.name for e in state.models.entries if e.task == task)
        servers = ", ".join(repr(n) for n in own) or "no model on this server"
        raise APIError(
            400,
            f"model {clip(model)!r} is {kind}: use {use} with it. {_TASK_ROUTES[task]}: served by {servers}.",
            param="model",
            code="wrong_model_task",
        )
    return entry


def check_model(state: ServerState, model: str | None, task: Task) -> None:
    """400/404 as `model_entry` says, without loading anything."""
    model_entry(state, model, task)


async def generation_model(state: ServerState, model: str | None, keep_alive: float | None = None) -> ServedGeneration:
    """The generation model `model` names (None: the default), loaded and held for this request.
    keep_alive: the request's own (seconds), from now on the model's. 400/404/500/503 otherwise."""
    served = await state.models.acquire(model_entry(state, model, "generate"), keep_alive)
    assert isinstance(served, ServedGeneration)
    if not served.engine.is_healthy:
        raise APIError(503, f"the generation model {served.name!r} is not running", type="service_unavailable")
    return served


async def embedding_engine(state: ServerState, model: str | None, keep_alive: float | None = None) -> AsyncEncoder:
    """The AsyncEncoder serving the embedding model `model` (None: the default), loaded and held."""
    return await _encoder(state, model_entry(state, model, "embed"), keep_alive)


async def rerank_engine(state: ServerState, model: str | None) -> AsyncEncoder:
    """The AsyncEncoder batching the rerank model `model` (None: the default), loaded and held."""
    return await _encoder(state, model_entry(state, model, "rerank"), None)


async def _encoder(state: ServerState, entry: ModelEntry, keep_alive: float | None) -> AsyncEncoder:
    batcher = await state.models.acquire(entry, keep_alive)
    assert not isinstance(batcher, ServedGeneration)
    if not batcher.is_healthy:
        raise APIError(503, f"the {_WHAT[entry.task]} model {entry.name!r} is not running", type="service_unavailable")
    return batcher
