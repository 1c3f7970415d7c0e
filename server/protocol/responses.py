"""POST /v1/responses (OpenAI's Responses API): the request and its input items (the response object and
the events a streamed response is made of: server/protocol/responses_output.py).

The route (server/routes/responses.py) maps a request onto the chat machinery, so this module only
says which shapes are accepted: text input (a string, or message items with text parts), the function
calls and results of a tool round trip, `text.format` for structured output, the flat function tools.
Responses are not stored, so nothing here refers to an earlier response except to refuse it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, ConfigDict, Discriminator, Field, Tag
from pydantic_core import PydanticCustomError

from server.protocol.chat import ReasoningEffort
from server.protocol.common import (
    Metadata,
    PositiveCount,
    Seed,
    StrictRequest,
    StrictSwitch,
    Temperature,
    TopP,
    described_union,
    unique_tool_names,
)
from server.protocol.completions import CacheSalt
from server.protocol.responses_output import ItemStatus

FUNCTION_NAME = r"^[A-Za-z0-9_.-]{1,64}$"  # the chat route's rule for tool names


# ---- the request ----


class TextPart(StrictRequest):
    """A text part of a message: `input_text`, or `output_text` as an earlier response's output carries
    it when a client sends that output back (its annotations and logprobs are accepted and ignored)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


MessageContent = Annotated[
    str | list[TextPart],
    described_union('a string or a list of {"type": "input_text" or "output_text", "text": ...} parts'),
]


class MessageItem(StrictRequest):
    """A message; `type` may be left out. `id` and `status` come with an earlier response's output."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: MessageContent
    id: str | None = None
    status: ItemStatus | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class FunctionCallItem(StrictRequest):
    """A call the model made in an earlier turn (an earlier response's `function_call` output item)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text
    id: str | None = None
    status: ItemStatus | None = None


class FunctionCallOutputItem(StrictRequest):
    """The client's result of a call: `call_id` names the call it answers."""

    type: Literal["function_call_output"]
    call_id: str
    output: MessageContent
    id: str | None = None
    status: ItemStatus | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(part.text for part in self.output)


def _item_type(value: Any) -> str | None:
    """A message item may leave `type` out (OpenAI's "easy" input message)."""
    if isinstance(value, dict):
        return value.get("type", "message")
    return getattr(value, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(
        _item_type,
        custom_error_type="invalid_item",
        custom_error_message='must be an item of type "message", "function_call" or "function_call_output"',
    ),
]


def _as_items(value: Any) -> Any:
    """A string input is one user message: validated as the list it stands for, so an error in an
    item names its place (`input.0.content`)."""
    if not isinstance(value, str | list):
        raise PydanticCustomError("invalid_value", "must be a string or a list of input items")
    if not value:
        raise PydanticCustomError("invalid_value", "must not be empty")
    return [{"role": "user", "content": value}] if isinstance(value, str) else value


Input = Annotated[
    list[InputItem],
    BeforeValidator(
        _as_items,
        json_schema_input_type=Annotated[str, Field(min_length=1)] | Annotated[list[InputItem], Field(min_length=1)],
    ),
]


class FunctionTool(StrictRequest):
    """The Responses API's flat function tool (chat nests the same fields under `function`)."""

    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: StrictSwitch | None = None  # accepted; the schema is always enforced when a call is required


class FunctionChoice(StrictRequest):
    type: Literal["function"]
    name: str


ToolChoice = Annotated[
    Literal["none", "auto", "required"] | FunctionChoice,
    described_union('"none", "auto", "required" or {"type": "function", "name": ...}'),
]


class TextFormatText(StrictRequest):
    type: Literal["text"]


class TextFormatJsonObject(StrictRequest):
    type: Literal["json_object"]


class TextFormatJsonSchema(StrictRequest):
    type: Literal["json_schema"]
    name: str = Field(max_length=64)
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: StrictSwitch | None = None  # accepted; the schema is always enforced

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


TextFormat = Annotated[TextFormatText | TextFormatJsonObject | TextFormatJsonSchema, Field(discriminator="type")]


class TextConfig(StrictRequest):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # a hint; accepted and ignored


class ReasoningConfig(StrictRequest):
    """`effort` goes to the chat template as chat's reasoning_effort does (its own variable, or its thinking
    switch); summaries are not written (a reasoning item holds the thinking whole)."""

    effort: ReasoningEffort | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesStreamOptions(StrictRequest):
    include_obfuscation: StrictSwitch | None = None  # padding against length side channels; never added


class ResponsesRequest(StrictRequest):
    model: str | None = None
    input: Input
    instructions: str | None = None
    max_output_tokens: PositiveCount | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    seed: Seed | None = None  # not in OpenAI's Responses API; the SDK sends it through extra_body
    speculative: StrictSwitch = True  # kvserve's, as chat's: false keeps it out of speculative decoding
    stream: StrictSwitch = False
    stream_options: ResponsesStreamOptions | None = None
    store: StrictSwitch | None = None  # accepted; responses are never stored
    text: TextConfig | None = None
    tools: Annotated[list[FunctionTool], unique_tool_names(lambda tool: tool.name)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: StrictSwitch | None = None
    metadata: Metadata | None = None
    user: str | None = None
    safety_identifier: str | None = None
    # Both split the prefix cache: requests share cached prefixes only with requests of the same salt;
    # prompt_cache_key stands for cache_salt when that is absent.
    cache_salt: CacheSalt | None = None
    prompt_cache_key: CacheSalt | None = None
    reasoning: ReasoningConfig | None = None
    truncation: Literal["auto", "disabled"] | None = None  # nothing is dropped: a prompt too long is a 400
    # OpenAI fields kvserve does not implement (400 when set to something that matters; see the route
    # for previous_response_id, which gets its own message).
    previous_response_id: str | None = None
    background: StrictSwitch | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    include: list[str] | None = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None

    def unsupported_fields(self) -> list[str]:
        bad = [
            name for name in ("background", "conversation", "prompt", "include", "top_logprobs") if getattr(self, name)
        ]
        if self.max_tool_calls is not None:
            bad.append("max_tool_calls")
        return bad
