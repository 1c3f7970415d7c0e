"""Rerank routes: TEI's POST /rerank, the Cohere/Jina-shaped POST /v1/rerank (and /v2/rerank) as vLLM
answers it, and vLLM's POST /v1/score.

Thin, like the embedding routes: check the model and the list size, hand the (query, document)
pairs to the reranker's AsyncEncoder (engine/pooling/reranker.py batched on the torch worker), shape the
answer. The answer is computed while the client waits (server/serving.py): a client that leaves
cancels the work, which drops its queued pairs. Bad input the reranker raises (an over-long pair,
text that is not valid Unicode) is a 400 naming this route's own field.

What a score is, per route (the model gives one logit per pair):
- /rerank: sigmoid(logit), a probability, as TEI answers one-label models; the logit itself with
  `raw_scores`.
- /v1/rerank `relevance_score` and /v1/score `score`: the model's own score, what
  sentence-transformers' CrossEncoder.predict answers: sigmoid(logit) unless the model's config
  names identity (then the logit).
Rankings are sorted by logit, best first (ties: lower index first), so two pairs whose sigmoids
both round to 1.0 still come in the model's order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from fastapi import APIRouter, Request
from fastapi.responses import Response

from engine import TextPair, sigmoid
from engine.errors import InvalidRequestError
from server import serving
from server.errors import APIError
from server.http.json_body import StrictJSONRoute
from server.http.openapi import engine_responses
from server.metrics.server_metrics import ServerMetrics
from server.openai.params import check_batch_size
from server.openai.served_models import rerank_engine
from server.protocol.common import now
from server.protocol.rerank import (
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
    TEIRerankRequest,
    TEIRerankResponse,
)
from server.routes.embeddings import embed_observed
from server.state import SharedState

if TYPE_CHECKING:
    from engine import AsyncEncoder

router = APIRouter(route_class=StrictJSONRoute)


@router.post("/rerank", response_model=TEIRerankResponse, responses=engine_responses())
async def tei_rerank(body: TEIRerankRequest, state: SharedState) -> Response:
    _check_not_empty(body.texts, "texts")
    check_batch_size(state.config, len(body.texts), "texts")
    reranker = await rerank_engine(state, None)

    async def answer() -> list[dict]:
        logits, _ = await _score(
            reranker, state.metrics, "/rerank", [(body.query, text) for text in body.texts], body, ("query", "texts")
        )
        ranks = []
        for index in _best_first(logits):
            rank: dict = {"index": index, "score": logits[index] if body.raw_scores else sigmoid(logits[index])}
            if body.return_text:
                rank["text"] = body.texts[index]
            ranks.append(rank)
        return ranks

    return serving.raced_json(answer)


# Decorators apply bottom-up: /v1/rerank is registered (and documented) first.
@router.post("/v2/rerank", response_model=RerankResponse, responses=engine_responses())
@router.post("/v1/rerank", response_model=RerankResponse, responses=engine_responses())
async def rerank(body: RerankRequest, request: Request, state: SharedState) -> Response:
    documents = [d if isinstance(d, str) else d.text for d in body.documents]
    _check_not_empty(documents, "documents")
    check_batch_size(state.config, len(documents), "documents")
    reranker = await rerank_engine(state, body.model)
    activate = _model_score(reranker)
    answer_id = serving.response_id(request, "rerank")

    async def answer() -> dict:
        logits, num_tokens = await _score(
            reranker,
            state.metrics,
            request.url.path,
            [(body.query, d) for d in documents],
            body,
            ("query", "documents"),
        )
        order = _best_first(logits)
        results = []
        for index in order[: body.top_n or None]:
            result: dict = {"index": index, "relevance_score": activate(logits[index])}
            if body.return_documents:
                result["document"] = {"text": documents[index]}
            results.append(result)
        return {
            "id": answer_id,
            "model": body.model or reranker.model_name,
            "usage": {"total_tokens": num_tokens},
            "results": results,
        }

    return serving.raced_json(answer)


@router.post("/v1/score", response_model=ScoreResponse, responses=engine_responses())
async def score(body: ScoreRequest, request: Request, state: SharedState) -> Response:
    pairs = _score_pairs(body.text_1, body.text_2)
    check_batch_size(state.config, len(pairs), "text_2")
    reranker = await rerank_engine(state, body.model)
    activate = _model_score(reranker)
    answer_id = serving.response_id(request, "score")

    async def answer() -> dict:
        logits, num_tokens = await _score(reranker, state.metrics, "/v1/score", pairs, body, ("text_1", "text_2"))
        return {
            "id": answer_id,
            "object": "list",
            "created": now(),
            "model": body.model or reranker.model_name,
            "data": [{"index": i, "object": "score", "score": activate(logit)} for i, logit in enumerate(logits)],
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens, "completion_tokens": 0},
        }

    return serving.raced_json(answer)


def _check_not_empty(texts: list, param: str) -> None:
    if not texts:
        raise APIError(400, f"{param} must not be empty", param=param)


def _score_pairs(text_1: str | list[str], text_2: str | list[str]) -> list[TextPair]:
    """vLLM's pairing: 1 to 1, 1 to N (text_1 one text), or N to N (equal lengths, pair i with i)."""
    firsts = [text_1] if isinstance(text_1, str) else text_1
    seconds = [text_2] if isinstance(text_2, str) else text_2
    _check_not_empty(firsts, "text_1")
    _check_not_empty(seconds, "text_2")
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    elif len(firsts) != len(seconds):
        raise APIError(
            400,
            f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}: pair one text_1 with any number of "
            "text_2, or two lists of the same length",
            param="text_2",
        )
    return list(zip(firsts, seconds, strict=True))


def _model_score(reranker: AsyncEncoder) -> Callable[[float], float]:
    """The model's own score for a logit (engine/pooling/reranker.py `Reranker.activate`)."""
    return reranker.embedder.activate  # type: ignore[union-attr]


def _best_first(logits: list[float]) -> list[int]:
    """Indexes by logit, highest first; equal logits keep their order."""
    return sorted(range(len(logits)), key=lambda i: -logits[i])


async def _score(
    reranker: AsyncEncoder,
    metrics: ServerMetrics,
    endpoint: str,
    pairs: list[TextPair],
    options: TEIRerankRequest | RerankRequest | ScoreRequest,
    params: tuple[str, str],
) -> tuple[list[float], int]:
    """One logit per pair, in pair order, and the tokens read. `params` names this route's (query,
    documents) fields in the 400s the reranker raises."""
    try:
        result = await embed_observed(
            reranker,
            metrics,
            endpoint,
            pairs,
            truncate=options.truncate,
            truncation_direction=options.truncation_direction,
        )
    except InvalidRequestError as exc:  # made for this request alone: renaming its field is safe
        exc.param = dict(zip(("query", "documents"), params, strict=True)).get(exc.param or "", exc.param)
        raise
    return [row[0] for row in result.vectors.tolist()], result.num_prompt_tokens
