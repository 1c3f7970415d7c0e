"""Ollama's API under /api: the requests, answers and stream lines the `ollama` client reads.

Numbers in `options` are Ollama's: `num_predict` -1 (or -2) is "until the context is full"; `seed`,
`top_k` and `num_ctx` are integers; the load-time options are accepted (this server loads its models
once, at start).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from engine.params import MAX_COUNT, MAX_SEED
from server.protocol.chat import Tool
from server.protocol.common import (
    Count,
    Penalty,
    Probability,
    RepetitionPenalty,
    StopString,
    StrictRequest,
    StrictSwitch,
    Temperature,
    TopLogprobs,
    TopP,
    unique_tool_names,
)

KeepAlive = float | int | str  # seconds, or a duration ("5m", "1h"); negative: forever; 0: unload when idle
Think = StrictSwitch | Literal["low", "medium", "high"]
Format = Literal["", "json"] | dict[str, Any]  # "json": any JSON object; an object: a JSON schema


class Options(StrictRequest):
    # load time: accepted, without effect (the server's flags set these once)
    numa: StrictSwitch | None = None
    num_batch: int | None = None
    num_gpu: int | None = None
    main_gpu: int | None = None
    low_vram: StrictSwitch | None = None
    f16_kv: StrictSwitch | None = None
    logits_all: StrictSwitch | None = None
    vocab_only: StrictSwitch | None = None
    use_mmap: StrictSwitch | None = None
    use_mlock: StrictSwitch | None = None
    embedding_only: StrictSwitch | None = None
    num_thread: int | None = None
    num_keep: int | None = None
    # run time
    num_ctx: Annotated[int, Field(strict=True, ge=1, le=MAX_COUNT)] | None = None
    seed: Annotated[int, Field(strict=True, ge=-(2**63), le=MAX_SEED)] | None = None  # negative: a random seed
    num_predict: Annotated[int, Field(strict=True, ge=-2, le=MAX_COUNT)] | None = None
    top_k: Annotated[int, Field(strict=True, ge=0, le=MAX_COUNT)] | None = None  # 0: off
    top_p: TopP | None = None
    min_p: Probability | None = None
    temperature: Temperature | None = None
    repeat_penalty: RepetitionPenalty | None = None
    repeat_last_n: Annotated[int, Field(strict=True, ge=-1)] | None = None  # the penalty sees the whole context
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    stop: list[StopString] | None = None
    # samplers this server does not have: accepted at the values that turn them off
    typical_p: Annotated[float, Field(ge=1, le=1)] | None = None
    tfs_z: Annotated[float, Field(ge=1, le=1)] | None = None
    mirostat: Literal[0] | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    penalize_newline: StrictSwitch | None = None


class ToolCallFunction(StrictRequest):
    name: str
    arguments: dict[str, Any]
    index: int | None = None


class ToolCall(StrictRequest):
    id: str | None = None
    type: Literal["function"] | None = None
    function: ToolCallFunction


class Message(StrictRequest):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    thinking: str | None = None  # an earlier answer's: chat templates leave it out
    images: list[str] | None = None  # accepted by the schema so the 400 can name it: the models read text
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None  # a tool turn: which tool answered
    tool_call_id: str | None = None


Tools = Annotated[list[Tool], unique_tool_names(lambda tool: tool.function.name)]


class _Generation(StrictRequest):
    model: str = Field(min_length=1)
    stream: StrictSwitch = True  # Ollama streams unless told not to
    options: Options | None = None
    format: Format | None = None
    keep_alive: KeepAlive | None = None
    think: Think | None = None
    logprobs: StrictSwitch = False
    top_logprobs: TopLogprobs | None = None


class ChatRequest(_Generation):
    messages: list[Message] = Field(default_factory=list)  # none: only load the model
    tools: Tools | None = None


class GenerateRequest(_Generation):
    prompt: str | None = None  # none or empty: only load the model
    system: str | None = None
    raw: StrictSwitch = False  # true: the prompt as is, not through the chat template
    context: list[Count] | None = None  # an earlier answer's `context`: the conversation so far, as tokens
    images: list[str] | None = None
    suffix: str | None = None  # fill-in-the-middle: not supported, a 400
    template: str | None = None  # a Go template of Ollama's: not supported, a 400


class EmbedRequest(StrictRequest):
    model: str = Field(min_length=1)
    input: str | list[str]
    truncate: StrictSwitch = True
    dimensions: Annotated[int, Field(strict=True, ge=1)] | None = None
    options: Options | None = None
    keep_alive: KeepAlive | None = None


class EmbeddingsRequest(StrictRequest):
    """The older embedding route: one prompt, its vector as the model pools it (not normalized)."""

    model: str = Field(min_length=1)
    prompt: str
    options: Options | None = None
    keep_alive: KeepAlive | None = None


class ShowRequest(StrictRequest):
    model: str | None = None
    name: str | None = None  # the older spelling of `model`
    verbose: StrictSwitch | None = None


# ---- answers ----


class Details(BaseModel):
    parent_model: str = ""
    format: str  # "gguf" or "safetensors"
    family: str
    families: list[str]
    parameter_size: str
    quantization_level: str


class ListedModel(BaseModel):
    name: str
    model: str
    modified_at: str
    size: int  # the weights' bytes in memory
    digest: str  # the model's identity (its path and name), not a hash of the file's bytes
    details: Details


class ModelList(BaseModel):
    models: list[ListedModel]


class RunningModel(ListedModel):
    expires_at: str  # models stay loaded: far in the future
    size_vram: int  # bytes on the GPU: 0 on a CPU
    context_length: int


class RunningModels(BaseModel):
    models: list[RunningModel]


class ShowResponse(BaseModel):
    modelfile: str
    parameters: str
    template: str
    details: Details
    model_info: dict[str, Any]
    capabilities: list[str]
    modified_at: str


class Version(BaseModel):
    version: str


class AnswerToolCall(BaseModel):
    id: str
    function: ToolCallFunction


class AnswerMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str
    thinking: str | None = Field(default=None, exclude_if=lambda value: value is None)
    tool_calls: list[AnswerToolCall] | None = Field(default=None, exclude_if=lambda value: value is None)


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class Logprob(TokenLogprob):
    top_logprobs: list[TokenLogprob] = Field(default_factory=list)


class _Line(BaseModel):
    """What every answer and stream line holds; the last (`done`) also the reason and the timings (ns)."""

    model: str
    created_at: str
    done: bool
    done_reason: str | None = Field(default=None, exclude_if=lambda value: value is None)
    total_duration: int | None = Field(default=None, exclude_if=lambda value: value is None)
    load_duration: int | None = Field(default=None, exclude_if=lambda value: value is None)
    prompt_eval_count: int | None = Field(default=None, exclude_if=lambda value: value is None)
    prompt_eval_duration: int | None = Field(default=None, exclude_if=lambda value: value is None)
    eval_count: int | None = Field(default=None, exclude_if=lambda value: value is None)
    eval_duration: int | None = Field(default=None, exclude_if=lambda value: value is None)
    logprobs: list[Logprob] | None = Field(default=None, exclude_if=lambda value: value is None)


class ChatLine(_Line):
    message: AnswerMessage


class GenerateLine(_Line):
    response: str
    thinking: str | None = Field(default=None, exclude_if=lambda value: value is None)
    context: list[int] | None = Field(default=None, exclude_if=lambda value: value is None)


class EmbedResponse(BaseModel):
    model: str
    embeddings: list[list[float]]
    total_duration: int
    load_duration: int
    prompt_eval_count: int


class EmbeddingsResponse(BaseModel):
    embedding: list[float]


class OllamaError(BaseModel):
    """Every error of the /api routes, and the last line of a stream that fails after it began."""

    error: str
