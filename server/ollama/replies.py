"""OllamaReply: the lines of one /api/chat or /api/generate answer, streamed or whole.

A streamed answer is one JSON object a line: each piece of the reply (`message.content` and
`message.thinking` for chat, `response` and `thinking` for generate) with `done: false`, a chat reply's
tool calls whole in a line of their own, then a last line with `done: true`, the `done_reason` ("stop" or
"length"), the token counts and the timings in nanoseconds (generate's with `context`: the prompt's and
the answer's tokens, to send back with the next prompt). A whole answer is that last line holding the whole
reply. `prompt_eval_duration` is the time to the first token, `eval_duration` the time from it to the end;
`load_duration` is how long the request waited for its model to load (0 when it was loaded), and
`total_duration` includes it, as Ollama's do.
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from typing import Any

from engine.outputs import FINISH_LENGTH
from server.catalogue.leases import load_wait_ns
from server.errors import APIError
from server.protocol.chat import ChatLogprobs, ResponseToolCall
from server.protocol.ollama import AnswerMessage, AnswerToolCall, ChatLine, GenerateLine, ToolCallFunction


def created_at() -> str:
    """Now, as Ollama writes it (RFC 3339, UTC)."""
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def loaded_line(model: str, kind: str, done_reason: str = "load") -> dict[str, Any]:
    """The answer to a request with nothing to generate: Ollama's way to ask for the model to be loaded
    (done_reason "load") or, with keep_alive 0, unloaded ("unload")."""
    if kind == "chat":
        line = ChatLine(model=model, created_at=created_at(), done=True, done_reason=done_reason, message=_message(""))
    else:
        line = GenerateLine(model=model, created_at=created_at(), done=True, done_reason=done_reason, response="")
    return line.model_dump()


def ollama_logprobs(logprobs: ChatLogprobs | None) -> list[dict[str, Any]] | None:
    """Chat's logprob entries in Ollama's shape (the same keys: token, logprob, bytes, top_logprobs)."""
    if logprobs is None:
        return None
    return [entry.model_dump() for entry in logprobs.content or []]


class OllamaReply:
    def __init__(self, model: str, kind: str, prompt_ids: list[int]) -> None:
        self.model = model
        self.kind = kind  # "chat" or "generate"
        self.prompt_ids = prompt_ids
        self.output_ids: list[int] = []
        self._start = time.monotonic_ns()
        self._first: int | None = None

    def piece(self, thinking: str, text: str, token_ids: list[int], logprobs: ChatLogprobs | None) -> dict | None:
        """A streamed line of the reply (None: nothing to send)."""
        self._arrived(token_ids)
        if not (thinking or text or logprobs):
            return None
        return self._line(False, text, thinking or None, None, ollama_logprobs(logprobs))

    def text(self, text: str) -> dict:
        """A streamed line of answer text read whole (a free tool reply that held no calls)."""
        return self._line(False, text, None, None, None)

    def calls(self, calls: list[ResponseToolCall]) -> dict:
        """A chat reply's calls, whole, in a line of their own."""
        return self._line(False, "", None, calls, None)

    def last(
        self,
        finish_reason: str | None,
        eval_count: int,
        text: str = "",
        thinking: str | None = None,
        calls: list[ResponseToolCall] | None = None,
        logprobs: ChatLogprobs | None = None,
        token_ids: list[int] | None = None,
        first_token_time: float | None = None,
    ) -> dict:
        """The last line: the reason, counts and timings (and, for a whole answer, the whole reply, with
        its first token's time.monotonic())."""
        if token_ids is not None:
            self._arrived(token_ids)
        if first_token_time is not None:
            self._first = int(first_token_time * 1e9)
        end = time.monotonic_ns()
        first = self._first if self._first is not None else end
        load = load_wait_ns()
        timings = {
            "done_reason": "length" if finish_reason == FINISH_LENGTH else "stop",
            "total_duration": end - self._start + load,
            "load_duration": load,
            "prompt_eval_count": len(self.prompt_ids),
            "prompt_eval_duration": first - self._start,
            "eval_count": eval_count,
            "eval_duration": end - first,
        }
        return self._line(True, text, thinking, calls, ollama_logprobs(logprobs), timings)

    def failed(self, error: APIError) -> list[dict]:
        return [{"error": error.message}]

    def _arrived(self, token_ids: list[int]) -> None:
        if token_ids and self._first is None:
            self._first = time.monotonic_ns()
        self.output_ids.extend(token_ids)

    def _line(
        self,
        done: bool,
        text: str,
        thinking: str | None,
        calls: list[ResponseToolCall] | None,
        logprobs: list[dict] | None,
        timings: dict[str, Any] | None = None,
    ) -> dict:
        common = {
            "model": self.model,
            "created_at": created_at(),
            "done": done,
            "logprobs": logprobs,
            **(timings or {}),
        }
        if self.kind == "chat":
            return ChatLine(message=_message(text, thinking, calls), **common).model_dump()
        context = [*self.prompt_ids, *self.output_ids] if done else None
        return GenerateLine(response=text, thinking=thinking, context=context, **common).model_dump()


def _message(text: str, thinking: str | None = None, calls: list[ResponseToolCall] | None = None) -> AnswerMessage:
    tool_calls = None
    if calls:
        tool_calls = [
            AnswerToolCall(
                id=call.id,
                function=ToolCallFunction(name=call.function.name, arguments=_arguments(call), index=index),
            )
            for index, call in enumerate(calls)
        ]
    return AnswerMessage(content=text, thinking=thinking, tool_calls=tool_calls)


def _arguments(call: ResponseToolCall) -> dict[str, Any]:
    value = json.loads(call.function.arguments)  # a constrained call's arguments always parse
    return value if isinstance(value, dict) else {}
