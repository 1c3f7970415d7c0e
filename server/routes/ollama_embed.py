"""POST /api/embed and /api/embeddings: Ollama's embedding routes, served by the embedding model.

/api/embed takes one input or a list and answers unit-length vectors (Ollama normalizes them), cut to
`dimensions` when asked; `truncate` false makes an input longer than the model's context a 400 instead of
cutting it. /api/embeddings, the older route, takes one `prompt` and answers its vector as the model
pools it, not normalized (as Ollama's does).
"""

from __future__ import annotations

import time

from fastapi import APIRouter
from fastapi.responses import Response

from server import serving
from server.catalogue.leases import load_wait_ns
from server.errors import APIError
from server.http.json_body import AnyContentTypeJSONRoute
from server.http.openapi import ollama_info_responses
from server.ollama.served import request_keep_alive, served_name
from server.openai.params import check_batch_size
from server.openai.served_models import embedding_engine
from server.protocol.ollama import EmbeddingsRequest, EmbeddingsResponse, EmbedRequest, EmbedResponse
from server.routes.embeddings import embed_observed
from server.state import SharedState

router = APIRouter(route_class=AnyContentTypeJSONRoute)


@router.post("/api/embed", response_model=EmbedResponse, responses=ollama_info_responses(400, 404, 429, 504))
async def embed(body: EmbedRequest, state: SharedState) -> Response:
    embedder = await embedding_engine(state, served_name(state, body.model), request_keep_alive(body.keep_alive))
    inputs = [body.input] if isinstance(body.input, str) else body.input
    if not inputs:
        raise APIError(400, "input must not be empty", param="input")
    check_batch_size(state.config, len(inputs), "input")
    start = time.monotonic_ns()

    async def answer() -> dict:
        result = await embed_observed(
            embedder,
            state.metrics,
            "/api/embed",
            inputs,
            normalize=True,
            truncate=body.truncate,
            truncation_direction="right",
            dimensions=body.dimensions,
        )
        return {
            "model": body.model,
            "embeddings": result.vectors.tolist(),
            "total_duration": time.monotonic_ns() - start + load_wait_ns(),
            "load_duration": load_wait_ns(),
            "prompt_eval_count": result.num_prompt_tokens,
        }

    return serving.raced_json(answer)


@router.post("/api/embeddings", response_model=EmbeddingsResponse, responses=ollama_info_responses(400, 404, 429, 504))
async def embeddings(body: EmbeddingsRequest, state: SharedState) -> Response:
    embedder = await embedding_engine(state, served_name(state, body.model), request_keep_alive(body.keep_alive))

    async def answer() -> dict:
        result = await embed_observed(
            embedder,
            state.metrics,
            "/api/embeddings",
            [body.prompt],
            normalize=False,
            truncate=True,
            truncation_direction="right",
            dimensions=None,
        )
        return {"embedding": result.vectors[0].tolist()}

    return serving.raced_json(answer)
