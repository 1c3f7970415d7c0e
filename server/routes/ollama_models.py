"""Ollama's model routes: GET /api/version, GET /api/tags, POST /api/show, GET /api/ps.

/api/tags lists every catalogue model (once per name), loaded or not; /api/ps the loaded ones, with what each
holds (weights plus KV cache) and when it unloads if it stays idle (far in the future for one kept loaded).
/api/tags' `size` is the bytes the weights take in memory (the files' bytes before a model is loaded); `digest` names
the model (a hash of its path and name), not its file's bytes. /api/show's `capabilities` are what the
model is served for here: "completion" and "tools" for the generation model (every chat template takes
tools: server/openai/tools.py), "thinking" with --reasoning-parser, "embedding" for the embedding model.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter

from engine import models_hub
from server.catalogue.pool import ModelStatus
from server.catalogue.served import ServedGeneration
from server.errors import APIError, clip
from server.http.json_body import AnyContentTypeJSONRoute
from server.http.openapi import ollama_info_responses
from server.ollama.served import served_name
from server.protocol.ollama import (
    Details,
    ListedModel,
    ModelList,
    RunningModel,
    RunningModels,
    ShowRequest,
    ShowResponse,
    Version,
)
from server.state import SharedState

# The Ollama release whose API these routes answer as: clients that check for a minimum version accept it.
OLLAMA_API_VERSION = "0.13.0"
NEVER_EXPIRES = "2318-01-01T00:00:00Z"  # what Ollama shows for a model kept loaded (keep_alive -1)

router = APIRouter(route_class=AnyContentTypeJSONRoute)


@dataclass(frozen=True)
class _Served:
    name: str
    path: str
    task: str  # "generate", "embed" or "rerank"
    family: str  # "" until loaded
    context_length: int  # 0 until loaded
    weight_bytes: int
    num_parameters: int | None
    info: dict[str, Any]
    quantization: str  # the method the weights run under (auto resolved once loaded)
    template: str  # the chat template ("" for an encoder, or until loaded)
    capabilities: list[str]
    memory_bytes: int  # weights plus KV cache (estimated until loaded)
    expires_at: str  # when it unloads if idle, Ollama's format (NEVER_EXPIRES: kept)


@router.get("/api/version", responses=ollama_info_responses())
async def version() -> Version:
    return Version(version=OLLAMA_API_VERSION)


@router.get("/api/tags", responses=ollama_info_responses())
async def tags(state: SharedState) -> ModelList:
    return ModelList(models=[_listed(served, state) for served in _served_models(state)])


@router.get("/api/ps", responses=ollama_info_responses())
async def running(state: SharedState) -> RunningModels:
    models = []
    for served in _served_models(state, loaded_only=True):
        listed = _listed(served, state).model_dump()
        listed["size"] = served.memory_bytes
        on_gpu = served.info.get("device", "cpu").startswith("cuda")
        models.append(
            RunningModel(
                **listed,
                expires_at=served.expires_at,
                size_vram=served.memory_bytes if on_gpu else 0,
                context_length=served.context_length,
            )
        )
    return RunningModels(models=models)


@router.post("/api/show", responses=ollama_info_responses(400, 404))
async def show(body: ShowRequest, state: SharedState) -> ShowResponse:
    asked = body.model or body.name
    if not asked:
        raise APIError(400, "model: required", param="model")
    name = served_name(state, asked)
    for served in _served_models(state):
        if served.name == name:
            return _shown(served, state)
    raise APIError(404, f"model {clip(asked)!r} not found", param="model", code="model_not_found")


def _served_models(state: Any, loaded_only: bool = False) -> list[_Served]:
    found = []
    for row in state.models.statuses():
        if loaded_only and row.status != "loaded":
            continue
        served = state.models.loaded(row.entry) if row.status == "loaded" else None
        for name in row.entry.names:
            found.append(_described(name, row, served))
    return found


def _described(name: str, row: ModelStatus, served: Any) -> _Served:
    entry = row.entry
    expires = _expiry(row.expires_at)
    if isinstance(served, ServedGeneration):
        info = served.engine.model_info
        model_info = {
            "general.architecture": info.architecture,
            "general.parameter_count": info.num_parameters,
            f"{info.architecture}.context_length": info.max_model_len,
            f"{info.architecture}.embedding_length": info.hidden_size,
            f"{info.architecture}.block_count": info.num_layers,
            f"{info.architecture}.attention.head_count": info.num_heads,
            f"{info.architecture}.attention.head_count_kv": info.num_kv_heads,
            "device": info.device,
        }
        if info.sliding_window is not None:
            model_info[f"{info.architecture}.attention.sliding_window"] = info.sliding_window
        capabilities = ["completion", "tools", *(["thinking"] if served.reasoning is not None else [])]
        return _Served(
            name,
            entry.config.model,
            "generate",
            info.architecture,
            info.max_model_len,
            info.weight_bytes,
            info.num_parameters,
            model_info,
            info.quantization,
            served.engine.tokenizer.chat_template or "",
            capabilities,
            row.memory_bytes,
            expires,
        )
    if served is not None:  # an encoder's batcher
        module = served.embedder.model if entry.task == "embed" else None  # the encoder's torch module
        tensors = [*module.parameters(), *module.buffers()] if module is not None else []
        num_parameters = sum(p.numel() for p in module.parameters()) if module is not None else None
        weight_bytes = sum(t.numel() * t.element_size() for t in tensors) if module is not None else row.memory_bytes
        context = {"general.architecture": "bert", "bert.context_length": served.max_model_len}
        if module is not None:
            context["general.parameter_count"] = num_parameters
            context["bert.embedding_length"] = served.embedder.hidden_size
        return _Served(
            name,
            entry.config.model,
            entry.task,
            "bert",
            served.max_model_len,
            weight_bytes,
            num_parameters,
            context,
            "none",
            "",
            ["embedding"],
            row.memory_bytes,
            expires,
        )
    # Not loaded: what its files say without loading it.
    capabilities = ["completion", "tools"] if entry.task == "generate" else ["embedding"]
    quantization = getattr(entry.config, "quantization", "none")
    return _Served(
        name,
        entry.config.model,
        entry.task,
        "",
        0,
        row.memory_bytes,
        None,
        {},
        quantization,
        "",
        capabilities,
        row.memory_bytes,
        expires,
    )


def _expiry(expires_at: float | None) -> str:
    if expires_at is None:
        return NEVER_EXPIRES
    return datetime.fromtimestamp(expires_at, UTC).isoformat().replace("+00:00", "Z")


def _details(served: _Served, state: Any) -> Details:
    is_gguf = _local_path(served.path).endswith(".gguf")
    return Details(
        format="gguf" if is_gguf else "safetensors",
        family=served.family,
        families=[served.family] if served.family else [],
        parameter_size=_parameter_size(served.num_parameters),
        quantization_level=served.quantization.upper(),
    )


def _listed(served: _Served, state: Any) -> ListedModel:
    identity = f"{served.name}\0{os.path.abspath(served.path)}".encode()
    return ListedModel(
        name=served.name,
        model=served.name,
        modified_at=_modified_at(served.path),
        size=served.weight_bytes,
        digest=hashlib.sha256(identity).hexdigest(),
        details=_details(served, state),
    )


def _shown(served: _Served, state: Any) -> ShowResponse:
    info = {key: value for key, value in served.info.items() if key != "device"}
    return ShowResponse(
        modelfile="",
        parameters="",
        template=served.template,
        details=_details(served, state),
        model_info=info,
        capabilities=served.capabilities,
        modified_at=_modified_at(served.path),
    )


def _parameter_size(count: int | None) -> str:
    """Ollama's way: 135M, 1.1B ("" where not known)."""
    if not count:
        return ""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= scale:
            return f"{count / scale:.1f}".removesuffix(".0") + suffix
    return str(count)


def _local_path(path: str) -> str:
    """A model's file or folder: `path` itself, or where a pulled model of that name lies."""
    if not os.path.exists(path):
        try:
            return str(models_hub.resolve_model(path, auto_pull=False))
        except Exception:  # noqa: BLE001 - a name this server cannot place: the name itself
            return path
    return path


def _modified_at(path: str) -> str:
    try:
        stamp = os.path.getmtime(_local_path(path))
    except OSError:
        stamp = 0.0  # a hub name that is not a local path
    return datetime.fromtimestamp(stamp, UTC).isoformat().replace("+00:00", "Z")
