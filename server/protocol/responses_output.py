"""What POST /v1/responses answers (OpenAI's Responses API): the response object and its output items,
and the events a streamed response is made of. The request is server/protocol/responses.py's.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, RootModel

from server.protocol.common import now

ItemStatus = Literal["in_progress", "completed", "incomplete"]


# ---- the response ----


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: ItemStatus
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str  # what the client's function_call_output names
    name: str
    arguments: str  # JSON text
    status: ItemStatus


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(BaseModel):
    """A reasoning model's thinking (--reasoning-parser), before the message that answers."""

    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)  # no summaries are written: the thinking is given whole
    content: list[ReasoningText]
    status: ItemStatus


OutputItem = Annotated[OutputMessage | OutputFunctionCall | OutputReasoning, Field(discriminator="type")]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0  # the engine does not count prefix-cache hits per request


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    code: str
    message: str


class ReasoningEcho(BaseModel):
    effort: str | None = None  # the request's, as the chat template got it (reasoning_effort)
    summary: None = None


class TextEcho(BaseModel):
    format: dict[str, Any]
    verbosity: str | None = None


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=now)
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool
    previous_response_id: None = None
    reasoning: ReasoningEcho = Field(default_factory=ReasoningEcho)
    store: bool = False  # nothing is stored, whatever the request asked
    temperature: float
    text: TextEcho
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    top_p: float
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)


# ---- the stream ----


class ResponseLifecycleEvent(BaseModel):
    type: Literal[
        "response.created", "response.in_progress", "response.completed", "response.incomplete", "response.failed"
    ]
    sequence_number: int
    response: ResponseObject


class OutputItemEvent(BaseModel):
    type: Literal["response.output_item.added", "response.output_item.done"]
    sequence_number: int
    output_index: int
    item: OutputItem


class ContentPartEvent(BaseModel):
    type: Literal["response.content_part.added", "response.content_part.done"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class TextDeltaEvent(BaseModel):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] = Field(default_factory=list)


class TextDoneEvent(BaseModel):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] = Field(default_factory=list)


class ReasoningDeltaEvent(BaseModel):
    type: Literal["response.reasoning_text.delta"] = "response.reasoning_text.delta"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str


class ReasoningDoneEvent(BaseModel):
    type: Literal["response.reasoning_text.done"] = "response.reasoning_text.done"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str


class ArgumentsDeltaEvent(BaseModel):
    type: Literal["response.function_call_arguments.delta"] = "response.function_call_arguments.delta"
    sequence_number: int
    item_id: str
    output_index: int
    delta: str


class ArgumentsDoneEvent(BaseModel):
    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"
    sequence_number: int
    item_id: str
    output_index: int
    arguments: str


class ErrorEvent(BaseModel):
    """A stream that fails after it started: the server's error (`code`, `message`, `param`), then
    `response.failed`."""

    type: Literal["error"] = "error"
    sequence_number: int
    code: str | None
    message: str
    param: str | None


class ResponseStreamEvent(RootModel):
    """One event of a streamed response, named (`event: <type>`) after its `type`."""

    root: Annotated[
        ResponseLifecycleEvent
        | OutputItemEvent
        | ContentPartEvent
        | TextDeltaEvent
        | TextDoneEvent
        | ReasoningDeltaEvent
        | ReasoningDoneEvent
        | ArgumentsDeltaEvent
        | ArgumentsDoneEvent
        | ErrorEvent,
        Field(discriminator="type"),
    ]
