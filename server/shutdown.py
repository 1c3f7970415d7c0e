"""The server's stop: its phase, the requests in flight, and the error a stopped request gets.

A SIGTERM or SIGINT (server/cli/runner.py moves the phases) takes the server through:

- serving: normal work.
- draining: /health answers 503 {"status": "draining"} so load balancers stop sending; every
  new request is refused with 503 `shutting_down` and `Retry-After`; the requests in flight
  run on, for up to --shutdown-timeout seconds.
- stopping: nothing is left in flight, the grace is over, or a second signal came. The engine
  and the embedder stop, so every request still running ends with 503 `shutting_down` (a
  stream: an SSE error event, then `data: [DONE]`); then the process exits.

One `Shutdown` per app, in ServerState: the CLI moves its phase, the middleware counts the
requests in flight, server/serving.py reads the phase to name the error a stopped engine gives.
"""

from __future__ import annotations

from dataclasses import dataclass

from starlette.types import Scope

from server.errors import APIError

SERVING = "serving"
DRAINING = "draining"
STOPPING = "stopping"


@dataclass
class Shutdown:
    """phase: SERVING -> DRAINING -> STOPPING, one way. Touched on the event-loop thread only."""

    phase: str = SERVING
    num_in_flight: int = 0  # requests past the middleware's checks, not yet answered
    # The stop came while a model was loading: the load still runs on the torch thread and
    # cannot be interrupted, so the process must end without waiting for that thread.
    interrupted_load: bool = False

    @property
    def is_draining(self) -> bool:
        """Draining or stopping: no new request is let in."""
        return self.phase != SERVING

    @property
    def is_stopping(self) -> bool:
        return self.phase == STOPPING

    def begin_draining(self) -> None:
        if self.phase == SERVING:
            self.phase = DRAINING

    def begin_stopping(self) -> None:
        self.phase = STOPPING

    def request_started(self) -> None:
        self.num_in_flight += 1

    def request_finished(self) -> None:
        self.num_in_flight -= 1


def shutting_down_error() -> APIError:
    """The answer to a request refused while draining, or cut when the server stops."""
    return APIError(
        503,
        "the server is shutting down; retry the request",
        type="service_unavailable",
        code="shutting_down",
        # The client should come back (to another replica behind the same address), not on this connection.
        headers={"Retry-After": "1", "Connection": "close"},
    )


def is_stopping(scope: Scope) -> bool:
    """Whether the server handling this request has begun stopping (the middleware put its Shutdown in the scope)."""
    shutdown = scope.get("state", {}).get("shutdown")
    return shutdown is not None and shutdown.is_stopping
