"""Shapes shared by several endpoints: the strict request base, the sampling fields of
completions and chat, token usage, the /v1/models cards, the error body and /health's body."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    field_validator,
)
from pydantic_core import PydanticCustomError

from engine.params import (
    MAX_ABS_LOGIT_BIAS,
    MAX_ABS_PENALTY,
    MAX_COUNT,
    MAX_REPETITION_PENALTY,
    MAX_SAMPLES,
    MAX_SEED,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_TEMPERATURE,
    MAX_TOP_LOGPROBS,
)

# Every number is strict (`true` is not 1, "2" is not 2) and bounded, with the engine's own bounds
# (engine/params.py), so a value the engine could not use is a 400 naming its field here.
TokenId = Annotated[int, Field(strict=True, ge=0)]
Count = Annotated[int, Field(strict=True, ge=0, le=MAX_COUNT)]
PositiveCount = Annotated[int, Field(strict=True, ge=1, le=MAX_COUNT)]  # max_tokens, dimensions
NumSamples = Annotated[int, Field(strict=True, ge=1, le=MAX_SAMPLES)]
TopLogprobs = Annotated[int, Field(strict=True, ge=0, le=MAX_TOP_LOGPROBS)]
# A switch that must be a JSON boolean: "yes", 1 or "true" are 400s, not True.
StrictSwitch = Annotated[bool, Field(strict=True)]


def _number(low: float, high: float, low_open: bool = False) -> Any:
    bound = {"gt": low} if low_open else {"ge": low}
    return Annotated[float, Field(strict=True, le=high, allow_inf_nan=False, **bound)]


def described_union(expected: str) -> WrapValidator:
    """One error naming the field when a value fits no member of a union (instead of one error per
    member, each at a path through the member's type name)."""

    def validate(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("invalid_value", "must be {expected}", {"expected": expected}) from None

    return WrapValidator(validate)


def unique_tool_names(name_of: Callable[[Any], str]) -> AfterValidator:
    """A list of tools whose names (`name_of(tool)`) all differ: a model calls a tool by its name, so two
    of one name could not be told apart. The error names the first name given twice."""

    def validate(tools: list[Any]) -> list[Any]:
        seen: set[str] = set()
        for tool in tools:
            name = name_of(tool)
            if name in seen:
                raise PydanticCustomError("duplicate_name", 'two tools are named "{name}"', {"name": name})
            seen.add(name)
        return tools

    return AfterValidator(validate)


Temperature = _number(0.0, MAX_TEMPERATURE)
UnitTemperature = _number(0.0, 1.0)  # Anthropic's range
Probability = _number(0.0, 1.0)  # min_p
TopP = _number(0.0, 1.0, low_open=True)
Penalty = _number(-MAX_ABS_PENALTY, MAX_ABS_PENALTY)  # presence_penalty, frequency_penalty
RepetitionPenalty = _number(0.0, MAX_REPETITION_PENALTY, low_open=True)
LogitBias = _number(-MAX_ABS_LOGIT_BIAS, MAX_ABS_LOGIT_BIAS)
Seed = Annotated[int, Field(strict=True, ge=0, le=MAX_SEED)]
TopK = Annotated[int, Field(strict=True, ge=-1, le=MAX_COUNT)]  # -1 or 0: disabled
StopString = Annotated[str, Field(max_length=MAX_STOP_STRING_CHARS)]
Stop = Annotated[
    StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)],
    described_union(
        f"a string or a list of at most {MAX_STOP_STRINGS} strings, "
        f"each at most {MAX_STOP_STRING_CHARS} characters long"
    ),
]
# Prompts (completions) and inputs (embeddings): one text, several, one token-id list, or several.
TextsOrTokenIds = Annotated[
    str | list[str] | list[TokenId] | list[list[TokenId]],
    described_union(
        "a string, a list of strings, a list of token ids or a list of token-id lists "
        "(a token id is a non-negative integer)"
    ),
]


class StrictRequest(BaseModel):
    """A request body: an unknown field is a 400 naming it."""

    model_config = ConfigDict(extra="forbid")


def now() -> int:
    return int(time.time())


Metadata = Annotated[
    dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]], Field(max_length=16)
]


class OpenAIHints(StrictRequest):
    """OpenAI fields that change nothing a self-hosted server generates, accepted so today's clients and agent
    frameworks can send them: checked as OpenAI checks them, then ignored (`store: true` is refused by the
    route, since nothing is stored; `prompt_cache_key` is read by the route as a cache salt)."""

    metadata: Metadata | None = None
    store: StrictSwitch | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    safety_identifier: Annotated[str, Field(max_length=64)] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    prompt_cache_retention: Literal["in-memory", "24h"] | None = None  # cached prefixes live as the cache decides


class StreamOptions(StrictRequest):
    include_usage: StrictSwitch = False
    continuous_usage_stats: StrictSwitch = False


class TruncationFields(StrictRequest):
    """TEI's switch for inputs over the model's limit (the encoder routes): cut them when `truncate`, from the
    `truncation_direction` side, else a 400. TEI spells directions "Right"/"Left"; either case is accepted."""

    truncate: StrictSwitch = False
    truncation_direction: Literal["right", "left"] = "right"

    @field_validator("truncation_direction", mode="before")
    @classmethod
    def _lower(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value


class SamplingFields(StrictRequest):
    """Sampling fields shared by completions and chat (OpenAI names plus vLLM's extras)."""

    model: str | None = None
    n: NumSamples = 1
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stop: Stop | None = None
    stream: StrictSwitch = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    # keys: token ids as strings (JSON keys are strings), checked in server/openai/params.py
    logit_bias: dict[str, LogitBias] | None = None
    seed: Seed | None = None
    user: str | None = None
    # vLLM extras
    top_k: TopK = 0
    min_p: Probability = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    min_tokens: Count = 0
    stop_token_ids: list[Count] | None = None
    ignore_eos: StrictSwitch = False
    include_stop_str_in_output: StrictSwitch = False
    skip_special_tokens: StrictSwitch = True
    # vLLM's: the logprob, rank and top alternatives of every prompt token (the first is null)
    prompt_logprobs: TopLogprobs | None = None
    # kvserve's: false keeps this request out of speculative decoding (--speculative-method); its tokens
    # are the same either way (greedy and seeded: identical; unseeded: the same distribution)
    speculative: StrictSwitch = True


class PromptTokenLogprob(BaseModel):
    """One entry of vLLM's prompt_logprobs: a token's logprob, its rank (1 = likeliest) and text."""

    logprob: float
    rank: int | None = None
    decoded_token: str


# Per prompt token: token id (as a string) -> its entry, for the prompt token and its top alternatives.
PromptLogprobs = list[dict[str, PromptTokenLogprob] | None]


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int  # the thinking's tokens, its tags included (--reasoning-parser)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # Set where the server parses reasoning (--reasoning-parser); absent otherwise.
    completion_tokens_details: CompletionTokensDetails | None = Field(default=None, exclude_if=lambda v: v is None)


class ModelRuntime(BaseModel):
    """What a generation model runs on, so a benchmark can say what ran."""

    device: str
    cpu_features: list[str]  # on CPU: the SIMD features its kernels were chosen by (empty elsewhere)
    kernel_build: str | None  # the native kernels' instruction-set build (avx2, avxvnni, ...); None: torch only
    prefill_dtype: str | None  # its GGUF block layers' prefill products (--prefill-dtype); None: no such layers
    kv_cache_dtype: str  # its KV cache's format (--kv-cache-dtype, auto resolved): float32, float16, bfloat16, int8
    kv_bytes_per_token: int  # one token's keys and values over every layer, in that format


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "kvserve"
    root: str
    max_model_len: int | None  # None until the model is loaded
    task: Literal["generate", "embed", "rerank"]
    runtime: ModelRuntime | None = None  # a loaded generation model's
    loaded: bool = True
    # "loaded", "loading", "unloading" (its engine stopping, its memory being freed), "unloaded" (loads on its
    # first request) or "failed" (its last load failed)
    status: Literal["loaded", "loading", "unloading", "unloaded", "failed"] = "loaded"
    memory_bytes: int | None = None  # what it holds (weights plus KV cache); estimated when not loaded
    expires_at: int | None = None  # Unix time it unloads if still idle; None: in use, or kept loaded


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str  # e.g. "invalid_request_error", "rate_limit_error", "service_unavailable"
    param: str | None  # the request field at fault, when one is
    code: str | None  # e.g. "queue_full", "request_timeout", "model_not_found"


class ErrorResponse(BaseModel):
    """The one error body (OpenAI's) of every failure, and of the SSE error event of a stream that fails."""

    error: ErrorDetail


class HealthStatus(BaseModel):
    """GET /health: "ok" (200); "loading", "draining" or "error" with a message (503)."""

    status: Literal["ok", "loading", "draining", "error"]
    message: str | None = None
