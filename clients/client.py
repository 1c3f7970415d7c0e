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

This module holds the two clients and their streams, and every public name: what they share is in
client_base.py (construction, request bodies, retries), client_results.py (result types and parsing) and
client_errors.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing import Self

import httpx

from clients.client_base import DEFAULT_BASE_URL, ClientBase, Message
from clients.client_errors import KVServeAPIError, KVServeConnectionError, error_from_response
from clients.client_results import (
    Choice,
    Completion,
    Embeddings,
    ModelInfo,
    StreamBase,
    TokenizeResult,
    ToolCall,
    Usage,
    parse_completion,
    parse_embeddings,
    parse_models,
    parse_tokenize,
)
from clients.retry import RETRYABLE_ERRORS
from clients.sse import aiter_sse_data, iter_sse_data

__all__ = [
    "DEFAULT_BASE_URL",
    "AsyncClient",
    "AsyncTextStream",
    "Choice",
    "Client",
    "Completion",
    "Embeddings",
    "KVServeAPIError",
    "KVServeConnectionError",
    "Message",
    "ModelInfo",
    "TextStream",
    "TokenizeResult",
    "ToolCall",
    "Usage",
    "error_from_response",
]


# --------------------------------------------------------------------------- sync


class TextStream(StreamBase):
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


class Client(ClientBase[httpx.BaseTransport]):
    """Synchronous client. `timeout` is per request (seconds); `max_retries` bounds retries of 429/503."""

    _http: httpx.Client

    def _open_http(self, transport: httpx.BaseTransport | None) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=self.timeout, transport=transport)

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
        return self._known_model(task) or self._choose_model(self.models(), task)

    def complete(self, prompt: str | list[str] | list[int], *, model: str | None = None, **params: Any) -> Completion:
        """POST /v1/completions. `params` are OpenAI/vLLM sampling fields (max_tokens, temperature, stop...)."""
        payload = self._completion_payload(model or self._default_model("generate"), prompt, False, params)
        return parse_completion(self._json("POST", "/v1/completions", payload), is_chat=False)

    def chat(self, messages: str | Sequence[Message], *, model: str | None = None, **params: Any) -> Completion:
        """POST /v1/chat/completions; a plain string is sent as one user message."""
        payload = self._chat_payload(model or self._default_model("generate"), messages, False, params)
        return parse_completion(self._json("POST", "/v1/chat/completions", payload), is_chat=True)

    def stream(self, prompt: str | list[str] | list[int], *, model: str | None = None, **params: Any) -> TextStream:
        payload = self._completion_payload(model or self._default_model("generate"), prompt, True, params)
        return TextStream(self, "/v1/completions", payload, is_chat=False)

    def stream_chat(self, messages: str | Sequence[Message], *, model: str | None = None, **params: Any) -> TextStream:
        payload = self._chat_payload(model or self._default_model("generate"), messages, True, params)
        return TextStream(self, "/v1/chat/completions", payload, is_chat=True)

    def embed(self, input: str | list[str], *, model: str | None = None, **params: Any) -> Embeddings:
        payload = self._embedding_payload(model or self._default_model("embed"), input, params)
        return parse_embeddings(self._json("POST", "/v1/embeddings", payload))

    def tokenize(
        self, prompt: str | None = None, *, messages: Sequence[Message] | None = None, model: str | None = None,
        **params: Any,
    ) -> TokenizeResult:  # fmt: skip
        payload = self._tokenize_payload(model or self._default_model("generate"), prompt, messages, params)
        return parse_tokenize(self._json("POST", "/tokenize", payload))

    def models(self) -> list[ModelInfo]:
        return parse_models(self._json("GET", "/v1/models"))

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


class AsyncTextStream(StreamBase):
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


class AsyncClient(ClientBase[httpx.AsyncBaseTransport]):
    """Asynchronous client; same methods as `Client`, as coroutines (streams are async iterators)."""

    _http: httpx.AsyncClient

    def _open_http(self, transport: httpx.AsyncBaseTransport | None) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.base_url, timeout=self.timeout, transport=transport)

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
        return self._known_model(task) or self._choose_model(await self.models(), task)

    async def complete(
        self, prompt: str | list[str] | list[int], *, model: str | None = None, **params: Any
    ) -> Completion:
        payload = self._completion_payload(model or await self._default_model("generate"), prompt, False, params)
        return parse_completion(await self._json("POST", "/v1/completions", payload), is_chat=False)

    async def chat(self, messages: str | Sequence[Message], *, model: str | None = None, **params: Any) -> Completion:
        payload = self._chat_payload(model or await self._default_model("generate"), messages, False, params)
        return parse_completion(await self._json("POST", "/v1/chat/completions", payload), is_chat=True)

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
        payload = self._embedding_payload(model or await self._default_model("embed"), input, params)
        return parse_embeddings(await self._json("POST", "/v1/embeddings", payload))

    async def tokenize(
        self, prompt: str | None = None, *, messages: Sequence[Message] | None = None, model: str | None = None,
        **params: Any,
    ) -> TokenizeResult:  # fmt: skip
        payload = self._tokenize_payload(model or await self._default_model("generate"), prompt, messages, params)
        return parse_tokenize(await self._json("POST", "/tokenize", payload))

    async def models(self) -> list[ModelInfo]:
        return parse_models(await self._json("GET", "/v1/models"))

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
