"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API, its request, answer and stream
events (the shapes the `anthropic` SDK reads)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, RootModel

from server.protocol.common import (
    PositiveCount,
    StopString,
    StrictRequest,
    StrictSwitch,
    TopK,
    TopP,
    UnitTemperature,
    unique_tool_names,
)

MAX_STOP_SEQUENCES = 16


class CacheControl(StrictRequest):
    type: Literal["ephemeral"]
    ttl: str | None = None


class TextBlock(StrictRequest):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None  # accepted: the prefix cache needs no hint
    citations: list[Any] | None = None


class ToolUseBlock(StrictRequest):
    """An assistant turn's call (in the conversation so far)."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None
    caller: dict[str, Any] | None = None  # who made the call (programmatic tool calling): ignored
    toolset_name: str | None = None


class ToolResultBlock(StrictRequest):
    """A user turn's answer to a call."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: StrictSwitch | None = None
    cache_control: CacheControl | None = None
    toolset_name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(block.text for block in self.content)


class ThinkingBlock(StrictRequest):
    """An earlier answer's thinking, sent back with the conversation; chat templates drop it from history."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(StrictRequest):
    type: Literal["redacted_thinking"]
    data: str


class ImageBlock(StrictRequest):
    """Accepted by the schema so the 400 can name it: the served models read text only."""

    type: Literal["image", "document"]
    source: dict[str, Any]
    cache_control: CacheControl | None = None


ContentBlock = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock | ImageBlock,
    Field(discriminator="type"),
]


class Message(StrictRequest):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class ToolDefinition(StrictRequest):
    """A client tool. Anthropic's server tools (web search, code execution, ...) have a `type`: a 400."""

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None
    # Accepted, no effect: calls are always constrained to the schema (strict), nothing is deferred, the
    # input streams as it is generated.
    strict: StrictSwitch | None = None
    defer_loading: StrictSwitch | None = None
    eager_input_streaming: StrictSwitch | None = None
    input_examples: list[dict[str, Any]] | None = None
    allowed_callers: list[str] | None = None

    model_config = ConfigDict(extra="forbid")


class ToolChoice(StrictRequest):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: StrictSwitch | None = None


class ThinkingConfig(StrictRequest):
    """`enabled` / `disabled`: the chat template's thinking switch (`enable_thinking`); `adaptive` and
    `between_tools` leave the template's default. `budget_tokens` is accepted, the thinking ends when the
    model ends it (or at max_tokens); `display` is accepted, the thinking always comes back whole."""

    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = Field(default=None, strict=True, ge=0)
    display: Literal["summarized", "omitted"] | None = None


class OutputFormat(StrictRequest):
    """The answer constrained to a JSON schema (structured output, after any thinking)."""

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(StrictRequest):
    """`effort` is the template's `reasoning_effort` (and its thinking switch, as chat's reasoning_effort);
    `format` constrains the answer."""

    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class Diagnostics(StrictRequest):
    previous_message_id: str | None = None


class MessagesMetadata(StrictRequest):
    user_id: str | None = Field(default=None, max_length=256)


System = str | list[TextBlock]
Tools = Annotated[list[ToolDefinition], unique_tool_names(lambda tool: tool.name)]


class MessagesRequest(StrictRequest):
    model: str
    max_tokens: PositiveCount
    messages: list[Message] = Field(min_length=1)
    system: System | None = None
    stop_sequences: Annotated[list[StopString], Field(max_length=MAX_STOP_SEQUENCES)] | None = None
    temperature: UnitTemperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    stream: StrictSwitch = False
    tools: Tools | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    metadata: MessagesMetadata | None = None
    output_config: OutputConfig | None = None
    # Accepted, no effect: the prefix cache needs no hint, there is one tier, one speed and one place here.
    cache_control: CacheControl | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    speed: Literal["standard", "fast"] | None = None
    inference_geo: str | None = None
    diagnostics: Diagnostics | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None


class CountTokensRequest(StrictRequest):
    model: str
    messages: list[Message] = Field(min_length=1)
    system: System | None = None
    tools: Tools | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl | None = None


class TokenCount(BaseModel):
    input_tokens: int


# ---- the answer ----


class TextContent(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ThinkingContent(BaseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""  # nothing is signed: the thinking comes back as the client sends it


class ToolUseContent(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


AnswerBlock = Annotated[TextContent | ThinkingContent | ToolUseContent, Field(discriminator="type")]
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class OutputTokensDetails(BaseModel):
    thinking_tokens: int  # the thinking block's tokens, its tags included


class MessagesUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0
    output_tokens_details: OutputTokensDetails | None = Field(default=None, exclude_if=lambda value: value is None)


class MessageObject(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[AnswerBlock]
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: MessagesUsage


# ---- the stream ----


class MessageStartEvent(BaseModel):
    type: Literal["message_start"] = "message_start"
    message: MessageObject


class PingEvent(BaseModel):
    type: Literal["ping"] = "ping"


class BlockStartEvent(BaseModel):
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: AnswerBlock


class TextDelta(BaseModel):
    type: Literal["text_delta"] = "text_delta"
    text: str


class ThinkingDelta(BaseModel):
    type: Literal["thinking_delta"] = "thinking_delta"
    thinking: str


class SignatureDelta(BaseModel):
    type: Literal["signature_delta"] = "signature_delta"
    signature: str


class InputJsonDelta(BaseModel):
    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str


class BlockDeltaEvent(BaseModel):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: Annotated[TextDelta | ThinkingDelta | SignatureDelta | InputJsonDelta, Field(discriminator="type")]


class BlockStopEvent(BaseModel):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class MessageDelta(BaseModel):
    stop_reason: StopReason | None
    stop_sequence: str | None = None


class OutputUsage(BaseModel):
    output_tokens: int
    output_tokens_details: OutputTokensDetails | None = Field(default=None, exclude_if=lambda value: value is None)


class MessageDeltaEvent(BaseModel):
    type: Literal["message_delta"] = "message_delta"
    delta: MessageDelta
    usage: OutputUsage


class MessageStopEvent(BaseModel):
    type: Literal["message_stop"] = "message_stop"


class AnthropicErrorDetail(BaseModel):
    type: str  # invalid_request_error, authentication_error, not_found_error, rate_limit_error, overloaded_error, ...
    message: str


class AnthropicError(BaseModel):
    """Every error of the Messages routes, and the `error` event of a stream that fails after it began."""

    type: Literal["error"] = "error"
    error: AnthropicErrorDetail


class MessagesStreamEvent(RootModel):
    """One event of a streamed message, named (`event: <type>`) after its `type`."""

    root: Annotated[
        MessageStartEvent
        | PingEvent
        | BlockStartEvent
        | BlockDeltaEvent
        | BlockStopEvent
        | MessageDeltaEvent
        | MessageStopEvent
        | AnthropicError,
        Field(discriminator="type"),
    ]
