"""ToolReplyStream: a constrained tool-call reply turned into OpenAI stream deltas as it is generated.

The reply's framing is fixed by its grammar (server/openai/tools.py), so it can be read as it grows:
each call's name is sent once it is complete, then its arguments as JSON text fragments as they
arrive; with "auto" in the generic format a `{"response":"...` answer is sent as content, its
JSON string decoded piece by piece. Only the parts that are certain are sent: an escape cut in
two waits for its second half.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class Framing:
    """The literal text around the calls of one format (compact JSON, properties in schema order)."""

    start: str  # before the first call
    call_open: str  # up to the name's first character
    name_end: str  # from the name's closing quote to the arguments' first character
    call_close: str  # after the arguments object
    separator: str  # between two calls
    answer_open: str | None = None  # a text answer instead of calls ("auto", generic format)


GENERIC = Framing('{"tool_calls":[', '{"name":"', '","arguments":', "}", ",", answer_open='{"response":"')
GENERIC_CALLS_ONLY = Framing('{"tool_calls":[', '{"name":"', '","arguments":', "}", ",")
HERMES = Framing("", '<tool_call>\n{"name":"', '","arguments":', "}\n</tool_call>", "\n")


class ToolReplyStream:
    def __init__(self, framing: Framing) -> None:
        self.framing = framing
        self.text = ""
        self._pos = 0  # how far the text has been read
        self._state = "start"  # start | call | name | arguments | after_call | answer | done
        self._calls: list[dict[str, Any]] = []  # {"id", "name"} of each call begun
        self._depth = 0  # of the arguments value being read
        self._in_string = False
        self._escaped = False
        self._answer_sent = 0  # decoded characters of the text answer already sent

    @property
    def made_calls(self) -> bool:
        return bool(self._calls)

    @property
    def is_answering(self) -> bool:
        """The reply is a text answer (sent as content as it comes)."""
        return self._state == "answer"

    def feed(self, text: str) -> list[dict[str, Any]]:
        """New reply text -> ChatDelta fields to send ({"tool_calls": [...]} or {"content": ...})."""
        self.text += text
        deltas: list[dict[str, Any]] = []
        while self._step(deltas):
            pass
        return deltas

    def _expect(self, literal: str) -> bool | None:
        """True (consumed), None (not enough text yet), False (the text does not follow)."""
        rest = self.text[self._pos :]
        if rest.startswith(literal):
            self._pos += len(literal)
            return True
        return None if literal.startswith(rest) else False

    def _step(self, deltas: list[dict[str, Any]]) -> bool:
        framing, state = self.framing, self._state
        if state == "start":
            if framing.answer_open is not None and self._expect(framing.answer_open):
                self._state = "answer"
                return True
            if self._expect(framing.start):
                self._state = "call"
                return True
            return False
        if state == "call":
            if self._expect(framing.call_open):
                self._state = "name"
                return True
            return False
        if state == "name":
            end = self.text.find(framing.name_end, self._pos)
            if end < 0:
                return False
            name = self.text[self._pos : end]
            call = {"id": f"call_{uuid.uuid4().hex[:24]}", "name": name}
            self._calls.append(call)
            index = len(self._calls) - 1
            opening = {
                "index": index,
                "id": call["id"],
                "type": "function",
                "function": {"name": name, "arguments": ""},
            }
            deltas.append({"tool_calls": [opening]})
            self._pos = end + len(framing.name_end)
            self._state, self._depth, self._in_string, self._escaped = "arguments", 0, False, False
            return True
        if state == "arguments":
            start = self._pos
            done = self._scan_value()
            if self._pos > start:
                fragment = self.text[start : self._pos]
                deltas.append({"tool_calls": [{"index": len(self._calls) - 1, "function": {"arguments": fragment}}]})
            if done:
                self._state = "after_call"
                return True
            return False
        if state == "after_call":
            if self._expect(framing.call_close + framing.separator + framing.call_open):
                self._state = "name"
                return True
            return False
        if state == "answer":
            self._send_answer(deltas)
            return False
        return False

    def _scan_value(self) -> bool:
        """Advance over the arguments value; True once it is complete."""
        while self._pos < len(self.text):
            char = self.text[self._pos]
            self._pos += 1
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return True
        return False

    def _send_answer(self, deltas: list[dict[str, Any]]) -> None:
        raw = self.text[self._pos :]
        decoded = decode_string_prefix(raw)
        if len(decoded) > self._answer_sent:
            deltas.append({"content": decoded[self._answer_sent :]})
            self._answer_sent = len(decoded)


def decode_string_prefix(raw: str) -> str:
    """The decoded characters of a JSON string body so far: up to its closing quote, never past a
    cut escape."""
    out_end = len(raw)
    i = 0
    while i < len(raw):
        if raw[i] == "\\":
            i += 2
            continue
        if raw[i] == '"':
            out_end = i
            break
        i += 1
    body = raw[:out_end]
    for end in range(len(body), max(len(body) - 12, -1), -1):
        try:
            return json.loads(f'"{body[:end]}"')
        except ValueError:
            continue
    return ""


class EventBuilder(Protocol):
    """A named-event stream's builder (the Responses and Messages APIs): text, and calls with their
    arguments in fragments."""

    def text(self, delta: str) -> list[dict]: ...

    def call(self, call_id: str, name: str) -> list[dict]: ...

    def arguments(self, delta: str) -> list[dict]: ...


def builder_events(builder: EventBuilder, fields: dict[str, Any]) -> list[dict]:
    """A chat-shaped delta of the tool reply stream (`ToolReplyStream.feed`) as `builder`'s events."""
    if "content" in fields:
        return builder.text(fields["content"])
    events = []
    for call in fields.get("tool_calls", []):
        function = call["function"]
        if "id" in call:  # a call opens: its id and name, empty arguments
            events += builder.call(call["id"], function["name"])
        events += builder.arguments(function.get("arguments", ""))
    return events
