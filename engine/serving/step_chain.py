"""Generation steps run back to back on the torch thread while the event loop has nothing to apply between them.

One step per worker job costs every step a round trip through the event loop: the loop wakes on the finished
job, looks at its inbox, queues the next step, and the torch thread wakes again (0.5-0.7 ms a step on 2 cores,
against a 1.1B model's 12-13 ms step). So a job goes on with the next step itself while nothing needs the loop
first, and hands each finished step's outputs to the loop, which turns them into text while the next step runs,
as it does with the last step of every job.

The job ends (the loop gets its last step's outputs and the engine's stats after it as the job's result) as soon
as:
- the loop has something to apply before the next step: an add, an abort, a snapshot, a stop string found in a
  step's text, or the engine stopping (`interrupt()`);
- the loop has not yet handed out the outputs of every step before the one just finished (a stop string in them
  must stop its sample before the step after next, as without chaining);
- another job waits for the torch thread (another model's step, an embedding batch, an inspection) or another
  kind of work wants its turns;
- no sequence is running, or the earliest request deadline has passed.

The flags below are written on one thread and read on the other; each is one attribute, read or written whole.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from engine.outputs import EngineStats, RequestOutput
from engine.serving.torch_worker import GENERATION_TURN, TorchWorker

if TYPE_CHECKING:
    from engine.engine_core import LLMEngine


class StepChain:
    """deliver(outputs, stats): called on the event loop with each step's outputs but a job's last, and the
    engine's stats after that step (the loop must not ask the engine while the job runs)."""

    def __init__(
        self, engine: LLMEngine, worker: TorchWorker, deliver: Callable[[list[RequestOutput], EngineStats], None]
    ) -> None:
        self._engine = engine
        self._worker = worker
        self._deliver = deliver
        self._loop: asyncio.AbstractEventLoop | None = None
        # Written on the event loop, read on the torch thread.
        self._interrupted = False
        self._deadline: float | None = None
        self._num_handed_out = 0  # steps whose outputs the loop has handed out
        # Written on the torch thread.
        self._num_run = 0  # steps run to the end

    def submit(self, deadline: float | None) -> asyncio.Future[tuple[list[RequestOutput], EngineStats]]:
        """Queue a job of one or more steps (event loop); `deadline`: the earliest request deadline (monotonic)."""
        self._interrupted = False
        self._engine.end_bursts_early(False)
        self._deadline = deadline
        self._loop = asyncio.get_running_loop()
        return self._worker.submit(self._run, kind=GENERATION_TURN)

    def interrupt(self) -> None:
        """The loop has something to apply before the next step (event loop); a greedy burst under way ends
        after its current step."""
        self._interrupted = True
        self._engine.end_bursts_early(True)

    def note_handed_out(self) -> None:
        """The loop has handed out one more step's outputs, in step order (event loop)."""
        self._num_handed_out += 1

    def _run(self) -> tuple[list[RequestOutput], EngineStats]:
        assert self._loop is not None
        outputs = self._step()
        while True:
            stats = self._engine.stats()
            if not self._may_go_on(stats):
                return outputs, stats
            self._worker.end_turn(GENERATION_TURN)  # each step is timed as a turn of its own
            self._loop.call_soon_threadsafe(self._deliver, outputs, stats)
            outputs = self._step()

    def _step(self) -> list[RequestOutput]:
        outputs = self._engine.step()
        self._num_run += 1
        return outputs

    def _may_go_on(self, stats: EngineStats) -> bool:
        return (
            not self._interrupted
            and self._num_handed_out >= self._num_run - 1
            and stats.num_running > 0
            and (self._deadline is None or time.monotonic() < self._deadline)
            and not self._worker.others_waiting(GENERATION_TURN)
        )
