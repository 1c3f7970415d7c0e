"""The torch worker: the one thread that runs a process's torch work, and the contract of its clients.

torch's CPU ops run on OpenMP, and libgomp keeps a separate team of worker
threads for every thread that enters a parallel region. Once two threads have
done torch work, the two teams fight for the cores. Measured on the 2-core
development machine, a SmolLM2 int8 decode step takes 22 ms when the model is
loaded and stepped on one thread. It takes 50-57 ms on either thread once a
second thread has run torch ops, even with that thread idle.

So one `TorchWorker` loads both models and runs every generation step and
every embedding forward, one job at a time in FIFO order: a generation step
and an embedding batch take turns, and neither can starve the other. Taking
turns is not enough by itself: an 8192-token embedding forward takes over a
second, and a stream waiting for it between two of its tokens stalls that long.
So the worker times each kind of job, and while generation runs the embedder
sizes its turns by the length of a generation step and takes only its share of
the worker's time (engine/serving/async_encoder.py).

Its two clients, `AsyncEngine` (generation) and `AsyncEncoder` (embeddings),
give their callers the same guarantees through `RequestLimits`, with the errors
of engine/errors.py: queue bound -> QueueFullError, deadline ->
RequestTimeoutError, client gone (the caller's task cancelled) -> the request is
dropped and its resources freed, worker or client loop dead -> EngineDeadError,
a failed step or forward -> EngineStepError for the requests in it only.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from engine.errors import EngineDeadError, QueueFullError

T = TypeVar("T")


class TorchWorker:
    """Runs callables on one dedicated thread; `run` is awaited from the event loop."""

    def __init__(self, name: str = "kvserve-torch") -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._is_stopped = False
        self._turns: dict[str, _TurnTimes] = {}  # job kind -> its recent durations
        self._num_waiting: dict[str, int] = {}  # job kind -> its jobs submitted and not yet done
        self._wanting: set[str] = set()  # job kinds whose client has work now (want_turns)
        self._turn_start = 0.0  # when the running job's current turn began (the torch thread's own)

    @property
    def is_alive(self) -> bool:
        return not self._is_stopped

    async def run(self, fn: Callable[..., T], *args: Any, kind: str = "other") -> T:
        """fn(*args) on the torch thread, after every job submitted before it; timed as a job of `kind`."""
        return await self.submit(fn, *args, kind=kind)

    def submit(self, fn: Callable[..., T], *args: Any, kind: str = "other") -> asyncio.Future[T]:
        """As `run`, but the job is queued before this returns (on the event loop's thread): the caller can do
        other loop work while it runs, and the worker does not wait for that work to get the job."""
        if self._is_stopped:
            raise EngineDeadError("the torch worker has stopped")
        self._num_waiting[kind] = self._num_waiting.get(kind, 0) + 1
        future = asyncio.get_running_loop().run_in_executor(self._executor, self._timed, kind, fn, args)

        def done(_: asyncio.Future) -> None:
            self._num_waiting[kind] -= 1

        future.add_done_callback(done)
        return future

    def want_turns(self, kind: str, wanting: bool) -> None:
        """A client says whether it has work of `kind` now (jobs to come), whether or not one is queued."""
        if wanting:
            self._wanting.add(kind)
        else:
            self._wanting.discard(kind)

    def others_waiting(self, kind: str) -> bool:
        """From the running job of `kind` (torch thread): another job is queued, or another kind of work wants
        its turns; a job that runs on (engine/serving/step_chain.py) ends here."""
        # One C call each (a sum, a set difference), so the loop's writes cannot change them mid-read.
        return sum(self._num_waiting.values()) > 1 or bool(self._wanting - {kind})

    def end_turn(self, kind: str) -> None:
        """From the running job of `kind` (torch thread): time what it did since its start (or its last turn) as
        one turn, and go on with the next."""
        self._record_turn(kind, self._turn_start, time.monotonic())

    def recent_turn_seconds(self, kind: str, within_s: float = 0.25) -> float | None:
        """How long a job of `kind` lasts (a moving average) while that kind of work is active: its client
        wants turns, a job of it waits or runs, or one ended in the last `within_s` seconds. None when it
        is idle (or never ran)."""
        turns = self._turns.get(kind)
        if turns is None:
            return None
        is_active = (
            kind in self._wanting or self._num_waiting.get(kind, 0) > 0 or time.monotonic() - turns.last_end <= within_s
        )
        return turns.average_s if is_active else None

    def busy_seconds(self, kind: str) -> float:
        """Seconds the worker has spent on jobs of `kind` so far."""
        turns = self._turns.get(kind)
        return turns.total_s if turns is not None else 0.0

    def _timed(self, kind: str, fn: Callable[..., T], args: tuple) -> T:
        self._turn_start = time.monotonic()
        try:
            return fn(*args)
        finally:
            self._record_turn(kind, self._turn_start, time.monotonic())

    def _record_turn(self, kind: str, start: float, end: float) -> None:
        self._turn_start = end
        turns = self._turns.get(kind)
        if turns is None:
            self._turns[kind] = _TurnTimes(average_s=end - start, last_end=end, total_s=end - start)
        else:
            turns.average_s += _TURN_AVERAGE_WEIGHT * (end - start - turns.average_s)
            turns.last_end = end
            turns.total_s += end - start

    def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) on the torch thread, waited for in the calling thread (scripts and benchmarks)."""
        return self._executor.submit(fn, *args).result()

    async def stop(self) -> None:
        """Refuse new jobs; wait (off the event loop) for the one running, if any."""
        self._is_stopped = True
        await asyncio.get_running_loop().run_in_executor(None, self._executor.shutdown, True)


# The kinds of job the worker times (`run(..., kind=)`).
GENERATION_TURN = "generation"
EMBEDDING_TURN = "embedding"
INSPECT_TURN = "inspect"  # the playground's looks inside the engine: KV snapshots, attention weights
_TURN_AVERAGE_WEIGHT = 0.2  # of the newest job: steps vary with the batch, the average follows in a few


@dataclass
class _TurnTimes:
    average_s: float
    last_end: float  # time.monotonic()
    total_s: float


@dataclass(frozen=True)
class RequestLimits:
    """The admission rules both clients of the worker apply, with the same errors.

    max_queued_requests: requests (not inputs or samples) admitted but not yet started;
        past it a new one gets QueueFullError at once.
    request_timeout: seconds from admission to the last result (None: no limit).
    """

    max_queued_requests: int = 256
    request_timeout: float | None = None

    def __post_init__(self) -> None:
        if self.max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be at least 1, got {self.max_queued_requests}")
        if self.request_timeout is not None and self.request_timeout <= 0:
            raise ValueError(f"request_timeout must be positive, got {self.request_timeout}")

    def admit(self, num_queued_requests: int, what: str) -> float | None:
        """Raise QueueFullError if the queue is full; else the new request's deadline (monotonic) or None."""
        if num_queued_requests >= self.max_queued_requests:
            raise QueueFullError(
                f"server is full: {num_queued_requests} {what} requests are waiting "
                f"(max_queued_requests={self.max_queued_requests}); retry later"
            )
        return time.monotonic() + self.request_timeout if self.request_timeout else None


async def wait_until(awaitable: Awaitable[T], deadline: float | None) -> T:
    """Await with an absolute monotonic deadline; raises TimeoutError past it (None: no limit).

    Never `asyncio.wait_for`: up to Python 3.11, a cancel that arrives as its awaitable completes
    is swallowed (the result is returned, the caller's task stays cancelled-but-running), and a
    request whose client left would run on to its end. `asyncio.timeout` re-raises every cancel
    that is not its own.
    """
    if deadline is None:
        return await awaitable
    remaining = deadline - time.monotonic()
    if remaining <= 0:  # past it, even an awaitable that is ready at once is too late
        if inspect.iscoroutine(awaitable):
            awaitable.close()
        raise TimeoutError
    async with asyncio.timeout(remaining):
        return await awaitable
