"""AsyncEngine: generation's client of the torch worker. A step loop, per-request queues, aborts, text.

`LLMEngine` is synchronous, text-free and not thread-safe. Its one owner is the
loop task started by `AsyncEngine.start()`: request handlers never call it.
They append adds and aborts to pending lists; the loop applies them between
steps (on the event-loop thread, while no step runs), runs `LLMEngine.step()`
on the torch worker so the event loop keeps serving HTTP (one job runs steps back
to back while nothing waits to be applied: engine/serving/step_chain.py), and
while the next step runs turns the last step's token ids into text with the output processor
(on the event-loop thread: the tokenizer is only ever used there) and hands
each `RequestOutput` to its request's queue. A stop string found in the
text stops its sample in the engine before the step after (the core may
compute a few tokens more, which the output processor drops). All the async
side knows of a request is one record (engine/serving/request_table.py), from
`submit()` until the engine forgets it.

Guarantees (the contract shared with the embedder, see engine/serving/torch_worker.py):
- validation errors from `LLMEngine.add_request` reach the caller of `submit()`
  (the add is applied before `submit()` returns);
- a consumer that stops (cancelled, closed, timed out) aborts its request, and the
  abort is applied before the next step, so its KV blocks are free within one step;
- the number of requests not yet producing output is bounded (`QueueFullError`): it
  counts requests (request ids), not sequences, so one n=128 request takes one slot;
- a request outlives its deadline only until the next loop turn: the loop aborts it
  itself, so a request nobody reads (an abandoned stream) cannot run to max_tokens;
- aborts are applied before adds, so an abort never hits a newer request;
- a request that the core failed on its own (its computation raised; the rest of its
  step went on) gets EngineStepError, and no one else does;
- a failed step (a failure no request explains) fails the requests in the engine with
  EngineStepError; `max_consecutive_step_failures` of them in a row, or a dead loop, turn
  `is_healthy` False and every request gets `EngineDeadError`.

This file stays past 400 lines on purpose: the loop, its inbox and its failure counting are
one owner of the loop's state, and every method here runs on that loop; what could stand
alone (the per-request records and their streams) lives in request_table.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.errors import (
    EngineDeadError,
    EngineStepError,
    InvalidRequestError,
    RequestTimeoutError,
)
from engine.model_info import ModelInfo, read_model_info
from engine.outputs import EngineStats, RequestOutput
from engine.params import SamplingParams
from engine.serving.output_processor import OutputProcessor, StoppedSample
from engine.serving.request_table import RequestStream, RequestTable, TrackedRequest
from engine.serving.step_chain import StepChain
from engine.serving.torch_worker import GENERATION_TURN, INSPECT_TURN, RequestLimits, TorchWorker, wait_until
from engine.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from engine.attention.probe import AttentionWeights
    from engine.core.kv_snapshot import KVCacheSnapshot
    from engine.engine_core import LLMEngine
    from engine.structured.grammar import GrammarCompiler

logger = logging.getLogger(__name__)


@dataclass
class _PendingAdd:
    request: TrackedRequest
    prompt_token_ids: list[int]
    params: SamplingParams
    done: asyncio.Future  # set when the loop applied it: None, or the engine's rejection


class AsyncEngine:
    """Serve an `LLMEngine` (and its tokenizer) to many concurrent asyncio callers.

    limits: the queue bound and request timeout (RequestLimits).
    max_consecutive_step_failures: a failing step aborts the requests in the engine; this
        many failures in a row mark the engine dead. Only a step that computed tokens resets
        the count (one that merely delivered the failed requests' abort notices does not), and
        so does `failure_reset_idle_s` seconds of idleness (no request in the engine) since the
        last failure: failures with requests arriving between them add up, so a broken model
        dies; rare failures far apart do not.
    """

    def __init__(
        self,
        engine: LLMEngine,
        tokenizer: Tokenizer,
        *,
        limits: RequestLimits | None = None,
        max_consecutive_step_failures: int = 3,
        failure_reset_idle_s: float = 5.0,
    ) -> None:
        self.llm_engine = engine
        self.limits = limits or RequestLimits()
        self.max_consecutive_step_failures = max_consecutive_step_failures
        self.failure_reset_idle_s = failure_reset_idle_s
        # Touched only on the event-loop thread.
        self._output_processor = OutputProcessor(tokenizer)
        self._requests = RequestTable()  # every request from submit() until forgotten
        # The loop's inbox, applied between steps.
        self._pending_adds: list[_PendingAdd] = []
        self._pending_aborts: set[str] = set()
        self._pending_stops: list[StoppedSample] = []
        self._snapshot_waiters: list[asyncio.Future[KVCacheSnapshot]] = []  # kv_snapshot calls
        self._idle_since_failure = 0.0
        self._stats: EngineStats = engine.stats()
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._worker: TorchWorker | None = None
        self._chain: StepChain | None = None  # runs the steps on the worker
        self._owns_worker = False
        self._dead_error: BaseException | None = None
        self._is_stopping = False
        self._num_step_failures = 0
        self._num_tokens_computed = _tokens_computed(self._stats)  # as of the last successful step
        self.num_steps = 0

    # ---- facts about the model ----
    @property
    def tokenizer(self) -> Tokenizer:
        """For the event-loop thread only (chat templates, /tokenize): the loop detokenizes with it too."""
        return self._output_processor.tokenizer

    @property
    def model_name(self) -> str:
        return self.llm_engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.llm_engine.max_model_len

    @property
    def vocab_size(self) -> int:
        """Token ids a request may carry are in [0, vocab_size) (see LLMEngine.vocab_size)."""
        return self.llm_engine.vocab_size

    @property
    def model_info(self) -> ModelInfo:
        """The model's shape and attention masking, read-only (the playground's views check against it)."""
        return read_model_info(self.llm_engine)

    # ---- life cycle ----
    async def start(self, worker: TorchWorker | None = None) -> None:
        """Start the step loop; steps run on `worker` (the server's one torch worker), or on one of its own."""
        if self._loop_task is not None:
            raise RuntimeError("AsyncEngine already started")
        self._wakeup = asyncio.Event()
        self._owns_worker = worker is None
        self._worker = worker or TorchWorker("kvserve-step")
        self._chain = StepChain(self.llm_engine, self._worker, self._deliver_chained)
        self._loop_task = asyncio.create_task(self._run_loop(), name="kvserve-engine-loop")

    async def stop(self) -> None:
        """Abort every request, let the current step finish, end the loop."""
        if self._loop_task is None:
            return
        self._is_stopping = True
        for request in self._requests:
            request.queue.put_nowait(EngineDeadError("server is shutting down"))
        self._wake()
        await self._loop_task  # the loop catches (and logs) its own errors
        if self._owns_worker and self._worker is not None:
            await self._worker.stop()
        self._fail_everything(EngineDeadError("server is shutting down"))

    @property
    def is_healthy(self) -> bool:
        return (
            self._loop_task is not None
            and not self._loop_task.done()
            and self._dead_error is None
            and not self._is_stopping
            and self._worker is not None
            and self._worker.is_alive
        )

    # ---- requests ----
    @property
    def num_queued_requests(self) -> int:
        """Requests submitted that have produced no output yet (pending adds included).

        Counts requests, not sequences: a request with n=128 is one.
        """
        return self._requests.num_without_output

    def check_admission(self) -> None:
        """Raise now what `submit` would raise for a full queue or a dead engine: callers check before
        spending work on a request (tokenizing a long prompt) that could not be admitted anyway."""
        self._check_alive()
        self.limits.admit(self.num_queued_requests, "generation")

    @property
    def num_active_requests(self) -> int:
        return len(self._requests)

    @property
    def grammar(self) -> GrammarCompiler | None:
        """The engine's structured-output compiler; thread-safe (the server compiles on its text worker)."""
        return self.llm_engine.grammar

    @property
    def kv_cache_tokens(self) -> int:
        """Tokens the KV cache holds when full (every block)."""
        return self._stats.num_total_blocks * self.llm_engine.config.block_size

    def stats(self) -> EngineStats:
        """The snapshot taken after the last step (or add/abort); never touches the engine.

        num_waiting counts requests (not sequences) that have produced no output yet.
        """
        return dataclasses.replace(self._stats, num_waiting=self.num_queued_requests)

    async def kv_snapshot(self) -> KVCacheSnapshot:
        """The block pool and running sequences' block tables. The step loop takes it between two steps, on
        this thread, so neither a step nor an add or abort is half applied in it."""
        self._check_alive()
        waiter: asyncio.Future[KVCacheSnapshot] = asyncio.get_running_loop().create_future()
        self._snapshot_waiters.append(waiter)
        self._wake()
        return await waiter

    async def attention_weights(
        self,
        token_ids: list[int],
        sliding_window: int | None,
        num_sink_tokens: int,
        layer_windows: tuple[int | None, ...] | None = None,
    ) -> AttentionWeights:
        """Attention weights of a prompt by the reference path (LLMEngine.attention_weights), run on the
        torch worker between two steps: running requests wait for it, as for one prefill."""
        self._check_alive()
        assert self._worker is not None
        return await self._worker.run(
            self.llm_engine.attention_weights,
            token_ids,
            sliding_window,
            num_sink_tokens,
            layer_windows,
            kind=INSPECT_TURN,
        )

    async def submit(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> RequestStream:
        """Add a request; returns once the engine has accepted it.

        Raises InvalidRequestError / PromptTooLongError (bad input), QueueFullError,
        EngineDeadError, RequestTimeoutError.
        """
        self._check_alive()
        deadline = self.limits.admit(self.num_queued_requests, "generation")
        request_id = request_id or uuid.uuid4().hex
        request = self._requests.track(request_id, deadline)
        done = asyncio.get_running_loop().create_future()
        self._pending_adds.append(_PendingAdd(request, list(prompt_token_ids), params, done))
        self._wake()
        # Made now, so it keeps the deadline as admitted (the record drops it once the request finished).
        stream = RequestStream(request, functools.partial(self._release, request))
        try:
            await wait_until(asyncio.shield(done), deadline)
        except BaseException as exc:
            # Rejected by the engine: it never entered, nothing to abort. Timed out or
            # cancelled: drop the pending add, or abort the request if it was applied.
            was_rejected = done.done() and not done.cancelled() and done.exception() is not None
            if not done.done():
                done.cancel()
            self._release(request, abort=not was_rejected)
            if isinstance(exc, asyncio.TimeoutError):
                raise RequestTimeoutError(f"request {request_id} timed out before it was accepted") from None
            raise
        return stream

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Submit and yield each RequestOutput (deltas); stopping early aborts the request."""
        stream = await self.submit(prompt_token_ids, params, request_id)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    # ---- internals (event-loop thread only) ----
    def _check_alive(self) -> None:
        if self._dead_error is not None:
            raise EngineDeadError(f"the engine loop has died: {self._dead_error!r}")
        if not self.is_healthy:
            raise EngineDeadError("the engine is not running")

    def _wake(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()
        if self._chain is not None:  # what woke the loop must be applied before the next step
            self._chain.interrupt()

    def _release(self, request: TrackedRequest, abort: bool) -> None:
        """Forget a request its consumer is done with (or that timed out), and abort it in the engine if asked.

        One forgotten already needs no abort: the engine aborted or dropped it when it forgot it.
        """
        if self._requests.forget(request) and abort:
            self._pending_aborts.add(request.request_id)
            self._wake()

    async def _run_loop(self) -> None:
        assert self._wakeup is not None and self._worker is not None and self._chain is not None
        # The last step's core outputs: turned into text and handed out while the next step runs.
        undelivered: list[RequestOutput] | None = None
        try:
            while not self._is_stopping:
                self._expire_deadlines()
                self._apply_pending()
                self._take_snapshots()
                has_work = self.llm_engine.has_unfinished_requests()
                # Between steps the loop hands out text; the embedder must not take that pause for idleness.
                self._worker.want_turns(GENERATION_TURN, has_work)
                if not has_work:
                    if undelivered is not None:
                        self._hand_out(undelivered)
                        undelivered = None
                        continue  # a stop string found there may have left work to apply
                    self._wakeup.clear()
                    if self._pending_adds or self._pending_aborts or self._snapshot_waiters:
                        continue
                    idle_start = time.monotonic()
                    try:
                        async with asyncio.timeout(self._next_deadline_in()):
                            await self._wakeup.wait()
                    except TimeoutError:
                        pass
                    self._idle_since_failure += time.monotonic() - idle_start
                    continue
                # Queued before the last step's outputs are handed out, so that work is not on the steps' path;
                # the job runs on to more steps while nothing here needs applying (StepChain).
                step = self._chain.submit(self._requests.next_deadline())
                if undelivered is not None:
                    self._hand_out(undelivered)  # touches no engine state: safe while the step runs
                    undelivered = None
                try:
                    undelivered, stats = await step
                except EngineDeadError:
                    raise
                except Exception as exc:  # noqa: BLE001 - one failed step fails its requests, not the server
                    await self._handle_step_failure(exc)
                    continue
                self._count_step(stats)
                if not undelivered and self._stats.num_running == 0:
                    await asyncio.sleep(0.005)  # nothing could be scheduled: do not spin a core
            if undelivered is not None:
                self._hand_out(undelivered)
            self._apply_pending()
            self._abort_all_in_engine()
            self._take_snapshots()
        except BaseException as exc:
            logger.exception("engine loop died")
            self._dead_error = exc
            self._fail_everything(EngineDeadError(f"the engine loop has died: {exc!r}"))
            if isinstance(exc, asyncio.CancelledError):
                raise

    def _next_deadline_in(self) -> float | None:
        deadline = self._requests.next_deadline()
        if deadline is None:
            return None
        return max(deadline - time.monotonic(), 0.0) + 0.001

    def _expire_deadlines(self) -> None:
        """Abort every request past its deadline, read or not (the consumer gets RequestTimeoutError)."""
        for request in self._requests.past_deadline(time.monotonic()):
            request.queue.put_nowait(RequestTimeoutError(f"request {request.request_id} timed out and was aborted"))
            self._release(request, abort=True)

    def _apply_pending(self) -> None:
        # Aborts first: an abort must never hit a request added after it (same id reused).
        aborts, self._pending_aborts = self._pending_aborts, set()
        for request_id in aborts:
            self._abort_in_engine(request_id)
        stops, self._pending_stops = self._pending_stops, []
        for stop in stops:
            self.llm_engine.stop_sample(stop.request_id, stop.index, stop.stop_string)
        adds, self._pending_adds = self._pending_adds, []
        for add in adds:
            request = add.request
            if add.done.done() or not self._requests.is_current(request):
                # The caller left (or it timed out) before it was applied.
                self._requests.forget(request)
                if not add.done.done():
                    add.done.set_exception(RequestTimeoutError(f"request {request.request_id} was aborted"))
                continue
            try:
                self.llm_engine.add_request(add.prompt_token_ids, add.params, request.request_id)
            except Exception as exc:
                self._requests.forget(request)
                if not isinstance(exc, InvalidRequestError):
                    logger.exception("add_request failed for %s", request.request_id)
                add.done.set_exception(exc)
            else:
                request.text = self._output_processor.new_request_text(add.prompt_token_ids, add.params)
                add.done.set_result(None)
        if adds or aborts or stops:
            self._stats = self.llm_engine.stats()

    def _abort_in_engine(self, request_id: str) -> None:
        try:
            self.llm_engine.abort(request_id)
        except Exception:  # unknown or already finished: nothing to free
            logger.debug("abort of %s ignored", request_id, exc_info=True)

    def _abort_all_in_engine(self) -> None:
        for request in self._requests:
            self._abort_in_engine(request.request_id)

    def _hand_out(self, core_outputs: list[RequestOutput]) -> None:
        """One step's outputs, in step order: to their requests, counted for the chain."""
        assert self._chain is not None
        self._dispatch(core_outputs)
        self._chain.note_handed_out()

    def _deliver_chained(self, core_outputs: list[RequestOutput], stats: EngineStats) -> None:
        """A step that a job ran on past (StepChain), with the engine's stats after it: counted and handed out as
        the loop does the last step of every job."""
        self._count_step(stats)
        self._hand_out(core_outputs)

    def _count_step(self, stats: EngineStats) -> None:
        """A step has run; `stats`: the engine's, taken on the torch thread right after it."""
        self.num_steps += 1
        self._stats = stats
        self._note_step_success()

    def _dispatch(self, core_outputs: list[RequestOutput]) -> None:
        """Token ids -> text, then each output to its request's queue."""
        processed = self._output_processor.process(core_outputs, self._requests.text_of)
        if processed.stopped_samples and self._chain is not None:
            self._chain.interrupt()  # stopped in the engine before the step after next, as without chaining
        self._pending_stops.extend(processed.stopped_samples)
        for output in processed.request_outputs:
            request = self._requests.get(output.request_id)
            if request is None:
                continue
            if output.error is not None:
                request.queue.put_nowait(EngineStepError(output.error))  # the core already dropped it
                self._requests.forget(request)
            else:
                request.deliver(output)

    def _note_step_success(self) -> None:
        """A step that computed tokens ends a run of failures; one that only handed out notices does not."""
        computed = _tokens_computed(self._stats)
        if computed != self._num_tokens_computed:
            self._num_step_failures = 0
        self._num_tokens_computed = computed

    async def _handle_step_failure(self, exc: Exception) -> None:
        """A step raised: fail and abort the requests in the engine; die after too many in a row.

        The step raised because no request in it could be blamed alone (the runner re-runs a
        failed batch split by request), and a step of one request can never blame it. So the
        engine then probes the model on its own (`LLMEngine.probe`): if the probe computes, the
        failure was the requests' and does not count towards the dead-engine switch.
        """
        if self._idle_since_failure >= self.failure_reset_idle_s:
            self._num_step_failures = 0  # the last failure was followed by a quiet spell
        self._idle_since_failure = 0.0
        failed = [request for request in self._requests if request.is_accepted]  # pending adds were in no step
        for request in failed:
            self._abort_in_engine(request.request_id)
        try:
            await self._worker.run(self.llm_engine.probe, kind=GENERATION_TURN)
        except EngineDeadError:
            raise
        except Exception as probe_exc:  # noqa: BLE001 - the model fails on its own: this failure counts
            self._num_step_failures += 1
            logger.error(
                "engine step failed (%d in a row; a probe of the model alone failed too: %r)",
                self._num_step_failures,
                probe_exc,
                exc_info=exc,
            )
            if self._num_step_failures >= self.max_consecutive_step_failures:
                raise exc from None  # the loop dies: every request fails with EngineDeadError
        else:
            logger.error("engine step failed; the model computes alone, so its requests were failed", exc_info=exc)
        error = EngineStepError(f"internal error while generating: {exc!r}")
        for request in failed:
            if self._requests.forget(request):  # its consumer may have left during the probe
                request.queue.put_nowait(error)
        self._stats = self.llm_engine.stats()

    def _take_snapshots(self) -> None:
        if not self._snapshot_waiters:
            return
        waiters, self._snapshot_waiters = self._snapshot_waiters, []
        snapshot = self.llm_engine.kv_snapshot()
        for waiter in waiters:
            if not waiter.done():  # its caller may have gone
                waiter.set_result(snapshot)

    def _fail_everything(self, error: BaseException) -> None:
        for waiter in self._snapshot_waiters:
            if not waiter.done():
                waiter.set_exception(error)
        self._snapshot_waiters = []
        for add in self._pending_adds:
            if not add.done.done():
                add.done.set_exception(error)
        self._pending_adds = []
        for request in self._requests.forget_all():
            request.queue.put_nowait(error)


def _tokens_computed(stats: EngineStats) -> int:
    """Prompt and generated tokens the engine has computed, ever: it grows with every step that computes."""
    return stats.num_computed_prompt_tokens + stats.num_generation_tokens
