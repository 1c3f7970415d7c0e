"""Embedding routes: OpenAI's POST /v1/embeddings and text-embeddings-inference's POST /embed (and POST /).

Thin: check the model and the list size, hand the inputs to the AsyncEncoder, shape the
vectors. The answer is computed while the client waits (server/serving.py): a client that
leaves cancels the embed, which drops its queued inputs. Bad input raised by the embedder
(`InvalidRequestError`: over-long input, bad token id, ...) is a 400 through the app's error
handlers. Bodies are built as plain dicts: validating thousands of floats per vector through
pydantic would cost more than the forward.
"""

from __future__ import annotations

import base64
import time
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter
from fastapi.responses import Response

from engine import EmbedResult
from server import serving
from server.errors import APIError
from server.http.json_body import StrictJSONRoute
from server.http.openapi import engine_responses
from server.metrics.server_metrics import ServerMetrics
from server.openai.params import check_batch_size
from server.openai.served_models import embedding_engine
from server.protocol.embeddings import EmbeddingRequest, EmbeddingResponse, EmbedRequest, EmbedResponse
from server.state import SharedState

if TYPE_CHECKING:
    from engine import AsyncEncoder

router = APIRouter(route_class=StrictJSONRoute)


@router.post("/v1/embeddings", response_model=EmbeddingResponse, responses=engine_responses())
async def create_embeddings(body: EmbeddingRequest, state: SharedState) -> Response:
    inputs = _as_input_list(body.input, "input")
    check_batch_size(state.config, len(inputs), "input")
    embedder = await embedding_engine(state, body.model)

    async def answer() -> dict:
        result = await embed_observed(
            embedder,
            state.metrics,
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
        return {
            "object": "list",
            "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(embeddings)],
            "model": body.model or embedder.model_name,
            "usage": {"prompt_tokens": result.num_prompt_tokens, "total_tokens": result.num_prompt_tokens},
        }

    return serving.raced_json(answer)


# TEI answers its embed route at the root too: clients built for it (huggingface_hub's
# InferenceClient.feature_extraction with a base URL) post there.
@router.post("/", response_model=EmbedResponse, responses=engine_responses())
@router.post("/embed", response_model=EmbedResponse, responses=engine_responses())
async def embed(body: EmbedRequest, state: SharedState) -> Response:
    inputs = _as_input_list(body.inputs, "inputs")
    check_batch_size(state.config, len(inputs), "inputs")
    embedder = await embedding_engine(state, None)

    async def answer() -> list[list[float]]:
        result = await embed_observed(
            embedder,
            state.metrics,
            "/embed",
            inputs,
            normalize=body.normalize,
            truncate=body.truncate,
            truncation_direction=body.truncation_direction,
            dimensions=body.dimensions,
        )
        return result.vectors.tolist()

    return serving.raced_json(answer)


def _as_input_list(value: str | list, param: str) -> list[str] | list[list[int]]:
    """One string or one token-id list is a batch of one; empty lists are refused."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise APIError(400, f"{param} must not be empty", param=param)
    if isinstance(value[0], int):
        return [value]
    return value


async def embed_observed(
    embedder: AsyncEncoder, metrics: ServerMetrics, endpoint: str, inputs: list, **options: Any
) -> EmbedResult:
    """`embedder.embed(inputs, **options)`, its latency, inputs and tokens observed in /metrics under
    `endpoint` and the model's name (the embedding and the rerank routes)."""
    start = time.monotonic()
    result: EmbedResult = await embedder.embed(inputs, **options)
    metrics.observe_embedding_request(
        endpoint=endpoint,
        num_inputs=len(inputs),
        num_prompt_tokens=result.num_prompt_tokens,
        latency_seconds=time.monotonic() - start,
        model_name=embedder.model_name,
    )
    return result
