"""What the server answers, as Python values: the result types, their parsing from JSON bodies, and the state
of a streamed completion as its chunks arrive."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from clients.client_errors import KVServeAPIError

# --------------------------------------------------------------------------- result types


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def from_dict(cls, data: dict | None) -> Usage | None:
        if not data:
            return None
        prompt = int(data.get("prompt_tokens") or 0)
        completion = int(data.get("completion_tokens") or 0)
        return cls(prompt, completion, int(data.get("total_tokens") or prompt + completion))


@dataclass(frozen=True)
class ToolCall:
    """A call the model made (chat with `tools`): `arguments` is JSON text, as OpenAI sends it."""

    id: str
    name: str
    arguments: str

    def parsed_arguments(self) -> Any:
        return json.loads(self.arguments)


@dataclass(frozen=True)
class Choice:
    index: int
    text: str
    finish_reason: str | None
    logprobs: Any = None
    tool_calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True)
class Completion:
    """A /v1/completions or /v1/chat/completions answer; `text` is the first choice's text."""

    id: str
    model: str
    choices: list[Choice]
    usage: Usage | None
    raw: dict = field(repr=False)

    @property
    def text(self) -> str:
        return self.choices[0].text if self.choices else ""

    @property
    def finish_reason(self) -> str | None:
        return self.choices[0].finish_reason if self.choices else None

    @property
    def tool_calls(self) -> tuple[ToolCall, ...]:
        """The first choice's tool calls (chat with `tools`; empty otherwise)."""
        return self.choices[0].tool_calls if self.choices else ()


@dataclass(frozen=True)
class Embeddings:
    model: str
    vectors: list[list[float]]  # one per input, in input order
    usage: Usage | None
    raw: dict = field(repr=False)


@dataclass(frozen=True)
class TokenizeResult:
    tokens: list[int]
    count: int
    max_model_len: int | None


@dataclass(frozen=True)
class ModelInfo:
    id: str
    task: str | None  # "generate" or "embed" on kvserve; None from servers that do not say
    max_model_len: int | None
    raw: dict = field(repr=False)


# --------------------------------------------------------------------------- parsing


def parse_completion(body: dict, is_chat: bool) -> Completion:
    choices = []
    for i, c in enumerate(body.get("choices") or []):
        message = c.get("message") or {}
        text = (message.get("content") or "") if is_chat else (c.get("text") or "")
        calls = tuple(
            ToolCall(str(call.get("id", "")), call["function"]["name"], call["function"].get("arguments", "{}"))
            for call in message.get("tool_calls") or []
        )
        choices.append(Choice(int(c.get("index", i)), text, c.get("finish_reason"), c.get("logprobs"), calls))
    choices.sort(key=lambda c: c.index)
    return Completion(
        str(body.get("id", "")), str(body.get("model", "")), choices, Usage.from_dict(body.get("usage")), body
    )


def parse_embeddings(body: dict) -> Embeddings:
    items = sorted(body.get("data") or [], key=lambda d: d.get("index", 0))
    return Embeddings(
        str(body.get("model", "")), [list(d["embedding"]) for d in items], Usage.from_dict(body.get("usage")), body
    )


def parse_models(body: dict) -> list[ModelInfo]:
    return [ModelInfo(str(m["id"]), m.get("task"), m.get("max_model_len"), m) for m in body.get("data") or []]


def parse_tokenize(body: dict) -> TokenizeResult:
    return TokenizeResult(list(body["tokens"]), int(body.get("count", len(body["tokens"]))), body.get("max_model_len"))


# --------------------------------------------------------------------------- streams


class StreamState:
    """Accumulates a completions/chat SSE stream: per-choice text, finish reasons, usage."""

    def __init__(self, is_chat: bool) -> None:
        self.is_chat = is_chat
        self.id: str | None = None
        self.model: str | None = None
        self.usage: Usage | None = None
        self.texts: dict[int, str] = {}
        self.finish_reasons: dict[int, str | None] = {}
        self.num_chunks = 0

    def feed(self, payload: str) -> str | None:
        """Take one event's JSON; return the first choice's text delta, if it has one."""
        chunk = json.loads(payload)
        if isinstance(chunk, dict) and isinstance(chunk.get("error"), dict):
            err = chunk["error"]  # an error reported mid-stream (the status line was already 200)
            code = err.get("code")
            status = int(code) if isinstance(code, int) or (isinstance(code, str) and code.isdigit()) else 500
            raise KVServeAPIError(
                status,
                str(err.get("message", "stream error")),
                err.get("type"),
                err.get("param"),
                None if code is None else str(code),
            )
        self.num_chunks += 1
        self.id = self.id or chunk.get("id")
        self.model = self.model or chunk.get("model")
        if chunk.get("usage"):
            self.usage = Usage.from_dict(chunk["usage"])
        first_delta = None
        for c in chunk.get("choices") or []:
            index = int(c.get("index", 0))
            piece = ((c.get("delta") or {}).get("content") if self.is_chat else c.get("text")) or ""
            self.texts[index] = self.texts.get(index, "") + piece
            if c.get("finish_reason") is not None:
                self.finish_reasons[index] = c["finish_reason"]
            if index == 0 and piece:
                first_delta = piece
        return first_delta


class StreamBase:
    """What the sync and async text streams share: the stream's values as read so far."""

    def __init__(self, is_chat: bool) -> None:
        self._state = StreamState(is_chat)
        self.is_done = False

    @property
    def text(self) -> str:
        """The first choice's text received so far."""
        return self._state.texts.get(0, "")

    @property
    def texts(self) -> dict[int, str]:
        return dict(self._state.texts)

    @property
    def usage(self) -> Usage | None:
        """Token counts; known once the stream has been consumed (the client asks for include_usage)."""
        return self._state.usage

    @property
    def finish_reason(self) -> str | None:
        return self._state.finish_reasons.get(0)

    @property
    def id(self) -> str | None:
        return self._state.id

    @property
    def model(self) -> str | None:
        return self._state.model
