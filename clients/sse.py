"""Server-sent events as OpenAI-compatible servers stream them: the `data` payload of each event, in order.

`iter_sse_data` / `aiter_sse_data` stop at the `[DONE]` sentinel; `iter_sse_events` yields every payload,
the sentinel included, for callers that check the framing itself.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Iterator

DONE = "[DONE]"


class SSEDecoder:
    """Incremental parser: feed lines (without their newline), get each event's `data` when the event ends."""

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        if line == "":
            return self.flush()
        if line.startswith(":"):
            return None  # SSE comment (keep-alive)
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value.removeprefix(" "))
        return None

    def flush(self) -> str | None:
        """The pending event's payload (an event cut off by the end of the stream still counts)."""
        if not self._data:
            return None
        payload = "\n".join(self._data)
        self._data = []
        return payload


def is_done(payload: str) -> bool:
    return payload.strip() == DONE


def iter_sse_events(lines: Iterable[str]) -> Iterator[str]:
    """Every event's `data` payload, `[DONE]` included."""
    decoder = SSEDecoder()
    for line in lines:
        payload = decoder.feed(line)
        if payload is not None:
            yield payload
    payload = decoder.flush()
    if payload is not None:
        yield payload


def iter_sse_data(lines: Iterable[str]) -> Iterator[str]:
    """The `data` payload of each event, up to (not including) `[DONE]`."""
    for payload in iter_sse_events(lines):
        if is_done(payload):
            return
        yield payload


async def aiter_sse_data(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    """`iter_sse_data` over an async stream of lines."""
    decoder = SSEDecoder()
    async for line in lines:
        payload = decoder.feed(line)
        if payload is not None:
            if is_done(payload):
                return
            yield payload
    payload = decoder.flush()
    if payload is not None and not is_done(payload):
        yield payload
