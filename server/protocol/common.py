"""Shapes shared by several endpoints: the strict request base, the sampling fields of
completions and chat, token usage, and the /v1/models cards."""

from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

TokenId = Annotated[int, Field(ge=0)]


class StrictRequest(BaseModel):
    """A request body: an unknown field is a 400 naming it."""

    model_config = ConfigDict(extra="forbid")


def now() -> int:
    return int(time.time())


class StreamOptions(StrictRequest):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(StrictRequest):
    """Sampling fields shared by completions and chat (OpenAI names plus vLLM's extras)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    user: str | None = None
    # vLLM extras
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "kvserve"
    root: str
    max_model_len: int
    task: Literal["generate", "embed"]


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
