"""The async engine's record of each request it serves, and the stream its caller reads.

One `TrackedRequest` per request, from `AsyncEngine.submit()` until the engine forgets it, holds
all the async side knows of it: the queue its outputs go to, its deadline, whether it has produced
output yet and its text state. `RequestTable` keeps them by id, so forgetting a request is one pop.
A forgotten request's id may be taken again at once by a new request; so whatever the engine does
for a request (apply its add, fail it, release it when its stream closes) holds its record, not its
id, and touches the table only while that record is still the one under the id.

`RequestStream` is the caller's end of a record: it reads the queue, and closing it releases the
request (the engine forgets it, and aborts it unless it finished).

Event-loop thread only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.errors import InvalidRequestError, RequestTimeoutError
from engine.outputs import RequestOutput
from engine.serving.output_processor import RequestTextState
from engine.serving.torch_worker import wait_until

if TYPE_CHECKING:
    from typing import Self


@dataclass(eq=False)
class TrackedRequest:
    """One request on the async side; compared by identity (a newer request may reuse its id)."""

    request_id: str
    deadline: float | None  # monotonic; None without a timeout, and once it finished (it cannot time out then)
    # RequestOutputs, then maybe the exception that ends the request; its RequestStream reads them.
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    has_output: bool = False  # until its first output it counts as queued (the queue bound)
    text: RequestTextState | None = None  # its samples' text state, from the moment the engine accepted it

    @property
    def is_accepted(self) -> bool:
        """The engine took its add: it is (or was) in the engine's steps."""
        return self.text is not None

    def deliver(self, output: RequestOutput) -> None:
        """Hand an output to the stream; once it is the last, the request can no longer time out."""
        self.has_output = True
        if output.finished:
            self.deadline = None
        self.queue.put_nowait(output)


class RequestTable:
    """The tracked requests by id."""

    def __init__(self) -> None:
        self._by_id: dict[str, TrackedRequest] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[TrackedRequest]:
        """Over a copy: the caller may forget requests as it goes."""
        return iter(list(self._by_id.values()))

    def track(self, request_id: str, deadline: float | None) -> TrackedRequest:
        if request_id in self._by_id:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        request = self._by_id[request_id] = TrackedRequest(request_id, deadline)
        return request

    def get(self, request_id: str) -> TrackedRequest | None:
        return self._by_id.get(request_id)

    def is_current(self, request: TrackedRequest) -> bool:
        """Not forgotten yet (its id may since name a newer request, which nothing done for this one may touch)."""
        return self._by_id.get(request.request_id) is request

    def forget(self, request: TrackedRequest) -> bool:
        """Drop the request; False if it was forgotten already."""
        if not self.is_current(request):
            return False
        del self._by_id[request.request_id]
        return True

    def forget_all(self) -> list[TrackedRequest]:
        requests = list(self._by_id.values())
        self._by_id.clear()
        return requests

    @property
    def num_without_output(self) -> int:
        """Requests that have produced no output yet, pending adds included; n samples count once."""
        return sum(not request.has_output for request in self._by_id.values())

    def next_deadline(self) -> float | None:
        return min((r.deadline for r in self._by_id.values() if r.deadline is not None), default=None)

    def past_deadline(self, now: float) -> list[TrackedRequest]:
        return [r for r in self._by_id.values() if r.deadline is not None and r.deadline <= now]

    def text_of(self, request_id: str) -> RequestTextState | None:
        """The request's text state, for the output processor; None if untracked or not accepted yet."""
        request = self._by_id.get(request_id)
        return request.text if request is not None else None


class RequestStream:
    """Outputs of one request, as an async iterator. Close it (or use `async with`) when done early.

    Iteration ends after the output with `finished=True`; an engine-side failure is raised
    from `__anext__`.
    """

    def __init__(self, request: TrackedRequest, release: Callable[[bool], None]) -> None:
        self.request_id = request.request_id
        self._queue = request.queue
        self._deadline = request.deadline
        self._release = release  # release(abort): the engine forgets the request, aborting it if asked
        self._finished = False
        self._closed = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._finished or self._closed:
            raise StopAsyncIteration
        try:
            item = await wait_until(self._queue.get(), self._deadline)
        except TimeoutError:  # the builtin TimeoutError from 3.11 on
            self.close()
            raise RequestTimeoutError(f"request {self.request_id} timed out and was aborted") from None
        except BaseException:
            self.close()  # cancelled: the client is gone
            raise
        if isinstance(item, BaseException):
            self._finished = True  # the engine already dropped it
            self.close()
            raise item
        if item.finished:
            self._finished = True
            self.close()
        return item

    def close(self) -> None:
        """Stop listening; aborts the request unless it finished. Safe to call many times, from `finally`."""
        if self._closed:
            return
        self._closed = True
        self._release(not self._finished)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
