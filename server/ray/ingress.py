"""KVServeIngress: the application's HTTP entry on Ray Serve, in front of the KVServe replicas.

Serve's HTTP proxy hands each request to this deployment. It reads the body (the prompt is in it:
server/ray/router.py says why the router cannot see it otherwise), hashes the prompt's prefix, and calls
KVServe through a DeploymentHandle with the hashes as an argument KVServe's request router reads. The
replica's ASGI messages are sent on as they come, so a stream stays a stream.

What the client gets when Serve, not kvserve, has the answer, in kvserve's own error shape:
- every replica is full (max_ongoing_requests each) and Serve's queue for them too (max_queued_requests):
  429 `queue_full` with Retry-After, as a single kvserve answers when its queue is full;
- the replica died or was stopped under the request (its process ended): 503 `shutting_down` with
  Retry-After, or, once a stream has begun, an SSE error event with that body, then `data: [DONE]` (the
  Responses API: an `error` event), as kvserve's own stop ends a stream. Other requests are untouched,
  and Serve starts a new replica.

`drain` is kvserve's stop (server/shutdown.py) for the whole application, used by `kvserve serve
--replicas` (server/ray/local.py) before it deletes the application: new requests get 503
`shutting_down` and /health 503 {"status": "draining"}, the requests in flight get the grace, and the rest
are cut, ending as above.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from typing import Any

from fastapi.responses import JSONResponse, Response
from ray import serve
from ray.exceptions import RayError, RayTaskError
from ray.serve.exceptions import BackPressureError, RayServeException
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.types import Message, Receive, Scope, Send

from engine.errors import QueueFullError
from server.config import ServerConfig
from server.errors import APIError, api_error_for
from server.http.middleware import OPEN_PATHS
from server.ray.model_routes import SHARED_DEPLOYMENT, ModelRoutes, joined_listing
from server.ray.replica import SCOPE_KEYS
from server.ray.router import PREFIX_HASHES_KWARG, prefix_hashes
from server.shutdown import shutting_down_error

logger = logging.getLogger(__name__)

REQUEST_ID_HEADER = b"x-request-id"
DRAIN_POLL_S = 0.05
# Once cut, seconds a request gets to send its ending (the SSE error event) before drain returns anyway.
CUT_ENDING_S = 1.0


class Forwarder:
    """The ingress's ASGI app: each HTTP request to a KVServe replica and its answer back.

    kvserve: the KVServe deployment's handle by deployment name: one, or one per model with `routes`
    (server/ray/model_routes.py) saying which a request goes to."""

    def __init__(
        self,
        kvserve: dict[str, DeploymentHandle],
        max_request_bytes: int,
        affine: bool,
        routes: ModelRoutes | None = None,
    ) -> None:
        self._kvserve = {name: handle.options(method_name="handle", stream=True) for name, handle in kvserve.items()}
        self._routes = routes
        self._max_request_bytes = max_request_bytes
        self._affine = affine  # whether the router reads prefix hashes (else they are not computed)
        self._draining = False
        self._in_flight: set[_Relay] = set()  # requests but /health and /metrics, as kvserve counts them

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return  # kvserve serves no websockets: the proxy closes it
        if self._draining and scope["path"] == "/health":
            await JSONResponse({"status": "draining"}, status_code=503)(scope, receive, send)
            return
        if self._draining and scope["path"] not in OPEN_PATHS:
            await _send_error(shutting_down_error(), scope, receive, send)
            return
        body = await self._read_body(scope, receive, send)
        if body is None:
            return
        head: dict[str, Any] = {key: scope[key] for key in SCOPE_KEYS if key in scope}
        for key in ("client", "server"):  # (host, port) tuples travel as lists
            head[key] = list(scope[key]) if scope.get(key) else None
        hashes = prefix_hashes(scope["path"], body) if self._affine else []
        method, path = scope["method"], scope["path"]
        if self._routes is not None and self._routes.is_listing(method, path):
            await self._join_listings(head, body, scope, receive, send)
            return
        if self._routes is not None:
            name = self._routes.deployment_for(method, path, body)
        else:
            name = next(iter(self._kvserve))
        await self._relay(name, head, body, hashes, scope, receive, send)

    async def _relay(
        self,
        name: str,
        head: dict[str, Any],
        body: bytes,
        hashes: list[int],
        scope: Scope,
        receive: Receive,
        send: Send,
    ) -> None:
        """The request to deployment `name`, its answer to `send`."""
        response = self._kvserve[name].remote(head, body, **{PREFIX_HASHES_KWARG: hashes})
        relay = _Relay(response, scope, receive, send)
        counted = scope["path"] not in OPEN_PATHS
        if counted:
            self._in_flight.add(relay)
        try:
            await relay.run()
        finally:
            self._in_flight.discard(relay)

    async def _join_listings(
        self, head: dict[str, Any], body: bytes, scope: Scope, receive: Receive, send: Send
    ) -> None:
        """A list of models from every model's deployment, joined; the first answer that is not a 200
        (a wrong API key, a deployment that stopped) is the answer as it is."""
        answers = [_Collected() for _ in self._kvserve]
        await asyncio.gather(
            *(
                self._relay(name, head, body, [], scope, receive, answer.send)
                for name, answer in zip(self._kvserve, answers, strict=True)
            )
        )
        failed = next((answer for answer in answers if answer.status != 200), None)
        if failed is not None:
            for message in failed.messages:
                await send(message)
            return
        joined = joined_listing(scope["path"], [answer.body for answer in answers])
        await Response(joined, media_type="application/json")(scope, receive, send)

    async def drain(self, grace: float) -> int:
        """Refuse new requests, give those in flight `grace` seconds, then cut the rest (each ends with 503
        shutting_down). Returns how many were cut. Again with grace 0: cut at once."""
        self._draining = True
        deadline = time.monotonic() + grace
        while self._in_flight and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        cut = list(self._in_flight)
        for relay in cut:
            relay.cut()
        deadline = time.monotonic() + CUT_ENDING_S
        while self._in_flight and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        return len(cut)

    async def _read_body(self, scope: Scope, receive: Receive, send: Send) -> bytes | None:
        """The whole body; None when the client left or it is over --max-request-bytes (then answered 413,
        as the replica would, without reading the rest)."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self._max_request_bytes:
                limit = self._max_request_bytes
                error = APIError(413, f"request body is larger than the limit of {limit} bytes")
                await _send_error(error, scope, receive, send)
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


class _Collected:
    """One deployment's whole answer, kept to be joined with the others' (Forwarder._join_listings)."""

    def __init__(self) -> None:
        self.messages: list[Message] = []

    async def send(self, message: Message) -> None:
        self.messages.append(message)

    @property
    def status(self) -> int | None:
        return next((m["status"] for m in self.messages if m["type"] == "http.response.start"), None)

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages if m["type"] == "http.response.body")


class _Relay:
    """One request's answer, from the replica's messages to the client (see the module docstring)."""

    def __init__(self, response: DeploymentResponseGenerator, scope: Scope, receive: Receive, send: Send) -> None:
        self._response = response
        self._scope = scope
        self._receive = receive
        self._send = send
        self._started: Message | None = None  # the response's start, once sent
        self._ended = False
        self._is_cut = False

    def cut(self) -> None:
        """End the request now with 503 shutting_down (the server's stop)."""
        self._is_cut = True
        self._response.cancel()

    async def run(self) -> None:
        try:
            async for messages in self._response:
                if self._is_cut:  # cancelling is best effort: the replica may still send a little
                    break
                for message in messages:
                    await self._forward(message)
        except BackPressureError:
            reason = "every replica is busy and the queue for them is full; retry later"
            await self._fail(api_error_for(QueueFullError(reason)))
            return
        except (RayError, RayServeException) as exc:
            await self._fail(self._error_for(exc))
            return
        except asyncio.CancelledError:
            self._response.cancel()  # the client left: so does the request, in the replica
            raise
        if self._is_cut:
            await self._fail(shutting_down_error())
        elif self._started is None:  # the replica answered nothing: a bug, not a client error
            await self._fail(APIError(500, "internal server error", type="internal_error"))
        elif not self._ended:
            await self._send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _forward(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            message = _without_duplicate_request_id(message, self._scope)
            self._started = message
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self._ended = True
        await self._send(message)

    def _error_for(self, exc: Exception) -> APIError:
        path = self._scope["path"]
        if self._is_cut:
            return shutting_down_error()
        if isinstance(exc, RayTaskError) and not isinstance(exc.cause, RayError):
            logger.error("request %s failed in its replica: %s", path, exc)
            return APIError(500, "internal server error", type="internal_error")
        logger.warning("the replica serving %s stopped under it: %s", path, type(exc).__name__)
        error = shutting_down_error()
        message = "the replica serving this request stopped; retry the request"
        return APIError(error.status_code, message, type=error.type, code=error.code, headers=error.headers)

    async def _fail(self, error: APIError) -> None:
        """Answer `error`: as the response if none was started, else as the end of the one that was."""
        if self._started is None:
            await _send_error(error, self._scope, self._receive, self._send)
        elif not self._ended:
            self._ended = True
            ending = _stream_end(error, self._started, self._scope)
            await self._send({"type": "http.response.body", "body": ending, "more_body": False})


def _stream_end(error: APIError, started: Message, scope: Scope) -> bytes:
    """What ends a response the replica could not finish: for an SSE stream, the error as kvserve's own
    streams end with one (server/serving.py); for anything else, nothing (its status is sent already)."""
    content_type = dict(started.get("headers", ())).get(b"content-type", b"")
    if not content_type.startswith(b"text/event-stream"):
        return b""
    body = error.to_body()
    if scope["path"].endswith("/responses"):  # the Responses API: named events, no [DONE]
        event = {"type": "error", **body["error"]}
        return f"event: error\ndata: {json.dumps(event)}\n\n".encode()
    return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()


def _without_duplicate_request_id(message: Message, scope: Scope) -> Message:
    """Serve's proxy gives every request an X-Request-Id (the client's, or one it makes; the replica echoes
    it) and adds it to the response itself: the replica's copy would make it appear twice."""
    if not any(key == REQUEST_ID_HEADER for key, _ in scope.get("headers", ())):
        return message
    headers = [(key, value) for key, value in message.get("headers", ()) if key.lower() != REQUEST_ID_HEADER]
    return {**message, "headers": headers}


async def _send_error(error: APIError, scope: Scope, receive: Receive, send: Send) -> None:
    response = JSONResponse(error.to_body(), status_code=error.status_code, headers=error.headers)
    await response(scope, receive, send)


async def _lifespan(receive: Receive, send: Send) -> None:
    """Serve runs the app's lifespan; the forwarder has nothing to start or stop."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


@serve.ingress()
class KVServeIngress:
    """The deployment around Forwarder (its options: server/ray/deployments.py). affine: whether KVServe's
    router is PrefixAffineRouter (else the prefix hashes are not computed). routes: with per-model deployments,
    which deployment serves a request; `kvserve` then holds one handle per name in routes.names, in order."""

    def __init__(
        self, config: ServerConfig, affine: bool, routes: ModelRoutes | None, *kvserve: DeploymentHandle
    ) -> None:
        # As in a KVServe replica (server/ray/replica.py): this process's log lines reach Ray's logs.
        logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
        logging.getLogger().setLevel(config.log_level.upper())
        names = routes.names if routes is not None else [SHARED_DEPLOYMENT]
        handles = dict(zip(names, kvserve, strict=True))
        self._forwarder = Forwarder(handles, config.max_request_bytes, affine, routes)

    def __serve_build_asgi_app__(self) -> Forwarder:
        return self._forwarder

    async def drain(self, grace: float) -> int:
        """kvserve's stop for the application (see the module docstring); returns how many requests were cut."""
        return await self._forwarder.drain(grace)
