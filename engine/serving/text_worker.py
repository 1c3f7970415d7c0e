"""The text worker: the one thread that runs tokenizers over request text, shortest job first.

Encoding a 2 MB prompt takes over a second, rendering a long chat template or decoding a long
echo tens of milliseconds: on the event loop, every other request (and `/health`, a liveness
probe) would wait that long. So the server runs each of them here: prompt encoding, chat
templates, `/tokenize` and `/detokenize`, echoed prompts, and the embedding model's
tokenization. The fast tokenizers release the GIL while they work, so the loop keeps serving.

Jobs wait in order of their size (the characters or tokens they handle), then of arrival: a
chat message never queues behind eight 2 MB tokenizations, only behind the one job running.

The tokenizers used here are used on this thread only. The event loop keeps its own copy of the
generation tokenizer for the small per-step work (incremental detokenization, stop strings,
logprob token texts), so no tokenizer object is ever shared by two threads.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from engine.errors import EngineDeadError

T = TypeVar("T")

_STOP = float("inf")  # sorts after every job: the thread ends once the jobs before it are done


class TextWorker:
    """Runs tokenizer work on one thread, off the event loop; smaller jobs first."""

    def __init__(self, name: str = "kvserve-text") -> None:
        # (size, arrival, job); the job runs fn(*args) and resolves its future on the caller's loop
        self._jobs: queue.PriorityQueue[tuple[float, int, Callable[[], None] | None]] = queue.PriorityQueue()
        self._arrivals = itertools.count()
        self._is_stopped = False
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return not self._is_stopped

    async def run(self, size: int, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) on the text thread; `size` (characters or tokens) orders it among the waiting jobs.

        The caller's task cancelled before the job starts: the job is skipped.
        """
        if self._is_stopped:
            raise EngineDeadError("the text worker has stopped")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def job() -> None:
            if future.cancelled():
                return
            result, error = None, None
            try:
                result = fn(*args)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, which raises it
                error = exc
            try:
                loop.call_soon_threadsafe(_settle, future, result, error)
            except RuntimeError:  # the caller's loop has closed: nobody waits for this answer
                pass

        self._jobs.put((float(size), next(self._arrivals), job))
        return await future

    async def stop(self) -> None:
        """Refuse new jobs; the thread ends after the jobs already queued (waited for off the loop)."""
        if self._is_stopped:
            return
        self._is_stopped = True
        self._jobs.put((_STOP, next(self._arrivals), None))
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)

    def _work(self) -> None:
        while True:
            _, _, job = self._jobs.get()
            if job is None:
                return
            job()


def _settle(future: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if future.cancelled():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
