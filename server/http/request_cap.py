"""The request cap (`--limit-concurrency`): `cap_requests_in_progress` wraps the ASGI app and answers
uvicorn's plain-text 503 past the cap. It counts requests in progress, not connections as uvicorn's own
`limit_concurrency` does (off), so idle connections hold no slot; /health is never refused, so a liveness
probe cannot be starved. The connection limits are server/http/h11_protocol.py's.
"""

from __future__ import annotations

import logging

from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.flow_control import service_unavailable

from server.http.h11_protocol import REFUSAL_LOG_INTERVAL_S, LogThrottle

logger = logging.getLogger(__name__)

# Paths `cap_requests_in_progress` always serves and does not count.
UNCAPPED_PATHS = frozenset({"/health"})


def cap_requests_in_progress(app: ASGIApp, limit: int | None) -> ASGIApp:
    """`app`, answering uvicorn's plain-text 503 (Connection: close) to an HTTP request that finds
    `limit` others in progress (None: `app` itself). A request is in progress from its complete head
    to the end of its answer, a stream's last byte included; an open connection between requests
    holds nothing. UNCAPPED_PATHS are neither refused nor counted."""
    if limit is None:
        return app
    if limit < 1:
        raise ValueError(f"limit must be positive, got {limit}")
    in_progress = 0
    refusals = LogThrottle(REFUSAL_LOG_INTERVAL_S)

    async def capped(scope: Scope, receive: Receive, send: Send) -> None:
        nonlocal in_progress
        if scope["type"] != "http" or scope["path"] in UNCAPPED_PATHS:
            await app(scope, receive, send)
            return
        if in_progress >= limit:
            refused = refusals.tick("")
            if refused is not None:
                logger.warning(
                    "%d request(s) in progress (--limit-concurrency): %d refused with 503 since the last such line",
                    in_progress,
                    refused,
                )
            await service_unavailable(scope, receive, send)
            return
        in_progress += 1
        try:
            await app(scope, receive, send)
        finally:
            in_progress -= 1

    return capped
