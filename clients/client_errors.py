"""The errors the kvserve client raises, and how an error answer becomes one."""

from __future__ import annotations

import json

import httpx


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
