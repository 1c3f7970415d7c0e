"""Ollama's model routes: GET /api/version, GET /api/tags, POST /api/show, GET /api/ps.

Every served model is listed (the generation model once per --served-model-name alias, then the embedding
model), each as loaded: this server loads its models at start and keeps them, so /api/ps lists the same
models with an expiry far in the future. `size` is the bytes the weights take in memory; `digest` names
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
    task: str  # "generate" or "embed"
    family: str
    context_length: int
    weight_bytes: int
    num_parameters: int | None
    info: dict[str, Any]


@router.get("/api/version", responses=ollama_info_responses())
async def version() -> Version:
    return Version(version=OLLAMA_API_VERSION)


@router.get("/api/tags", responses=ollama_info_responses())
async def tags(state: SharedState) -> ModelList:
    return ModelList(models=[_listed(served, state) for served in _served_models(state)])


@router.get("/api/ps", responses=ollama_info_responses())
async def running(state: SharedState) -> RunningModels:
    models = [
        RunningModel(
            **_listed(served, state).model_dump(),
            expires_at=NEVER_EXPIRES,
            size_vram=served.weight_bytes if served.info.get("device", "cpu").startswith("cuda") else 0,
            context_length=served.context_length,
        )
        for served in _served_models(state)
    ]
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


def _served_models(state: Any) -> list[_Served]:
    found = []
    if state.engine is not None:
        info = state.engine.model_info
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
        for name in state.config.model_names:
            found.append(
                _Served(
                    name,
                    state.config.engine.model,
                    "generate",
                    info.architecture,
                    info.max_model_len,
                    info.weight_bytes,
                    info.num_parameters,
                    model_info,
                )
            )
    embedder = state.embedder
    if embedder is not None:
        path = state.config.embedder.model if state.config.embedder is not None else embedder.model_name
        module = embedder.embedder.model  # the encoder's torch module
        tensors = [*module.parameters(), *module.buffers()]
        num_parameters = sum(parameter.numel() for parameter in module.parameters())
        weight_bytes = sum(tensor.numel() * tensor.element_size() for tensor in tensors)
        context = {
            "general.architecture": "bert",
            "general.parameter_count": num_parameters,
            "bert.context_length": embedder.max_model_len,
            "bert.embedding_length": embedder.embedder.hidden_size,
        }
        found.append(
            _Served(
                embedder.model_name,
                path,
                "embed",
                "bert",
                embedder.max_model_len,
                weight_bytes,
                num_parameters,
                context,
            )
        )
    return found


def _details(served: _Served, state: Any) -> Details:
    is_gguf = _local_path(served.path).endswith(".gguf")
    quantization = state.engine.model_info.quantization if served.task == "generate" else "none"
    return Details(
        format="gguf" if is_gguf else "safetensors",
        family=served.family,
        families=[served.family],
        parameter_size=_parameter_size(served.num_parameters),
        quantization_level=quantization.upper(),
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
    template = ""
    capabilities = ["embedding"]
    if served.task == "generate":
        template = state.engine.tokenizer.chat_template or ""
        capabilities = ["completion", "tools", *(["thinking"] if state.reasoning is not None else [])]
    info = {key: value for key, value in served.info.items() if key != "device"}
    return ShowResponse(
        modelfile="",
        parameters="",
        template=template,
        details=_details(served, state),
        model_info=info,
        capabilities=capabilities,
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
