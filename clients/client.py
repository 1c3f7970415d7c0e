"""Python client for a kvserve server (any OpenAI-compatible server works for the /v1 routes).

    from clients.client import Client
    with Client("http://127.0.0.1:8000") as client:
        print(client.chat("Name a colour.", max_tokens=16).text)
        stream = client.stream_chat([{"role": "user", "content": "Count to five."}])
        for delta in stream:              # text deltas as the server generates them
            print(delta, end="", flush=True)
        print(stream.usage)               # filled in once the stream is consumed

`AsyncClient` has the same methods as coroutines: `stream = await aclient.stream_chat(...)`,
then `async for delta in stream`. Streams send their request when iteration starts. HTTP errors are raised as
`KVServeAPIError` with the server's message; 429 and 503 answers (and refused
connections) are retried with exponential backoff, honouring `Retry-After`.
When `model` is not given, the first served model of the right task is used.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing import Self

import httpx

from clients.retry import RETRYABLE_ERRORS, RetryPolicy
from clients.sse import aiter_sse_data, iter_sse_data

logger = logging.getLogger(__name__)

DEFAULT_BASE_URL = "http://127.0.0.1:8000"

Message = dict[str, Any]


class KVServeAPIError(Exception):
    """The server answered with an error; fields follow OpenAI's error shape."""

    def __init__(
        self,
        status_code: int,
        message: str,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def __str__(self) -> str:
        where = f" (param: {self.param})" if self.param else ""
        return f"{self.status_code} {self.type or 'error'}: {self.message}{where}"


class KVServeConnectionError(Exception):
    """The server could not be reached (after the retries)."""


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


# --------------------------------------------------------------------------- pure helpers


def error_from_response(response: httpx.Response) -> KVServeAPIError:
    """Build the exception from an error response: OpenAI's shape, FastAPI's `detail`, or plain text."""
    message, type_, param, code = response.reason_phrase or "error", None, None, None
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        err = body["error"]
        message = str(err.get("message") or message)
        type_, param, code = err.get("type"), err.get("param"), err.get("code")
    elif isinstance(body, dict) and "detail" in body:
        message = body["detail"] if isinstance(body["detail"], str) else json.dumps(body["detail"])
    elif isinstance(body, dict) and isinstance(body.get("error"), str):
        message = body["error"]
    elif response.text:
        message = response.text[:2000]
    return KVServeAPIError(
        response.status_code, message, type_, param, None if code is None else str(code), dict(response.headers)
    )


def _drop_none(payload: dict) -> dict:
    return {k: v for k, v in payload.items() if v is not None}


def _as_messages(messages: str | Sequence[Message]) -> list[Message]:
    if isinstance(messages, str):
        return [{"role": "user", "content": messages}]
    return [dict(m) for m in messages]


def _parse_completion(body: dict, is_chat: bool) -> Completion:
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


def _parse_embeddings(body: dict) -> Embeddings:
    items = sorted(body.get("data") or [], key=lambda d: d.get("index", 0))
    return Embeddings(
        str(body.get("model", "")), [list(d["embedding"]) for d in items], Usage.from_dict(body.get("usage")), body
    )


def _parse_models(body: dict) -> list[ModelInfo]:
    return [ModelInfo(str(m["id"]), m.get("task"), m.get("max_model_len"), m) for m in body.get("data") or []]


def _pick_model(models: list[ModelInfo], task: str) -> str:
    """The first served model for `task`; servers that do not label tasks get their first model."""
    for m in models:
        if m.task == task:
            return m.id
    unlabeled = [m for m in models if m.task is None]
    if unlabeled:
        return unlabeled[0].id
    raise KVServeAPIError(404, f"the server serves no model for task {task!r}", "not_found_error", "model")


class _StreamState:
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


class _StreamBase:
    def __init__(self, is_chat: bool) -> None:
        self._state = _StreamState(is_chat)
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


# --------------------------------------------------------------------------- shared client logic


class _ClientBase:
    _http: httpx.Client | httpx.AsyncClient  # set by the sync or async subclass

    def __init__(
        self,
        base_url: str | None,
        api_key: str | None,
        timeout: float,
        retry: RetryPolicy,
        model: str | None,
        embedding_model: str | None,
    ) -> None:
        self.base_url = (base_url or os.environ.get("KVSERVE_BASE_URL") or DEFAULT_BASE_URL).rstrip("/")
        self.api_key = api_key if api_key is not None else os.environ.get("KVSERVE_API_KEY")
        self.timeout = httpx.Timeout(timeout, connect=min(timeout, 10.0))
        self.retry = retry
        self.model = model
        self.embedding_model = embedding_model

    def _headers(self) -> dict[str, str]:
        headers = {"User-Agent": "kvserve-client"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def _request(self, method: str, path: str, payload: Any) -> httpx.Request:
        return self._http.build_request(method, path, json=payload, headers=self._headers())

    def _retry_delay_or_raise(
        self, attempt: int, method: str, path: str, response: httpx.Response | None, error: Exception | None
    ) -> float:
        """Seconds to wait before try `attempt + 1` of a failed request; raises the failure when it is final.

        `response` is the error answer (its body read), or None when `error` kept the request from the server.
        """
        delay = self.retry.delay(attempt, response)
        if delay is None:
            if response is None:
                raise KVServeConnectionError(f"cannot reach {self.base_url}: {error}") from error
            raise error_from_response(response)
        if response is not None:
            logger.info("%s %s: %d, retrying in %.2fs", method, path, response.status_code, delay)
        return delay

    @staticmethod
    def _completion_payload(model: str, prompt: Any, stream: bool, params: dict) -> dict:
        payload = _drop_none({"model": model, "prompt": prompt, **params})
        if stream:
            payload["stream"] = True
            payload.setdefault("stream_options", {"include_usage": True})
        return payload

    @staticmethod
    def _chat_payload(model: str, messages: str | Sequence[Message], stream: bool, params: dict) -> dict:
        payload = _drop_none({"model": model, "messages": _as_messages(messages), **params})
        if stream:
            payload["stream"] = True
            payload.setdefault("stream_options", {"include_usage": True})
        return payload

    @staticmethod
    def _tokenize_payload(model: str, prompt: str | None, messages: Sequence[Message] | None, params: dict) -> dict:
        if (prompt is None) == (messages is None):
            raise ValueError("tokenize takes exactly one of prompt or messages")
        payload: dict = {"model": model, **_drop_none(params)}
        if prompt is not None:
            payload["prompt"] = prompt
        else:
            payload["messages"] = _as_messages(messages)  # type: ignore[arg-type]
        return payload


# --------------------------------------------------------------------------- sync


class TextStream(_StreamBase):
    """Iterator of text deltas from a streamed completion; `usage` etc. are set as chunks arrive."""

    def __init__(self, client: Client, path: str, payload: dict, is_chat: bool) -> None:
        super().__init__(is_chat)
        self._client = client
        self._path = path
        self._payload = payload
        self._response: httpx.Response | None = None
        self._started = False

    def __iter__(self) -> Iterator[str]:
        if self._started:
            raise RuntimeError("a stream can be iterated once")
        self._started = True
        self._response = self._client._send("POST", self._path, json=self._payload, stream=True)
        try:
            for payload in iter_sse_data(self._response.iter_lines()):
                delta = self._state.feed(payload)
                if delta:
                    yield delta
            self.is_done = True
        finally:
            self.close()

    def close(self) -> None:
        if self._response is not None:
            self._response.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Client(_ClientBase):
    """Synchronous client. `timeout` is per request (seconds); `max_retries` bounds retries of 429/503."""

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        timeout: float = 600.0,
        max_retries: int = 4,
        backoff_base: float = 0.5,
        backoff_max: float = 8.0,
        max_retry_wait: float = 60.0,
        model: str | None = None,
        embedding_model: str | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        super().__init__(
            base_url,
            api_key,
            timeout,
            RetryPolicy(max_retries, backoff_base, backoff_max, max_retry_wait),
            model,
            embedding_model,
        )
        self._http = httpx.Client(base_url=self.base_url, timeout=self.timeout, transport=transport)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, method: str, path: str, *, json: Any = None, stream: bool = False) -> httpx.Response:
        """One request with retries; returns a successful response (open, when `stream`)."""
        attempt = 0
        while True:
            response, error = None, None
            try:
                response = self._http.send(self._request(method, path, json), stream=stream)
            except RETRYABLE_ERRORS as exc:
                error = exc
            if response is not None:
                if response.status_code < 400:
                    return response
                response.read()  # the error message is in the body, not yet read when streaming
                response.close()
            time.sleep(self._retry_delay_or_raise(attempt, method, path, response, error))
            attempt += 1

    def _json(self, method: str, path: str, payload: Any = None) -> Any:
        response = self._send(method, path, json=payload)
        return response.json()

    def _default_model(self, task: str) -> str:
        if task == "generate" and self.model:
            return self.model
        if task == "embed" and self.embedding_model:
            return self.embedding_model
        chosen = _pick_model(self.models(), task)
        if task == "generate":
            self.model = chosen
        else:
            self.embedding_model = chosen
        return chosen

    def complete(self, prompt: str | list[str] | list[int], *, model: str | None = None, **params: Any) -> Completion:
        """POST /v1/completions. `params` are OpenAI/vLLM sampling fields (max_tokens, temperature, stop...)."""
        payload = self._completion_payload(model or self._default_model("generate"), prompt, False, params)
        return _parse_completion(self._json("POST", "/v1/completions", payload), is_chat=False)

    def chat(self, messages: str | Sequence[Message], *, model: str | None = None, **params: Any) -> Completion:
        """POST /v1/chat/completions; a plain string is sent as one user message."""
        payload = self._chat_payload(model or self._default_model("generate"), messages, False, params)
        return _parse_completion(self._json("POST", "/v1/chat/completions", payload), is_chat=True)

    def stream(self, prompt: str | list[str] | list[int], *, model: str | None = None, **params: Any) -> TextStream:
        payload = self._completion_payload(model or self._default_model("generate"), prompt, True, params)
        return TextStream(self, "/v1/completions", payload, is_chat=False)

    def stream_chat(self, messages: str | Sequence[Message], *, model: str | None = None, **params: Any) -> TextStream:
        payload = self._chat_payload(model or self._default_model("generate"), messages, True, params)
        return TextStream(self, "/v1/chat/completions", payload, is_chat=True)

    def embed(self, input: str | list[str], *, model: str | None = None, **params: Any) -> Embeddings:
        payload = _drop_none({"model": model or self._default_model("embed"), "input": input, **params})
        return _parse_embeddings(self._json("POST", "/v1/embeddings", payload))

    def tokenize(
        self, prompt: str | None = None, *, messages: Sequence[Message] | None = None, model: str | None = None,
        **params: Any,
    ) -> TokenizeResult:  # fmt: skip
        payload = self._tokenize_payload(model or self._default_model("generate"), prompt, messages, params)
        body = self._json("POST", "/tokenize", payload)
        return TokenizeResult(
            list(body["tokens"]), int(body.get("count", len(body["tokens"]))), body.get("max_model_len")
        )

    def models(self) -> list[ModelInfo]:
        return _parse_models(self._json("GET", "/v1/models"))

    def health(self) -> bool:
        """True when GET /health answers 200 (no retries: a health check should say what is now)."""
        try:
            return self._http.get("/health", headers=self._headers()).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_until_ready(self, timeout: float = 120.0, interval: float = 0.25) -> None:
        deadline = time.monotonic() + timeout
        while not self.health():
            if time.monotonic() > deadline:
                raise KVServeConnectionError(f"{self.base_url} not healthy after {timeout:.0f}s")
            time.sleep(interval)


# --------------------------------------------------------------------------- async


class AsyncTextStream(_StreamBase):
    """Async iterator of text deltas; the request is sent when iteration starts."""

    def __init__(self, client: AsyncClient, path: str, payload: dict, is_chat: bool) -> None:
        super().__init__(is_chat)
        self._client = client
        self._path = path
        self._payload = payload
        self._response: httpx.Response | None = None
        self._started = False

    def __aiter__(self) -> AsyncIterator[str]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[str]:
        if self._started:
            raise RuntimeError("a stream can be iterated once")
        self._started = True
        self._response = await self._client._send("POST", self._path, json=self._payload, stream=True)
        try:
            async for payload in aiter_sse_data(self._response.aiter_lines()):
                delta = self._state.feed(payload)
                if delta:
                    yield delta
            self.is_done = True
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        if self._response is not None:
            await self._response.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class AsyncClient(_ClientBase):
    """Asynchronous client; same methods as `Client`, as coroutines (streams are async iterators)."""

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        timeout: float = 600.0,
        max_retries: int = 4,
        backoff_base: float = 0.5,
        backoff_max: float = 8.0,
        max_retry_wait: float = 60.0,
        model: str | None = None,
        embedding_model: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        super().__init__(
            base_url,
            api_key,
            timeout,
            RetryPolicy(max_retries, backoff_base, backoff_max, max_retry_wait),
            model,
            embedding_model,
        )
        self._http = httpx.AsyncClient(base_url=self.base_url, timeout=self.timeout, transport=transport)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _send(self, method: str, path: str, *, json: Any = None, stream: bool = False) -> httpx.Response:
        """`Client._send` over the async transport."""
        attempt = 0
        while True:
            response, error = None, None
            try:
                response = await self._http.send(self._request(method, path, json), stream=stream)
            except RETRYABLE_ERRORS as exc:
                error = exc
            if response is not None:
                if response.status_code < 400:
                    return response
                await response.aread()
                await response.aclose()
            await asyncio.sleep(self._retry_delay_or_raise(attempt, method, path, response, error))
            attempt += 1

    async def _json(self, method: str, path: str, payload: Any = None) -> Any:
        response = await self._send(method, path, json=payload)
        return response.json()

    async def _default_model(self, task: str) -> str:
        if task == "generate" and self.model:
            return self.model
        if task == "embed" and self.embedding_model:
            return self.embedding_model
        chosen = _pick_model(await self.models(), task)
        if task == "generate":
            self.model = chosen
        else:
            self.embedding_model = chosen
        return chosen

    async def complete(
        self, prompt: str | list[str] | list[int], *, model: str | None = None, **params: Any
    ) -> Completion:
        payload = self._completion_payload(model or await self._default_model("generate"), prompt, False, params)
        return _parse_completion(await self._json("POST", "/v1/completions", payload), is_chat=False)

    async def chat(self, messages: str | Sequence[Message], *, model: str | None = None, **params: Any) -> Completion:
        payload = self._chat_payload(model or await self._default_model("generate"), messages, False, params)
        return _parse_completion(await self._json("POST", "/v1/chat/completions", payload), is_chat=True)

    async def stream(
        self, prompt: str | list[str] | list[int], *, model: str | None = None, **params: Any
    ) -> AsyncTextStream:
        payload = self._completion_payload(model or await self._default_model("generate"), prompt, True, params)
        return AsyncTextStream(self, "/v1/completions", payload, is_chat=False)

    async def stream_chat(
        self, messages: str | Sequence[Message], *, model: str | None = None, **params: Any
    ) -> AsyncTextStream:
        payload = self._chat_payload(model or await self._default_model("generate"), messages, True, params)
        return AsyncTextStream(self, "/v1/chat/completions", payload, is_chat=True)

    async def embed(self, input: str | list[str], *, model: str | None = None, **params: Any) -> Embeddings:
        payload = _drop_none({"model": model or await self._default_model("embed"), "input": input, **params})
        return _parse_embeddings(await self._json("POST", "/v1/embeddings", payload))

    async def tokenize(
        self, prompt: str | None = None, *, messages: Sequence[Message] | None = None, model: str | None = None,
        **params: Any,
    ) -> TokenizeResult:  # fmt: skip
        payload = self._tokenize_payload(model or await self._default_model("generate"), prompt, messages, params)
        body = await self._json("POST", "/tokenize", payload)
        return TokenizeResult(
            list(body["tokens"]), int(body.get("count", len(body["tokens"]))), body.get("max_model_len")
        )

    async def models(self) -> list[ModelInfo]:
        return _parse_models(await self._json("GET", "/v1/models"))

    async def health(self) -> bool:
        try:
            return (await self._http.get("/health", headers=self._headers())).status_code == 200
        except httpx.HTTPError:
            return False

    async def wait_until_ready(self, timeout: float = 120.0, interval: float = 0.25) -> None:
        deadline = time.monotonic() + timeout
        while not await self.health():
            if time.monotonic() > deadline:
                raise KVServeConnectionError(f"{self.base_url} not healthy after {timeout:.0f}s")
            await asyncio.sleep(interval)
