"""One pure-ASGI middleware for what every request goes through, in order:

request id (X-Request-Id, echoed or made) -> API key (401; the request's Caller, server/http/access.py,
goes into its scope state) -> readiness (503 while loading,
503 `shutting_down` once the server drains: server/shutdown.py) -> body size (413) -> the app
(counted in flight while it runs, so the stop knows when nothing is left; the models it picks held until
its answer ends: server/catalogue/leases.py) -> one access-log line.

Pure ASGI (not BaseHTTPMiddleware) so streamed responses pass through untouched
and client disconnects still reach the routes.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from starlette.exceptions import HTTPException
from starlette.requests import cookie_parser
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.catalogue.leases import lease_scope
from server.errors import APIError
from server.http.access import OPEN_CALLER, ApiKeys, Caller
from server.playground.auth import PAGE_COOKIE, is_page_request, is_valid_page_token
from server.shutdown import Shutdown, shutting_down_error

access_logger = logging.getLogger("kvserve.access")

REQUEST_ID_HEADER = b"x-request-id"
OPEN_PATHS = frozenset({"/health", "/metrics"})  # answered while loading and draining, not counted in flight
# The one route without the API key: /metrics tells whether a prefix is cached, so it needs the key too.
KEYLESS_PATHS = frozenset({"/health"})
# A browser that opened the page with its cookie: the page's files, nothing else (server/playground/auth.py).
PAGE_CALLER = Caller(is_admin=False)
SIGN_IN_PAGE = (Path(__file__).resolve().parents[1] / "playground" / "login.html").read_bytes()


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


def _clean_request_id(value: str | None) -> str:
    if value and len(value) <= 128 and value.isprintable():
        return value
    return uuid.uuid4().hex


class AdmissionMiddleware:
    """is_ready(): models loaded; shutdown: the server's stop; api_keys: the bearer tokens it accepts
    (None or none: open); playground: the playground page is served (its sign-in page and cookie,
    server/playground/auth.py)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        is_ready: Callable[[], bool],
        shutdown: Shutdown,
        api_keys: ApiKeys | None = None,
        max_request_bytes: int,
        playground: bool = False,
    ) -> None:
        self.app = app
        self.is_ready = is_ready
        self.shutdown = shutdown
        self.api_keys = api_keys if api_keys is not None and not api_keys.is_open else None
        self.playground = playground
        self.max_request_bytes = max_request_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.monotonic()
        request_id = _clean_request_id(_header(scope, REQUEST_ID_HEADER))
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        state["shutdown"] = self.shutdown  # server/serving.py names the error of a request the stop cuts
        status = {"code": 0}

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != REQUEST_ID_HEADER]
                headers.append((REQUEST_ID_HEADER, request_id.encode()))
                message = {**message, "headers": headers}
            await send(message)

        try:
            error = self._refuse(scope, state)
            if error is not None:
                if error.status_code == 401 and self.playground and is_page_request(scope):
                    await _send_sign_in_page(send_with_id)
                else:
                    await _send_error(error, scope["path"], send_with_id)
                return
            counted = scope["path"] not in OPEN_PATHS
            if counted:
                self.shutdown.request_started()
            try:
                with lease_scope():  # the models it uses stay loaded until its answer ends
                    await self.app(scope, self._limit_body(receive), send_with_id)
            finally:
                if counted:
                    self.shutdown.request_finished()
        except Exception:
            # One request's bug fails that request only; the server keeps serving.
            logging.getLogger(__name__).exception("unhandled error in %s %s", scope["method"], scope["path"])
            if status["code"] == 0:
                error = APIError(500, "internal server error", type="internal_error")
                await _send_error(error, scope["path"], send_with_id)
        finally:
            usage = state.get("usage") or {}
            access_logger.info(
                '%s "%s %s" %d %.1fms prompt_tokens=%s completion_tokens=%s request_id=%s',
                (scope.get("client") or ("-",))[0],
                scope["method"],
                scope["path"],
                status["code"],
                (time.monotonic() - start) * 1000,
                usage.get("prompt_tokens", "-"),
                usage.get("completion_tokens", "-"),
                request_id,
            )

    def _refuse(self, scope: Scope, state: dict) -> APIError | None:
        path = scope["path"]
        if scope["method"] == "OPTIONS":
            return None
        caller = self._caller(scope)
        if caller is not None:
            state["caller"] = caller
        elif path not in KEYLESS_PATHS:
            return APIError(
                401,
                "invalid or missing API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')",
                type="authentication_error",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        if path in OPEN_PATHS:
            return None
        if self.shutdown.is_draining:
            return shutting_down_error()
        if not self.is_ready():
            return APIError(
                503,
                "the server is loading its models; retry shortly",
                type="service_unavailable",
                code="model_loading",
                headers={"Retry-After": "1"},
            )
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_request_bytes:
            return _too_large(self.max_request_bytes)
        return None

    def _caller(self, scope: Scope) -> Caller | None:
        """Who sent the request; None: no key matches (a playground cookie opens the page as a non-admin)."""
        if self.api_keys is None:
            return OPEN_CALLER
        auth = _header(scope, b"authorization") or ""
        scheme, _, token = auth.partition(" ")
        if scheme.lower() == "bearer":
            return self.api_keys.caller_for(token.strip())
        api_key = _header(scope, b"x-api-key")  # Anthropic's clients send the key here
        if api_key is not None:
            return self.api_keys.caller_for(api_key.strip())
        if self.playground and is_page_request(scope):
            cookie = cookie_parser(_header(scope, b"cookie") or "").get(PAGE_COOKIE, "")
            if is_valid_page_token(cookie, self.api_keys.page_secrets):
                return PAGE_CALLER
        return None

    def _limit_body(self, receive: Receive) -> Receive:
        """Count body bytes as they arrive (chunked bodies have no Content-Length)."""
        limit = self.max_request_bytes
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    # Raised inside the route's body read: FastAPI re-raises HTTPException as is.
                    raise HTTPException(413, _too_large(limit).message)
            return message

        return limited_receive


async def _send_sign_in_page(send: Send) -> None:
    headers = [
        (b"content-type", b"text/html; charset=utf-8"),
        (b"content-length", str(len(SIGN_IN_PAGE)).encode()),
        (b"www-authenticate", b"Bearer"),
        (b"cache-control", b"no-store"),
    ]
    await send({"type": "http.response.start", "status": 401, "headers": headers})
    await send({"type": "http.response.body", "body": SIGN_IN_PAGE})


def _too_large(limit: int) -> APIError:
    return APIError(413, f"request body is larger than the limit of {limit} bytes", code="request_too_large")


async def _send_error(error: APIError, path: str, send: Send) -> None:
    body = json.dumps(error.body_for(path)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status_code, "headers": headers})
    await send({"type": "http.response.body", "body": body})
