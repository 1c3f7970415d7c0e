"""POST /v1/chat/completions: messages, the request, the JSON answer and the SSE chunks."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, model_serializer

from server.protocol.common import (
    OpenAIHints,
    PositiveCount,
    PromptLogprobs,
    SamplingFields,
    StrictRequest,
    StrictSwitch,
    TopLogprobs,
    Usage,
    described_union,
    now,
    unique_tool_names,
)
from server.protocol.completions import CacheSalt
from server.protocol.structured import GuidedFields, ResponseFormat


class TextContentPart(StrictRequest):
    type: Literal["text"]
    text: str


class FunctionCall(StrictRequest):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(StrictRequest):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(StrictRequest):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: (
        Annotated[
            str | list[TextContentPart],
            described_union('a string or a list of {"type": "text", "text": ...} parts'),
        ]
        | None
    ) = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: which call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


StringOrObject = Annotated[str | dict[str, Any], described_union("a string or an object")]


class FunctionDefinition(StrictRequest):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: StrictSwitch | None = None


class Tool(StrictRequest):
    type: Literal["function"]
    function: FunctionDefinition


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]


class ChatCompletionRequest(SamplingFields, GuidedFields, OpenAIHints):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: PositiveCount | None = None
    max_completion_tokens: PositiveCount | None = None
    logprobs: StrictSwitch = False
    top_logprobs: TopLogprobs | None = None
    add_generation_prompt: StrictSwitch = True
    cache_salt: CacheSalt | None = None
    prompt_cache_key: CacheSalt | None = None  # OpenAI's; a cache salt where cache_salt is absent
    # Extra variables for the chat template (e.g. {"enable_thinking": false}), over the server's
    # --default-chat-template-kwargs; reasoning_effort is one too, and sets a template's thinking switch.
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: ReasoningEffort | None = None
    response_format: ResponseFormat | None = None
    tools: Annotated[list[Tool], unique_tool_names(lambda tool: tool.function.name)] | None = None
    # "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}
    tool_choice: StringOrObject | None = None
    parallel_tool_calls: StrictSwitch = True
    # OpenAI fields kvserve does not implement (400 when set to something that matters).
    functions: list[dict[str, Any]] | None = None
    function_call: StringOrObject | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None

    def unsupported_fields(self) -> list[str]:
        bad = [name for name in ("functions", "audio", "prediction") if getattr(self, name)]
        if self.function_call not in (None, "none"):
            bad.append("function_call")
        if self.modalities not in (None, ["text"]):
            bad.append("modalities")
        return bad


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ToolCallFunction(BaseModel):
    name: str
    arguments: str  # JSON text


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    # A reasoning model's thinking (--reasoning-parser), sent under both names clients read: `reasoning_content`
    # and vLLM's `reasoning`; absent without a parser.
    reasoning_content: str | None = None
    tool_calls: list[ResponseToolCall] | None = None

    @model_serializer
    def _without_empty_tool_calls(self) -> dict[str, Any]:
        body: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.reasoning_content is not None:
            body["reasoning_content"] = body["reasoning"] = self.reasoning_content
        if self.tool_calls:
            body["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        return body


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None  # when the request set prompt_logprobs


class ChatDelta(BaseModel):
    """OpenAI sends only the keys that changed: the role once, then content."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None  # a piece of the thinking, also sent as vLLM's `reasoning`
    tool_calls: list[dict[str, Any]] | None = None  # {"index", "id", "type", "function": {"name", "arguments"}}

    @model_serializer
    def _only_set(self) -> dict[str, Any]:
        pairs = (
            ("role", self.role),
            ("content", self.content),
            ("reasoning_content", self.reasoning_content),
            ("reasoning", self.reasoning_content),
            ("tool_calls", self.tool_calls),
        )
        return {k: v for k, v in pairs if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
