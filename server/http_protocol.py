"""uvicorn's h11 protocol plus a request-head timeout (`--timeout-request-head`).

uvicorn (0.54) bounds only the idle gap between requests on a kept-alive connection
(`timeout_keep_alive`, cancelled by the first byte of the next request). A client that opens a
connection and sends nothing, or sends a request head a few bytes at a time and never finishes it
(slowloris), holds a connection, and a `--limit-concurrency` slot, for ever. Here a connection
that has not delivered a complete request head within `timeout_request_head` seconds of being
opened, or of its previous response completing, is closed. Once a head is in, the timer is off:
a slow request body or a long SSE stream is never cut by it.

"Waiting for a head" is h11's own client state, `conn.their_state is h11.IDLE`: it leaves IDLE
when h11 parses a complete `Request` and is IDLE again after `start_next_cycle()` on a
kept-alive connection. Hooks used, all overridden by calling uvicorn's method first:
`connection_made` (arm), `data_received` (disarm once a head is parsed; also re-arms after a
pipelined or body-finishing cycle restart), `on_response_complete` (re-arm for the next head) and
`connection_lost` (disarm). Besides those it reads only `self.conn` (the h11.Connection, public
API), `self.transport`, `self.loop` and `self.logger`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import h11
from uvicorn.config import Config
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

_TIMEOUT_BODY = b"Request Timeout: the request head did not arrive in time.\n"


def with_request_head_timeout(timeout: float) -> type[H11Protocol]:
    """An H11Protocol class for uvicorn.Config(http=...) whose connections time out waiting for a head.

    uvicorn builds the protocol itself with (config, server_state, app_state), so the timeout goes
    in through a subclass rather than an argument.
    """
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}")

    class Protocol(RequestHeadTimeoutH11Protocol):
        timeout_request_head = timeout

    return Protocol


class RequestHeadTimeoutH11Protocol(H11Protocol):
    timeout_request_head: float = 10.0

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._sync_head_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._sync_head_timer()

    def on_response_complete(self) -> None:
        # Disarmed since this request's head arrived, so this starts a full period for the next
        # head; if uvicorn already parsed a pipelined head above, the sync leaves it off.
        super().on_response_complete()
        self._sync_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _sync_head_timer(self) -> None:
        # Armed exactly while the connection is open and h11 waits for a request head. An armed
        # timer is not restarted by more bytes: the whole head must arrive within the period.
        waiting = not self.transport.is_closing() and self.conn.their_state is h11.IDLE
        if waiting and self._head_timer is None:
            self._head_timer = self.loop.call_later(self.timeout_request_head, self._on_head_timeout)
        elif not waiting:
            self._cancel_head_timer()

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _on_head_timeout(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        partial_head = bool(self.conn.trailing_data[0])
        self.logger.log(
            # Idle pre-opened connections are routine; a head left unfinished is worth a line.
            logging.INFO if partial_head else logging.DEBUG,
            "%s - no complete request head within %gs (%s): connection closed",
            f"{self.client[0]}:{self.client[1]}" if self.client else "client",
            self.timeout_request_head,
            "partial head" if partial_head else "nothing received",
        )
        # A 408 only to a client mid-head: it reads it as the answer to that request. One that sent
        # nothing may be a pooled idle connection about to send its next request, which would then
        # read a stale 408 as its answer; it gets a plain close, as uvicorn's keep-alive timeout does.
        if partial_head and self.conn.our_state is h11.IDLE:
            try:
                self._send_408()
            except h11.LocalProtocolError:  # h11 refused: just close
                pass
        if self.conn.our_state is not h11.ERROR:
            try:
                self.conn.send(h11.ConnectionClosed())
            except h11.LocalProtocolError:
                pass
        self.transport.close()

    def _send_408(self) -> None:
        headers = [
            (b"content-type", b"text/plain; charset=utf-8"),
            (b"content-length", str(len(_TIMEOUT_BODY)).encode("ascii")),
            (b"connection", b"close"),
        ]
        response = h11.Response(status_code=408, headers=headers, reason=b"Request Timeout")
        for event in (response, h11.Data(data=_TIMEOUT_BODY), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event) or b"")
