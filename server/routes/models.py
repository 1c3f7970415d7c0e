"""GET /v1/models: every catalogue model, loaded or not (`loaded`, `status`, `memory_bytes`, `expires_at`),
each with its task ("generate", "embed" or "rerank") and, once loaded, its context length (a generation
model's with its `runtime`: device, CPU features, kernel build, prefill dtype, KV cache format and bytes per
token); `?loaded=true`: only the loaded ones.
GET /v1/models/{id}: one of them (404 `model_not_found` for any other name).
POST /v1/models/{id}/load and /unload (admin): load a model now, or unload it (its requests fail)."""

from __future__ import annotations

import math

from fastapi import APIRouter, Request

from server.catalogue.entries import ModelEntry
from server.catalogue.pool import ModelStatus
from server.catalogue.served import ServedGeneration
from server.errors import APIError
from server.http.access import caller_of
from server.http.openapi import error_responses
from server.protocol.common import ModelCard, ModelList, ModelRuntime
from server.state import ServerState, SharedState

router = APIRouter()


@router.get("/v1/models", responses=error_responses(400, 401, 413, 500, 503))
async def list_models(state: SharedState, loaded: bool | None = None) -> ModelList:
    cards = []
    for row in state.models.statuses():
        if loaded is not None and (row.status == "loaded") != loaded:
            continue
        cards.extend(_cards(state, row))
    return ModelList(data=cards)


def _cards(state: ServerState, row: ModelStatus) -> list[ModelCard]:
    """One card per name of the model, as each is a name a request may use."""
    entry = row.entry
    served = state.models.loaded(entry) if row.status == "loaded" else None
    runtime = None
    max_model_len = None
    if isinstance(served, ServedGeneration):
        info = served.engine.model_info
        runtime = ModelRuntime(
            device=info.device,
            cpu_features=list(info.cpu_features),
            kernel_build=info.kernel_build,
            prefill_dtype=info.prefill_dtype,
            kv_cache_dtype=info.kv_cache_dtype,
            kv_bytes_per_token=info.kv_bytes_per_token,
        )
        max_model_len = served.engine.max_model_len
    elif served is not None:
        max_model_len = served.max_model_len
    expires_at = math.floor(row.expires_at) if row.expires_at is not None else None
    return [
        ModelCard(
            id=name,
            root=entry.config.model,
            max_model_len=max_model_len,
            task=entry.task,
            runtime=runtime,
            loaded=served is not None,
            status=row.status,
            memory_bytes=row.memory_bytes or None,
            expires_at=expires_at,
        )
        for name in entry.names
    ]


# `:path`: a served name may contain slashes (a Hugging Face repo id served under its own name)
@router.get("/v1/models/{model_id:path}", responses=error_responses(404, 401, 413, 500, 503))
async def retrieve_model(model_id: str, state: SharedState) -> ModelCard:
    for card in (await list_models(state)).data:
        if card.id == model_id:
            return card
    raise _not_found(model_id)


@router.post("/v1/models/{model_id:path}/load", responses=error_responses(400, 401, 403, 404, 413, 500, 503))
async def load_model(model_id: str, request: Request, state: SharedState) -> ModelCard:
    """Load the model now (admin); it then expires after its keep-alive as if a request had used it."""
    entry = _admin_entry(model_id, request, state)
    await state.models.load(entry)
    return await retrieve_model(entry.name, state)


@router.post("/v1/models/{model_id:path}/unload", responses=error_responses(401, 403, 404, 413, 500, 503))
async def unload_model(model_id: str, request: Request, state: SharedState) -> ModelCard:
    """Unload the model now (admin): requests inside it fail (503); the next request loads it again."""
    entry = _admin_entry(model_id, request, state)
    await state.models.unload(entry)
    return await retrieve_model(entry.name, state)


def _admin_entry(model_id: str, request: Request, state: ServerState) -> ModelEntry:
    if not caller_of(request).is_admin:
        raise APIError(
            403, "loading and unloading models takes an admin API key", type="permission_error", code="admin_required"
        )
    entry = state.models.find(model_id)
    if entry is None:
        raise _not_found(model_id)
    return entry


def _not_found(model_id: str) -> APIError:
    return APIError(
        404,
        f"the model {model_id!r} is not served here (GET /v1/models lists the served models)",
        type="not_found_error",
        param="model",
        code="model_not_found",
    )
