"""ResponseEvents: the output items of one Responses API answer, and the stream events that build them.

A streamed response is a sequence of typed events, numbered by `sequence_number`: the response is
created and in progress; each output item (a message, or a function call) is added, filled with
text or argument deltas, and done; then the response is completed, incomplete (cut by
max_output_tokens) or failed. The route feeds this builder the reply as it arrives (text, the start
of a call, argument fragments) and sends the events it returns; a JSON answer feeds it the whole
reply at once and keeps only `response()`, so both carry the same items.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from server.errors import APIError
from server.protocol.chat import ResponseToolCall
from server.protocol.common import Usage
from server.protocol.responses_output import (
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    ContentPartEvent,
    ErrorEvent,
    IncompleteDetails,
    OutputFunctionCall,
    OutputItem,
    OutputItemEvent,
    OutputMessage,
    OutputReasoning,
    OutputText,
    OutputTokensDetails,
    ReasoningDeltaEvent,
    ReasoningDoneEvent,
    ReasoningText,
    ResponseError,
    ResponseLifecycleEvent,
    ResponseObject,
    ResponseUsage,
    TextDeltaEvent,
    TextDoneEvent,
)

Event = dict[str, Any]
LENGTH = "length"  # the engine's finish reason when max_output_tokens (or the context) cut the reply


@dataclass
class _OpenItem:
    """The output item being filled: its text so far (a message's, or a call's arguments)."""

    index: int
    id: str
    parts: list[str] = field(default_factory=list)
    call_id: str | None = None  # a function call; None for a message or a reasoning item
    name: str = ""
    is_reasoning: bool = False

    @property
    def text(self) -> str:
        return "".join(self.parts)


class ResponseEvents:
    """`base`: the response's fixed fields (id, model, the request's echoed settings), no output yet."""

    def __init__(self, base: ResponseObject) -> None:
        self._base = base
        self._items: list[OutputItem] = []
        self._open: _OpenItem | None = None
        self._sequence = 0
        self._status = "in_progress"
        self._usage: ResponseUsage | None = None
        self._incomplete = False

    def started(self) -> list[Event]:
        """response.created, then response.in_progress."""
        return [self._lifecycle("response.created"), self._lifecycle("response.in_progress")]

    def text(self, delta: str) -> list[Event]:
        """Reply text: opens the message item if none is open (closing a call that was)."""
        events = []
        if self._open is None or self._open.call_id is not None or self._open.is_reasoning:
            events += self._close("completed")
            item = _OpenItem(index=len(self._items), id=f"msg_{uuid.uuid4().hex}")
            self._open = item
            events.append(
                self._item_event("response.output_item.added", item.index, self._message(item, "in_progress"))
            )
            events.append(self._part_event("response.content_part.added", item))
        if delta:
            item = self._open
            item.parts.append(delta)
            events.append(
                self._event(TextDeltaEvent, item_id=item.id, output_index=item.index, content_index=0, delta=delta)
            )
        return events

    def reasoning(self, delta: str) -> list[Event]:
        """A piece of the thinking: opens the reasoning item if it is not open."""
        if not delta:
            return []
        events = []
        if self._open is None or not self._open.is_reasoning:
            events += self._close("completed")
            item = _OpenItem(index=len(self._items), id=f"rs_{uuid.uuid4().hex}", is_reasoning=True)
            self._open = item
            events.append(
                self._item_event("response.output_item.added", item.index, self._reasoning(item, "in_progress"))
            )
        item = self._open
        item.parts.append(delta)
        events.append(
            self._event(ReasoningDeltaEvent, item_id=item.id, output_index=item.index, content_index=0, delta=delta)
        )
        return events

    def call(self, call_id: str, name: str) -> list[Event]:
        """A function call begins (its name is known): closes the item that was open."""
        events = self._close("completed")
        item = _OpenItem(index=len(self._items), id=f"fc_{uuid.uuid4().hex}", call_id=call_id, name=name)
        self._open = item
        events.append(
            self._item_event("response.output_item.added", item.index, self._function_call(item, "in_progress"))
        )
        return events

    def arguments(self, delta: str) -> list[Event]:
        """A fragment of the open call's arguments (JSON text)."""
        item = self._open
        if item is None or item.call_id is None or not delta:
            return []
        item.parts.append(delta)
        return [self._event(ArgumentsDeltaEvent, item_id=item.id, output_index=item.index, delta=delta)]

    def whole(self, content: str | None, calls: list[ResponseToolCall]) -> list[Event]:
        """A whole reply at once: its text (if any, or if there is nothing else), then each call."""
        events = []
        if content is not None and (content or not calls):
            events += self.text(content)
        for tool_call in calls:
            events += self.call(tool_call.id, tool_call.function.name)
            events += self.arguments(tool_call.function.arguments)
        return events

    def finished(self, finish_reason: str | None, usage: Usage) -> list[Event]:
        """The reply ended: the open item is done, then response.completed, or response.incomplete when
        max_output_tokens cut it. A reply with no output at all still has its (empty) message; one cut while
        thinking has only its reasoning item."""
        self._incomplete = finish_reason == LENGTH
        item_status = "incomplete" if self._incomplete else "completed"
        events = []
        if not self._items and self._open is None:
            events += self.text("")
        events += self._close(item_status)
        self._usage = _usage(usage)
        self._status = "incomplete" if self._incomplete else "completed"
        events.append(self._lifecycle(f"response.{self._status}"))
        return events

    def failed(self, error: APIError) -> list[Event]:
        """The stream failed after it started: the error, then response.failed (the output so far, its
        open item incomplete)."""
        if self._open is not None:
            self._items.append(self._final_item(self._open, "incomplete"))
            self._open = None
        self._status = "failed"
        events = [self._event(ErrorEvent, code=error.code, message=error.message, param=error.param)]
        failure = ResponseError(code="server_error", message=error.message)
        events.append(self._lifecycle("response.failed", error=failure))
        return events

    def response(self, **changes: Any) -> ResponseObject:
        """The response as it stands: its status, its items so far, usage once finished."""
        details = IncompleteDetails(reason="max_output_tokens") if self._incomplete else None
        update = {
            "status": self._status,
            "output": list(self._items),
            "usage": self._usage,
            "incomplete_details": details,
            **changes,
        }
        return self._base.model_copy(update=update)

    # ---- building the events ----

    def _close(self, status: str) -> list[Event]:
        """The done events of the open item, if any: a message's text and part, a call's arguments."""
        item = self._open
        if item is None:
            return []
        self._open = None
        events = []
        if item.is_reasoning:
            events.append(
                self._event(
                    ReasoningDoneEvent, item_id=item.id, output_index=item.index, content_index=0, text=item.text
                )
            )
        elif item.call_id is None:
            events.append(
                self._event(TextDoneEvent, item_id=item.id, output_index=item.index, content_index=0, text=item.text)
            )
            events.append(self._part_event("response.content_part.done", item))
        else:
            events.append(
                self._event(ArgumentsDoneEvent, item_id=item.id, output_index=item.index, arguments=item.text)
            )
        final = self._final_item(item, status)
        self._items.append(final)
        events.append(self._item_event("response.output_item.done", item.index, final))
        return events

    def _final_item(self, item: _OpenItem, status: str) -> OutputItem:
        if item.is_reasoning:
            return self._reasoning(item, status)
        return self._message(item, status) if item.call_id is None else self._function_call(item, status)

    @staticmethod
    def _reasoning(item: _OpenItem, status: str) -> OutputReasoning:
        content = [ReasoningText(text=item.text)] if status != "in_progress" else []
        return OutputReasoning(id=item.id, status=status, content=content)

    @staticmethod
    def _message(item: _OpenItem, status: str) -> OutputMessage:
        content = [OutputText(text=item.text)] if status != "in_progress" else []
        return OutputMessage(id=item.id, status=status, content=content)

    @staticmethod
    def _function_call(item: _OpenItem, status: str) -> OutputFunctionCall:
        assert item.call_id is not None
        return OutputFunctionCall(id=item.id, call_id=item.call_id, name=item.name, arguments=item.text, status=status)

    def _item_event(self, kind: str, index: int, item: OutputItem) -> Event:
        return self._event(OutputItemEvent, type=kind, output_index=index, item=item)

    def _part_event(self, kind: str, item: _OpenItem) -> Event:
        part = OutputText(text=item.text)
        return self._event(
            ContentPartEvent, type=kind, item_id=item.id, output_index=item.index, content_index=0, part=part
        )

    def _lifecycle(self, kind: str, **changes: Any) -> Event:
        return self._event(ResponseLifecycleEvent, type=kind, response=self.response(**changes))

    def _event(self, model: type, **fields: Any) -> Event:
        event = model(sequence_number=self._sequence, **fields).model_dump()
        self._sequence += 1
        return event


def _usage(usage: Usage) -> ResponseUsage:
    details = usage.completion_tokens_details
    return ResponseUsage(
        input_tokens=usage.prompt_tokens,
        output_tokens=usage.completion_tokens,
        output_tokens_details=OutputTokensDetails(reasoning_tokens=details.reasoning_tokens if details else 0),
        total_tokens=usage.total_tokens,
    )
