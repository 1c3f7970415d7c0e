"""Embedding routes: OpenAI's POST /v1/embeddings and text-embeddings-inference's POST /embed.

Thin: validate the shape, check the model and the list size, hand the inputs to the
AsyncEmbedder on `app.state.embedder`, and shape the vectors. Bad input raised by the
embedder (`InvalidRequestError`: over-long input, bad token id, ...) becomes a 400 through the
app's error handler.
"""

from __future__ import annotations

import base64
import logging
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from engine.embedder import EmbedResult
from server.embedding_schemas import EmbeddingRequest, EmbeddingResponse, EmbedRequest, EmbedResponse
from server.errors import APIError
from server.routes.openai import check_batch_size, check_model

logger = logging.getLogger(__name__)

router = APIRouter()


@router.post("/v1/embeddings", response_model=EmbeddingResponse)
async def create_embeddings(body: EmbeddingRequest, request: Request) -> JSONResponse:
    embedder = _embedder_for(request, body.model)
    inputs = _as_input_list(body.input, "input")
    check_batch_size(request, len(inputs), "input")
    result = await _embed(
        request,
        "/v1/embeddings",
        inputs,
        normalize=None,
        truncate=body.truncate,
        truncation_direction=body.truncation_direction,
        dimensions=body.dimensions,
    )
    if body.encoding_format == "base64":
        # little-endian float32, what the openai SDK's base64 decoder (numpy frombuffer float32) expects
        rows = result.vectors.numpy().astype("<f4", copy=False)
        embeddings: list[Any] = [base64.b64encode(row.tobytes()).decode("ascii") for row in rows]
    else:
        embeddings = result.vectors.tolist()
    payload = {
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(embeddings)],
        "model": body.model or embedder.model_name,
        "usage": {"prompt_tokens": result.num_prompt_tokens, "total_tokens": result.num_prompt_tokens},
    }
    return JSONResponse(payload)


@router.post("/embed", response_model=EmbedResponse)
async def embed(body: EmbedRequest, request: Request) -> JSONResponse:
    _embedder_for(request, None)
    inputs = _as_input_list(body.inputs, "inputs")
    check_batch_size(request, len(inputs), "inputs")
    result = await _embed(
        request,
        "/embed",
        inputs,
        normalize=body.normalize,
        truncate=body.truncate,
        truncation_direction=body.truncation_direction,
        dimensions=body.dimensions,
    )
    return JSONResponse(result.vectors.tolist())


# ---------------------------------------------------------------- helpers


def _embedder_for(request: Request, model: str | None) -> Any:
    """The AsyncEmbedder serving `model` (None: the served one); 400/404/503 otherwise."""
    check_model(request, model, "embed")
    state = request.app.state
    embedder = getattr(state, "embedder", None)
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


def _as_input_list(value: str | list, param: str) -> list[str] | list[list[int]]:
    """One string or one token-id list is a batch of one; empty lists are refused."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise APIError(400, f"{param} must not be empty", param=param)
    if isinstance(value[0], int):
        return [value]
    return value


async def _embed(request: Request, endpoint: str, inputs: list, **options: Any) -> EmbedResult:
    embedder = request.app.state.embedder
    start = time.monotonic()
    result: EmbedResult = await embedder.embed(inputs, **options)
    observe = getattr(getattr(request.app.state, "metrics", None), "observe_embedding_request", None)
    if observe is not None:
        observe(
            endpoint=endpoint,
            num_inputs=len(inputs),
            num_prompt_tokens=result.num_prompt_tokens,
            latency_seconds=time.monotonic() - start,
        )
    return result
