"""HTTP shapes of the rerank endpoints: text-embeddings-inference's POST /rerank, the Cohere/Jina-shaped
POST /v1/rerank (and /v2/rerank) as vLLM answers it, and vLLM's POST /v1/score.

All three score (query, document) pairs with the served cross-encoder (engine/pooling/reranker.py); they
differ in how pairs are given and what a score is (server/routes/rerank.py). Requests forbid unknown
fields (a 400 naming the field), like every request here; `truncate` and `truncation_direction` are
TEI's switches, accepted by all three (without them an over-long pair is a 400).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

from server.protocol.common import Count, StrictRequest, StrictSwitch, TruncationFields, described_union, now

# ---- TEI: POST /rerank ----


class TEIRerankRequest(TruncationFields):
    """POST /rerank (text-embeddings-inference): one query against `texts`."""

    query: str
    texts: list[str]
    raw_scores: StrictSwitch = False  # false: sigmoid(logit), a probability; true: the logit
    return_text: StrictSwitch = False


class TEIRank(BaseModel):
    index: int  # into `texts`
    score: float
    text: str | None = Field(default=None, description="the text, when `return_text` is true")


# POST /rerank answers a bare JSON list, best first.
TEIRerankResponse = list[TEIRank]


# ---- Cohere / Jina: POST /v1/rerank ----


class RerankDocumentInput(StrictRequest):
    text: str


RerankDocument = Annotated[str | RerankDocumentInput, described_union('a string or an object {"text": string}')]


class RerankRequest(TruncationFields):
    """POST /v1/rerank and /v2/rerank. `model` may be omitted (the served rerank model)."""

    model: str | None = None
    query: str
    documents: list[RerankDocument]
    top_n: Count | None = None  # the best n results; None or 0: all of them
    return_documents: StrictSwitch = True


class RerankDocumentText(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int  # into `documents`
    relevance_score: float
    document: RerankDocumentText | None = Field(default=None, description="present when `return_documents` is true")


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]  # best first


# ---- vLLM: POST /v1/score ----

ScoreTexts = Annotated[str | list[str], described_union("a string or a list of strings")]


class ScoreRequest(TruncationFields):
    """POST /v1/score: text_1 and text_2 paired 1 to 1 (two strings), 1 to N (text_1 one string, or a
    list of one), or N to N (two lists of the same length)."""

    model: str | None = None
    text_1: ScoreTexts
    text_2: ScoreTexts


class ScoreData(BaseModel):
    index: int  # the pair's position
    object: Literal["score"] = "score"
    score: float


class ScoreUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=now)
    model: str
    data: list[ScoreData]  # in pair order
    usage: ScoreUsage
