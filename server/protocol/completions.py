"""POST /v1/completions: the request, the JSON answer and the SSE chunks (same shape, no usage)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

from engine.params import MAX_CACHE_SALT_CHARS
from server.protocol.common import (
    NumSamples,
    PositiveCount,
    PromptLogprobs,
    SamplingFields,
    StrictSwitch,
    TextsOrTokenIds,
    TopLogprobs,
    Usage,
    now,
)
from server.protocol.structured import GuidedFields

# vLLM's tenant isolation: requests with different salts never share prefix-cache blocks.
CacheSalt = Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT_CHARS)]


class CompletionRequest(SamplingFields, GuidedFields):
    prompt: TextsOrTokenIds
    max_tokens: PositiveCount | None = None  # None: --default-max-tokens, else OpenAI's 16
    logprobs: TopLogprobs | None = None  # OpenAI allows 0..5; kvserve 0..20, like chat's top_logprobs
    echo: StrictSwitch = False
    add_special_tokens: StrictSwitch = True
    cache_salt: CacheSalt | None = None
    # OpenAI fields kvserve does not implement (400 when set).
    suffix: str | None = None
    best_of: NumSamples | None = None

    def unsupported_fields(self) -> list[str]:
        bad = []
        if self.suffix:
            bad.append("suffix")
        if self.best_of is not None and self.best_of != self.n:
            bad.append("best_of")
        return bad


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_logprobs: PromptLogprobs | None = None  # when the request set prompt_logprobs


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
