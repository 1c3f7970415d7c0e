"""HTTP shapes of the embedding endpoints: OpenAI's /v1/embeddings and TEI's /embed.

Requests forbid unknown fields (a 400 naming the field), like every request here.
Responses are documented here; the routes build the same shapes as plain dicts, since
validating thousands of floats per vector through pydantic would cost more than the forward.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

from server.protocol.common import PositiveCount, StrictSwitch, TextsOrTokenIds, TruncationFields

# OpenAI: a string, a list of strings, one token-id list, or a list of token-id lists.
EmbeddingInput = TextsOrTokenIds


class EmbeddingRequest(TruncationFields):
    """POST /v1/embeddings. `model` may be omitted (the served embedding model); `user` is accepted and ignored.
    The truncation fields are kvserve/TEI extras: OpenAI has no truncation switch (inputs over the limit are a 400)."""

    input: EmbeddingInput
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: PositiveCount | None = None  # at most the model's hidden size (the embedder checks)
    user: str | None = None


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # str: base64 of little-endian float32


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


class EmbedRequest(TruncationFields):
    """POST /embed (text-embeddings-inference)."""

    inputs: EmbeddingInput
    normalize: StrictSwitch = True
    dimensions: PositiveCount | None = None


# POST /embed answers a bare JSON list of vectors, one per input, in input order.
EmbedResponse = list[list[float]]
