"""MessageEvents: the content blocks of one Messages API answer, and the stream events that build them.

A streamed message is `message_start` (the message with no content yet), a `ping`, then per content block
(thinking, text, or a tool call) `content_block_start`, its deltas (`thinking_delta`, `text_delta`,
`input_json_delta`) and `content_block_stop`, then `message_delta` (the stop reason and the output tokens)
and `message_stop`. The route feeds the reply as it arrives; a JSON answer feeds it whole and keeps only
`message()`, so both carry the same blocks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from engine.outputs import FINISH_LENGTH
from server.errors import APIError
from server.protocol.anthropic import (
    BlockDeltaEvent,
    BlockStartEvent,
    BlockStopEvent,
    InputJsonDelta,
    MessageDelta,
    MessageDeltaEvent,
    MessageObject,
    MessageStartEvent,
    MessageStopEvent,
    MessagesUsage,
    OutputTokensDetails,
    OutputUsage,
    PingEvent,
    StopReason,
    TextContent,
    TextDelta,
    ThinkingContent,
    ThinkingDelta,
    ToolUseContent,
)
from server.protocol.chat import ResponseToolCall

Event = dict[str, Any]


@dataclass
class _OpenBlock:
    kind: str  # "thinking", "text" or "tool_use"
    parts: list[str] = field(default_factory=list)
    call_id: str = ""
    name: str = ""

    @property
    def text(self) -> str:
        return "".join(self.parts)


def stop_reason(finish_reason: str | None, stop: str | int | None, made_calls: bool) -> tuple[StopReason, str | None]:
    """(Anthropic's stop_reason, the stop sequence that ended it) for the engine's finish."""
    if finish_reason == FINISH_LENGTH:  # first: calls cut by max_tokens are unfinished
        return "max_tokens", None
    if made_calls:
        return "tool_use", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


class MessageEvents:
    def __init__(self, message_id: str, model: str, input_tokens: int) -> None:
        self._id = message_id
        self._model = model
        self._input_tokens = input_tokens
        self._blocks: list[Any] = []
        self._open: _OpenBlock | None = None
        self._made_calls = False
        self._stop: tuple[StopReason | None, str | None] = (None, None)
        self._output_tokens = 0
        self._details: OutputTokensDetails | None = None

    def started(self) -> list[Event]:
        return [MessageStartEvent(message=self.message()).model_dump(), PingEvent().model_dump()]

    def thinking(self, delta: str) -> list[Event]:
        return self._piece("thinking", delta, ThinkingDelta(thinking=delta)) if delta else []

    def text(self, delta: str) -> list[Event]:
        return self._piece("text", delta, TextDelta(text=delta)) if delta else []

    def call(self, call_id: str, name: str) -> list[Event]:
        events = self._close()
        self._open = _OpenBlock("tool_use", call_id=call_id, name=name)
        self._made_calls = True
        start = ToolUseContent(id=call_id, name=name, input={})
        events.append(BlockStartEvent(index=len(self._blocks), content_block=start).model_dump())
        return events

    def arguments(self, delta: str) -> list[Event]:
        block = self._open
        if block is None or block.kind != "tool_use" or not delta:
            return []
        block.parts.append(delta)
        return [BlockDeltaEvent(index=len(self._blocks), delta=InputJsonDelta(partial_json=delta)).model_dump()]

    def whole(self, thought: str | None, content: str | None, calls: list[ResponseToolCall]) -> list[Event]:
        events = self.thinking(thought or "")
        events += self.text(content or "")
        for tool_call in calls:
            events += self.call(tool_call.id, tool_call.function.name)
            events += self.arguments(tool_call.function.arguments)
        return events

    def finished(
        self, finish_reason: str | None, stop: str | int | None, output_tokens: int, thinking_tokens: int | None
    ) -> list[Event]:
        """The last events; thinking_tokens: None without a reasoning parser."""
        events = self._close()
        self._stop = stop_reason(finish_reason, stop, self._made_calls)
        self._output_tokens = output_tokens
        if thinking_tokens is not None:
            self._details = OutputTokensDetails(thinking_tokens=thinking_tokens)
        delta = MessageDelta(stop_reason=self._stop[0], stop_sequence=self._stop[1])
        usage = OutputUsage(output_tokens=output_tokens, output_tokens_details=self._details)
        events.append(MessageDeltaEvent(delta=delta, usage=usage).model_dump())
        events.append(MessageStopEvent().model_dump())
        return events

    def failed(self, error: APIError) -> list[Event]:
        return [error.anthropic_body()]

    def message(self) -> MessageObject:
        usage = MessagesUsage(
            input_tokens=self._input_tokens, output_tokens=self._output_tokens, output_tokens_details=self._details
        )
        return MessageObject(
            id=self._id,
            model=self._model,
            content=list(self._blocks),
            stop_reason=self._stop[0],
            stop_sequence=self._stop[1],
            usage=usage,
        )

    def _piece(self, kind: str, text: str, delta: Any) -> list[Event]:
        events = []
        if self._open is None or self._open.kind != kind:
            events += self._close()
            self._open = _OpenBlock(kind)
            empty = ThinkingContent(thinking="") if kind == "thinking" else TextContent(text="")
            events.append(BlockStartEvent(index=len(self._blocks), content_block=empty).model_dump())
        self._open.parts.append(text)
        events.append(BlockDeltaEvent(index=len(self._blocks), delta=delta).model_dump())
        return events

    def _close(self) -> list[Event]:
        block = self._open
        if block is None:
            return []
        self._open = None
        if block.kind == "thinking":
            self._blocks.append(ThinkingContent(thinking=block.text))
        elif block.kind == "text":
            self._blocks.append(TextContent(text=block.text))
        else:
            self._blocks.append(ToolUseContent(id=block.call_id, name=block.name, input=_arguments(block.text)))
        return [BlockStopEvent(index=len(self._blocks) - 1).model_dump()]


def _arguments(text: str) -> dict[str, Any]:
    """A call's input object (a reply cut mid-call leaves it unparsable: then empty)."""
    try:
        value = json.loads(text) if text else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
