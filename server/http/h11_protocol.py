"""uvicorn's h11 protocol with connection limits a client cannot turn against the server.

uvicorn (0.54) alone bounds only the idle gap between requests on a kept-alive connection
(`timeout_keep_alive`), and its `limit_concurrency` counts open connections, so a few dozen silent
sockets answer every request, /health included, with 503. Here:

- Request-head deadline (`--timeout-request-head`): a connection that has not delivered a complete
  request head within that many seconds of being opened, or of its previous response completing,
  is closed (a 408 first if part of a head came). Bounds silent connections and slowloris heads.
- Request-body deadline (`--timeout-request-body`): once a head is in, its whole body must arrive
  within that many seconds, else 408 and the connection closed; the route reading it sees a
  client disconnect. Every route reads its body first, so the deadline measures the client's pace.
  A response, streamed or not, is never cut by it once the body is complete.
- Exact head size (`--max-request-head-bytes`): h11 checks its `max_incomplete_event_size` only
  while a head is incomplete, so a longer head that arrived complete in one read was accepted.
  `HeadLimitedConnection` counts each head's bytes itself, from the start of its request cycle to
  its blank line, whatever the read boundaries (pipelined and kept-alive requests too); a longer
  head gets uvicorn's 400 and the connection closed, as h11's own error does.
- Connections per client (`--max-connections-per-client`): a peer address holding that many open
  connections has further ones closed at once, so idle sockets from one client cannot exhaust
  file descriptors; refusals are logged at most once per `REFUSAL_LOG_INTERVAL_S` per peer.
- Requests in progress (`--limit-concurrency`): not a connection limit, so not here but in
  server/http/request_cap.py, which wraps the ASGI app.

The deadlines follow h11's own client state: "waiting for a head" is `conn.their_state is
h11.IDLE` (left when h11 parses a `Request`, entered again by `start_next_cycle()` on a kept-alive
connection), "receiving a body" is `their_state is h11.SEND_BODY`. One timer per connection is armed
for the phase it is in and re-armed only when the phase changes, so more bytes never extend it.
Hooks used, all overridden by calling uvicorn's method first: `connection_made` (admit, arm),
`data_received` and `on_response_complete` (follow the phase), `connection_lost` (release, disarm).
Besides those it reads only `self.conn` (replaced by a `HeadLimitedConnection`), `self.cycle`
(to end a request whose body timed out as a disconnect), `self.client`, `self.transport`,
`self.loop` and `self.logger`.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.config import Config
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

logger = logging.getLogger(__name__)

_HEAD_TIMEOUT_BODY = b"Request Timeout: the request head did not arrive in time.\n"
_BODY_TIMEOUT_BODY = b"Request Timeout: the request body did not arrive in time.\n"
# h11's end of a head: the first blank line, bare LF line endings accepted.
_END_OF_HEAD = re.compile(b"\n\r?\n")
REFUSAL_LOG_INTERVAL_S = 10.0


@dataclass(frozen=True)
class ConnectionLimits:
    """What each connection is held to (ServerConfig's fields of the same names say what each means)."""

    timeout_request_head: float
    timeout_request_body: float
    max_request_head_bytes: int
    max_connections_per_client: int | None

    def __post_init__(self) -> None:
        if not self.timeout_request_head > 0:
            raise ValueError(f"timeout_request_head must be positive, got {self.timeout_request_head}")
        if not self.timeout_request_body > 0:
            raise ValueError(f"timeout_request_body must be positive, got {self.timeout_request_body}")


class LogThrottle:
    """At most one log line per key per `interval_s`; `tick` says how many events the line stands for."""

    # Keys kept before the stale ones are dropped: bounds memory under a flood of distinct peers.
    MAX_KEYS = 4096

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._interval_s = interval_s
        self._clock = clock
        self._last_line_at: dict[str, float] = {}
        self._held_back: dict[str, int] = {}

    def tick(self, key: str) -> int | None:
        """Count one event; the number of events since the last line (this one included) if a line is
        due now, else None."""
        now = self._clock()
        last = self._last_line_at.get(key)
        if last is not None and now - last < self._interval_s:
            self._held_back[key] = self._held_back.get(key, 0) + 1
            return None
        if len(self._last_line_at) >= self.MAX_KEYS:
            self._drop_stale(now)
        self._last_line_at[key] = now
        return self._held_back.pop(key, 0) + 1

    def _drop_stale(self, now: float) -> None:
        for key in [k for k, at in self._last_line_at.items() if now - at >= self._interval_s]:
            del self._last_line_at[key]
            self._held_back.pop(key, None)


class PeerConnections:
    """Open connections per peer address, at most `cap` each (None: no cap)."""

    def __init__(self, cap: int | None) -> None:
        self._cap = cap
        self._open: dict[str, int] = {}

    def admit(self, peer: str) -> bool:
        """Count a new connection from `peer`; False (and not counted) if it already holds `cap`."""
        held = self._open.get(peer, 0)
        if self._cap is not None and held >= self._cap:
            return False
        self._open[peer] = held + 1
        return True

    def release(self, peer: str) -> None:
        held = self._open.get(peer, 0) - 1
        if held > 0:
            self._open[peer] = held
        else:
            self._open.pop(peer, None)

    def open_from(self, peer: str) -> int:
        return self._open.get(peer, 0)


class HeadMeter:
    """Measures one request head as its bytes arrive: `length` once its blank line is in, and whether
    it is longer than `limit` bytes (request line, headers, their line endings and the blank line),
    known as soon as it is true, before the head is complete."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.start(b"")

    def start(self, buffered: bytes) -> None:
        """A new head begins at buffered[0] (buffered: what has arrived of it, and maybe more)."""
        self.length: int | None = None
        self._seen = 0
        self._tail = b""  # the last bytes seen, so a blank line split across two reads is found
        self.feed(buffered)

    def feed(self, data: bytes) -> None:
        if self.length is not None or not data:
            return
        window = self._tail + data
        match = _END_OF_HEAD.search(window)
        if match is not None:
            self.length = self._seen - len(self._tail) + match.end()
        self._seen += len(data)
        self._tail = window[-2:]

    @property
    def over_limit(self) -> bool:
        if self.length is not None:
            return self.length > self.limit
        # No blank line in what was seen: the head is at least one byte longer.
        return self._seen >= self.limit


class HeadLimitedConnection(h11.Connection):
    """An h11 server connection that refuses a request head longer than `max_head_bytes`, however it
    was split into reads: `next_event` raises h11.RemoteProtocolError (uvicorn answers 400 and
    closes) instead of parsing it. The meter restarts with each request cycle, on the bytes already
    buffered for the next (pipelined) request."""

    def __init__(self, max_head_bytes: int, max_incomplete_event_size: int) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size=max_incomplete_event_size)
        self._head = HeadMeter(max_head_bytes)

    def receive_data(self, data: bytes) -> None:
        super().receive_data(data)
        # Bytes that arrive while the current head is parsed belong to a later cycle: start_next_cycle
        # meters them from the buffer.
        if self.their_state is h11.IDLE:
            self._head.feed(data)

    def start_next_cycle(self) -> None:
        super().start_next_cycle()
        self._head.start(self.trailing_data[0])

    def next_event(self) -> h11.Event | type[h11.NEED_DATA] | type[h11.PAUSED]:
        if self.their_state is h11.IDLE and self._head.over_limit:
            raise h11.RemoteProtocolError(f"request head longer than {self._head.limit} bytes", error_status_hint=431)
        return super().next_event()


def limited_h11_protocol(limits: ConnectionLimits) -> type[H11Protocol]:
    """An H11Protocol class for uvicorn.Config(http=...) that holds its connections to `limits`.

    uvicorn builds the protocol itself with (config, server_state, app_state), so the limits go in
    through a subclass rather than an argument; each call makes one with its own per-peer counts.
    """

    class Protocol(LimitedH11Protocol):
        pass

    Protocol.limits = limits
    Protocol.peers = PeerConnections(limits.max_connections_per_client)
    Protocol.refusals = LogThrottle(REFUSAL_LOG_INTERVAL_S)
    return Protocol


_HEAD = "head"
_BODY = "body"


class LimitedH11Protocol(H11Protocol):
    limits: ConnectionLimits
    peers: PeerConnections
    refusals: LogThrottle

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.conn = HeadLimitedConnection(
            self.limits.max_request_head_bytes,
            max_incomplete_event_size=config.h11_max_incomplete_event_size or self.limits.max_request_head_bytes,
        )
        self._peer: str | None = None  # counted in `peers` while this is set
        self._deadline: asyncio.TimerHandle | None = None
        self._deadline_phase: str | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        peer = self.client[0] if self.client else None
        if peer is not None:
            if not self.peers.admit(peer):
                self._refuse(peer)
                return
            self._peer = peer
        self._sync_deadline()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._sync_deadline()

    def on_response_complete(self) -> None:
        # Off since this request's head arrived, so this starts a full period for the next head; if
        # uvicorn already parsed a pipelined head above, the sync follows that request's phase.
        super().on_response_complete()
        self._sync_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_deadline()
        if self._peer is not None:
            self.peers.release(self._peer)
            self._peer = None
        super().connection_lost(exc)

    def _refuse(self, peer: str) -> None:
        refused = self.refusals.tick(peer)
        if refused is not None:
            self.logger.warning(
                "%s holds %d connections (--max-connections-per-client): %d new connection(s) closed "
                "at once since the last such line",
                peer,
                self.peers.open_from(peer),
                refused,
            )
        self.transport.close()

    def _phase(self) -> str | None:
        if self.transport.is_closing():
            return None
        if self.conn.their_state is h11.IDLE:
            return _HEAD
        if self.conn.their_state is h11.SEND_BODY:
            return _BODY
        return None

    def _sync_deadline(self) -> None:
        # Armed for the phase the connection is in; an armed timer is not restarted by more bytes:
        # the whole head, or the whole body, must arrive within its period.
        phase = self._phase()
        if phase == self._deadline_phase:
            return
        self._cancel_deadline()
        if phase is not None:
            timeout = self.limits.timeout_request_head if phase == _HEAD else self.limits.timeout_request_body
            self._deadline = self.loop.call_later(timeout, self._on_deadline, phase)
            self._deadline_phase = phase

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = None
        self._deadline_phase = None

    def _on_deadline(self, phase: str) -> None:
        self._deadline = None
        self._deadline_phase = None
        if self._phase() != phase:
            return
        if phase == _HEAD:
            self._on_head_timeout()
        else:
            self._on_body_timeout()
        if self.conn.our_state is not h11.ERROR:
            try:
                self.conn.send(h11.ConnectionClosed())
            except h11.LocalProtocolError:
                pass
        self.transport.close()

    def _on_head_timeout(self) -> None:
        partial_head = bool(self.conn.trailing_data[0])
        self.logger.log(
            # Idle pre-opened connections are routine; a head left unfinished is worth a line.
            logging.INFO if partial_head else logging.DEBUG,
            "%s - no complete request head within %gs (%s): connection closed",
            self._client_text(),
            self.limits.timeout_request_head,
            "partial head" if partial_head else "nothing received",
        )
        # A 408 only to a client mid-head: it reads it as the answer to that request. One that sent
        # nothing may be a pooled idle connection about to send its next request, which would then
        # read a stale 408 as its answer; it gets a plain close, as uvicorn's keep-alive timeout does.
        if partial_head and self.conn.our_state is h11.IDLE:
            self._send_408(_HEAD_TIMEOUT_BODY)

    def _on_body_timeout(self) -> None:
        self.logger.info(
            "%s - request body not complete within %gs of its head: 408, connection closed",
            self._client_text(),
            self.limits.timeout_request_body,
        )
        if self.cycle is not None and not self.cycle.response_complete:
            # The route reading the body sees a client disconnect, and its answer goes nowhere.
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        if self.conn.our_state is h11.SEND_RESPONSE:  # nothing of an answer sent yet
            self._send_408(_BODY_TIMEOUT_BODY)

    def _client_text(self) -> str:
        return f"{self.client[0]}:{self.client[1]}" if self.client else "client"

    def _send_408(self, body: bytes) -> None:
        headers = [
            (b"content-type", b"text/plain; charset=utf-8"),
            (b"content-length", str(len(body)).encode("ascii")),
            (b"connection", b"close"),
        ]
        response = h11.Response(status_code=408, headers=headers, reason=b"Request Timeout")
        try:
            for event in (response, h11.Data(data=body), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event) or b"")
        except h11.LocalProtocolError:  # h11 refused: the caller just closes
            pass
