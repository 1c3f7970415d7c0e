"""What `Client` and `AsyncClient` share: one constructor (base URL, API key, timeout, retry policy, models),
the request headers and bodies, the retry decision after a failed try, and the choice of a default model."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any, Generic, TypeVar

import httpx

from clients.client_errors import KVServeAPIError, KVServeConnectionError, error_from_response
from clients.client_results import ModelInfo
from clients.retry import RetryPolicy

# The public module's name: what a user configures to see the client's retries.
logger = logging.getLogger("clients.client")

DEFAULT_BASE_URL = "http://127.0.0.1:8000"

Message = dict[str, Any]

# httpx.BaseTransport for `Client`, httpx.AsyncBaseTransport for `AsyncClient`.
TransportT = TypeVar("TransportT", httpx.BaseTransport, httpx.AsyncBaseTransport)


def _drop_none(payload: dict) -> dict:
    return {k: v for k, v in payload.items() if v is not None}


def _as_messages(messages: str | Sequence[Message]) -> list[Message]:
    if isinstance(messages, str):
        return [{"role": "user", "content": messages}]
    return [dict(m) for m in messages]


def _streamed(payload: dict, stream: bool) -> dict:
    if stream:
        payload["stream"] = True
        payload.setdefault("stream_options", {"include_usage": True})
    return payload


def pick_model(models: list[ModelInfo], task: str) -> str:
    """The first served model for `task`; servers that do not label tasks get their first model."""
    for m in models:
        if m.task == task:
            return m.id
    unlabeled = [m for m in models if m.task is None]
    if unlabeled:
        return unlabeled[0].id
    raise KVServeAPIError(404, f"the server serves no model for task {task!r}", "not_found_error", "model")


class ClientBase(Generic[TransportT]):
    """The state and request logic of both clients; each subclass opens its own httpx client (`_open_http`)."""

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
        transport: TransportT | None = None,
    ) -> None:
        """base_url and api_key default to $KVSERVE_BASE_URL and $KVSERVE_API_KEY. `timeout` is per request
        (seconds); `max_retries` bounds retries of 429/503 and refused connections. model, embedding_model:
        the models to ask for (None: the first served model of the task)."""
        self.base_url = (base_url or os.environ.get("KVSERVE_BASE_URL") or DEFAULT_BASE_URL).rstrip("/")
        self.api_key = api_key if api_key is not None else os.environ.get("KVSERVE_API_KEY")
        self.timeout = httpx.Timeout(timeout, connect=min(timeout, 10.0))
        self.retry = RetryPolicy(max_retries, backoff_base, backoff_max, max_retry_wait)
        self.model = model
        self.embedding_model = embedding_model
        self._http = self._open_http(transport)

    def _open_http(self, transport: TransportT | None) -> Any:
        """The httpx client (sync or async) the requests go through."""
        raise NotImplementedError

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

    def _known_model(self, task: str) -> str | None:
        """The model given or already chosen for `task` ("generate" or "embed"), if any."""
        return self.model if task == "generate" else self.embedding_model

    def _choose_model(self, models: list[ModelInfo], task: str) -> str:
        """The first served model for `task`, kept for the next requests."""
        chosen = pick_model(models, task)
        if task == "generate":
            self.model = chosen
        else:
            self.embedding_model = chosen
        return chosen

    @staticmethod
    def _completion_payload(model: str, prompt: Any, stream: bool, params: dict) -> dict:
        return _streamed(_drop_none({"model": model, "prompt": prompt, **params}), stream)

    @staticmethod
    def _chat_payload(model: str, messages: str | Sequence[Message], stream: bool, params: dict) -> dict:
        return _streamed(_drop_none({"model": model, "messages": _as_messages(messages), **params}), stream)

    @staticmethod
    def _embedding_payload(model: str, input: str | list[str], params: dict) -> dict:
        return _drop_none({"model": model, "input": input, **params})

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
