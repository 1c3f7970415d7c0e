"""AsyncEngine: one owner of the LLMEngine, per-request queues, aborts, backpressure, failure handling.

Most tests drive a small scripted engine (`ScriptedEngine`) that records any call made
while a step runs in the worker thread; one test runs the real LLMEngine on a tiny model
and checks the async path gives the same tokens as the offline `generate()`.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from engine.errors import (
    EngineDeadError,
    EngineStepError,
    InvalidRequestError,
    PromptTooLongError,
    QueueFullError,
    RequestTimeoutError,
)
from engine.outputs import CompletionOutput, EngineStats, RequestOutput
from engine.params import SamplingParams
from engine.serving.async_engine import AsyncEngine
from engine.serving.torch_worker import GENERATION_TURN, RequestLimits, TorchWorker, wait_until


class ScriptedEngine:
    """Each running request emits token (last + 1) % 50 per step; blocks = 1 per running request.

    `calls_during_step` counts add/abort/stats calls that overlapped a step (must stay 0).
    """

    model_name = "scripted"
    max_model_len = 64

    def __init__(self, step_delay: float = 0.0, max_num_seqs: int = 8, fail_steps: int = 0) -> None:
        self.burst_flags: list[bool] = []  # end_bursts_early's calls, in order
        self.step_delay = step_delay
        self.max_num_seqs = max_num_seqs
        self.fail_steps = fail_steps  # the next `fail_steps` steps raise
        self.model_fails_alone = True  # probe() raises too: a failed step is the model's, and counts
        self.num_probes = 0
        self.requests: dict[str, dict] = {}
        self.pending: list[RequestOutput] = []
        self.num_aborts = 0
        self.num_stops = 0
        self.num_generated_tokens = 0
        self.calls_during_step = 0
        self._in_step = threading.Event()

    def _check(self) -> None:
        if self._in_step.is_set():
            self.calls_during_step += 1

    def add_request(self, prompt, params: SamplingParams, request_id: str | None = None) -> str:
        self._check()
        ids = [ord(c) % 50 for c in prompt] if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise InvalidRequestError("the prompt is empty", "prompt")
        if len(ids) + (params.max_tokens or 0) > self.max_model_len:
            raise PromptTooLongError(f"{len(ids)} + {params.max_tokens} > {self.max_model_len}", "max_tokens")
        self.requests[request_id] = {"ids": ids, "params": params, "out": [], "running": False}
        return request_id

    def abort(self, request_id: str) -> None:
        self._check()
        request = self.requests.pop(request_id, None)
        if request is not None:
            self.num_aborts += 1
            done = CompletionOutput(0, "", [], None, finish_reason="abort")
            self.pending.append(RequestOutput(request_id, [done], request["ids"], True))

    def stop_sample(self, request_id: str, index: int, stop_reason: str) -> None:
        self._check()
        if self.requests.pop(request_id, None) is not None:
            self.num_stops += 1

    def end_bursts_early(self, on: bool) -> None:
        self.burst_flags.append(on)  # the one call allowed from the event loop while a step runs

    def has_unfinished_requests(self) -> bool:
        self._check()
        return bool(self.requests or self.pending)

    def step(self) -> list[RequestOutput]:
        self._in_step.set()
        try:
            time.sleep(self.step_delay)
            if self.fail_steps > 0:
                self.fail_steps -= 1
                raise RuntimeError("scripted step failure")
            outputs, self.pending = self.pending, []
            for request_id in list(self.requests)[: self.max_num_seqs]:
                request = self.requests[request_id]
                request["running"] = True
                last = (request["out"] or request["ids"])[-1]
                token = (last + 1) % 50
                request["out"].append(token)
                self.num_generated_tokens += 1
                finished = len(request["out"]) >= request["params"].max_tokens
                completion = CompletionOutput(
                    0,
                    "",
                    [token],
                    None,
                    finish_reason="length" if finished else None,
                    num_generated_tokens=len(request["out"]),
                )
                outputs.append(RequestOutput(request_id, [completion], request["ids"], finished))
                if finished:
                    del self.requests[request_id]
            return outputs
        finally:
            self._in_step.clear()

    def probe(self) -> None:
        self.num_probes += 1
        if self.model_fails_alone:
            raise RuntimeError("scripted model failure")

    def stats(self) -> EngineStats:
        self._check()
        running = sum(r["running"] for r in self.requests.values())
        return EngineStats(running, len(self.requests) - running, running, 16, 0, 0, 0, 0, self.num_generated_tokens)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


async def _collect(engine: AsyncEngine, prompt, max_tokens: int, request_id: str | None = None) -> list[int]:
    tokens = []
    async for output in engine.generate(prompt, SamplingParams(max_tokens=max_tokens), request_id):
        tokens.extend(output.outputs[0].token_ids)
    return tokens


class ScriptedTokenizer:
    """Token t reads "<t>": the output processor's text deltas show exactly which tokens arrived."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(f"<{t}>" for t in token_ids)


async def _started(
    engine: ScriptedEngine, max_queued_requests: int = 256, request_timeout: float | None = None, **kwargs
) -> AsyncEngine:
    limits = RequestLimits(max_queued_requests, request_timeout)
    async_engine = AsyncEngine(engine, ScriptedTokenizer(), limits=limits, **kwargs)
    await async_engine.start()
    return async_engine


def test_generate_streams_until_finished():
    async def main():
        engine = await _started(ScriptedEngine())
        tokens = await _collect(engine, [3], max_tokens=5)
        await engine.stop()
        return tokens

    assert run(main()) == [4, 5, 6, 7, 8]


def test_concurrent_requests_never_touch_the_engine_during_a_step():
    scripted = ScriptedEngine(step_delay=0.005, max_num_seqs=4)

    async def main():
        engine = await _started(scripted)
        results = await asyncio.gather(*(_collect(engine, [i], max_tokens=6) for i in range(12)))
        # Early leavers too: aborts are queued while steps run.
        for _ in range(4):
            stream = await engine.submit([1], SamplingParams(max_tokens=30))
            await stream.__anext__()
            stream.close()
        await asyncio.sleep(0.05)
        await engine.stop()
        return results

    results = run(main())
    assert results == [[(i + k) % 50 for k in range(1, 7)] for i in range(12)]
    assert scripted.calls_during_step == 0
    assert scripted.num_aborts == 4


def test_validation_errors_reach_the_caller():
    async def main():
        engine = await _started(ScriptedEngine())
        with pytest.raises(InvalidRequestError, match="empty"):
            await engine.submit([], SamplingParams(max_tokens=2))
        with pytest.raises(PromptTooLongError):
            await engine.submit([1] * 60, SamplingParams(max_tokens=10))
        assert engine.num_active_requests == 0
        assert await _collect(engine, [1], max_tokens=2) == [2, 3]  # still serving
        await engine.stop()

    run(main())


def test_cancelled_consumer_aborts_within_one_step():
    scripted = ScriptedEngine(step_delay=0.01)

    async def main():
        engine = await _started(scripted)
        started = asyncio.Event()

        async def consume():
            async for _ in engine.generate([1], SamplingParams(max_tokens=60 - 1)):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        assert engine.stats().num_used_blocks == 1
        steps_before = engine.num_steps
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        while engine.stats().num_used_blocks:
            await asyncio.sleep(0.001)
        assert engine.num_steps - steps_before <= 1
        assert scripted.requests == {}
        await engine.stop()

    run(main())


@pytest.mark.parametrize("yields_between", [0, 1, 2, 3])
def test_a_cancel_that_meets_an_arriving_output_is_never_swallowed(yields_between):
    """A client leaving just as its stream's next output arrives must still stop the reader.

    Python's `asyncio.wait_for` returns the awaited result when the cancel and the result
    meet, leaving the task cancelled in name but running: the request then ran on to its end.
    """

    async def main() -> None:
        queue: asyncio.Queue[str] = asyncio.Queue()
        reader = asyncio.create_task(wait_until(queue.get(), time.monotonic() + 60))
        await asyncio.sleep(0)  # the reader waits on the queue
        queue.put_nowait("output")
        for _ in range(yields_between):
            await asyncio.sleep(0)
        if reader.cancel():  # accepted: the reader must end cancelled
            with pytest.raises(asyncio.CancelledError):
                await reader
        else:  # it had already returned
            assert reader.result() == "output"

    asyncio.run(main())


def test_breaking_out_of_generate_aborts():
    scripted = ScriptedEngine(step_delay=0.002)

    async def main():
        engine = await _started(scripted)
        stream = engine.generate([1], SamplingParams(max_tokens=50))
        async for _ in stream:
            break
        await stream.aclose()
        for _ in range(100):
            if not scripted.requests:
                break
            await asyncio.sleep(0.005)
        await engine.stop()

    run(main())
    assert scripted.requests == {} and scripted.num_aborts == 1


def test_queue_full_is_immediate_and_bounded():
    scripted = ScriptedEngine(step_delay=0.005, max_num_seqs=1)

    async def main():
        engine = await _started(scripted, max_queued_requests=1)
        running = await engine.submit([1], SamplingParams(max_tokens=40))
        await running.__anext__()  # running now
        waiting = await engine.submit([2], SamplingParams(max_tokens=3))
        with pytest.raises(QueueFullError):
            await engine.submit([3], SamplingParams(max_tokens=3))
        running.close()
        assert [o.outputs[0].token_ids for o in [o async for o in waiting]] == [[3], [4], [5]]
        assert await _collect(engine, [3], max_tokens=1) == [4]  # room again
        await engine.stop()

    run(main())


def test_request_timeout_aborts():
    scripted = ScriptedEngine(step_delay=0.01)

    async def main():
        engine = await _started(scripted, request_timeout=0.1)
        with pytest.raises(RequestTimeoutError):
            await _collect(engine, [1], max_tokens=60 - 1)
        for _ in range(100):
            if not scripted.requests:
                break
            await asyncio.sleep(0.005)
        assert engine.is_healthy
        await engine.stop()

    run(main())
    assert scripted.requests == {}


def test_failed_step_fails_its_requests_and_the_engine_keeps_serving():
    scripted = ScriptedEngine(fail_steps=1)

    async def main():
        engine = await _started(scripted)
        with pytest.raises(EngineStepError):
            await _collect(engine, [1], max_tokens=3)
        assert engine.is_healthy
        assert await _collect(engine, [1], max_tokens=3) == [2, 3, 4]
        await engine.stop()

    run(main())


def test_dead_loop_fails_everyone_and_reports_unhealthy():
    scripted = ScriptedEngine(fail_steps=1000)

    async def main():
        engine = await _started(scripted, max_consecutive_step_failures=2)
        results = await asyncio.gather(*(_collect(engine, [i], max_tokens=3) for i in range(3)), return_exceptions=True)
        assert all(isinstance(r, (EngineStepError, EngineDeadError)) for r in results), results
        for _ in range(100):
            if not engine.is_healthy:
                break
            await asyncio.sleep(0.01)
        assert not engine.is_healthy
        with pytest.raises(EngineDeadError):
            await engine.submit([1], SamplingParams(max_tokens=2))
        await engine.stop()

    run(main())


def test_stop_fails_outstanding_requests():
    async def main():
        engine = await _started(ScriptedEngine(step_delay=0.01))
        task = asyncio.create_task(_collect(engine, [1], max_tokens=60 - 1))
        await asyncio.sleep(0.05)
        await engine.stop()
        with pytest.raises(EngineDeadError):
            await task
        assert not engine.is_healthy

    run(main())


async def _until(predicate, timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


def test_unread_stream_is_aborted_at_its_deadline():
    """The loop enforces deadlines itself: a request nobody reads does not run to max_tokens."""
    scripted = ScriptedEngine(step_delay=0.005)

    async def main():
        engine = await _started(scripted, request_timeout=0.1)
        stream = await engine.submit([1], SamplingParams(max_tokens=60 - 1))  # never iterated
        await _until(lambda: not scripted.requests and engine.num_active_requests == 0, timeout=1.0)
        with pytest.raises(RequestTimeoutError):
            await stream.__anext__()
        assert engine.is_healthy
        await engine.stop()

    run(main())
    assert scripted.num_aborts == 1


def test_abort_of_an_old_request_never_hits_a_new_one_with_the_same_id():
    scripted = ScriptedEngine(step_delay=0.05)

    async def main():
        engine = await _started(scripted)
        old = await engine.submit([1], SamplingParams(max_tokens=40), request_id="same")
        old.close()  # its abort is pending while the loop is inside a step
        new = await engine.submit([5], SamplingParams(max_tokens=40), request_id="same")
        # Both were applied in one loop turn: the old abort first, then the new add.
        assert scripted.requests["same"]["ids"] == [5]
        new.close()
        await engine.stop()

    run(main())


class RequestFailingEngine(ScriptedEngine):
    """Fails one request alone when told to, as the core does when computing that request raised."""

    fail_request_id: str | None = None

    def step(self) -> list[RequestOutput]:
        outputs = super().step()
        request_id, self.fail_request_id = self.fail_request_id, None
        if request_id is not None and self.requests.pop(request_id, None) is not None:
            outputs = [o for o in outputs if o.request_id != request_id]
            outputs.append(RequestOutput(request_id, [], [], True, error="scripted request failure"))
        return outputs


def test_an_old_stream_closing_late_never_touches_a_new_request_with_the_same_id():
    """The engine forgot the old request (it failed), its id was reused, then its stream read the error."""
    scripted = RequestFailingEngine(step_delay=0.005)

    async def main():
        engine = await _started(scripted)
        old = await engine.submit([1], SamplingParams(max_tokens=40), request_id="same")
        scripted.fail_request_id = "same"
        await _until(lambda: engine.num_active_requests == 0)  # failed and forgotten; its stream is unread
        new = await engine.submit([5], SamplingParams(max_tokens=3), request_id="same")
        with pytest.raises(EngineStepError):
            async for _ in old:  # ends on the error, then closes the old stream
                pass
        assert engine.num_active_requests == 1
        async with asyncio.timeout(2):
            tokens = [t async for output in new for t in output.outputs[0].token_ids]
        assert tokens == [6, 7, 8]
        await engine.stop()

    run(main())
    assert scripted.num_aborts == 0


class SeqCountingEngine(ScriptedEngine):
    """Like the real scheduler: num_waiting counts sequences (n per request)."""

    def stats(self) -> EngineStats:
        self._check()
        running = sum(r["running"] for r in self.requests.values())
        waiting = sum(r["params"].n for r in self.requests.values() if not r["running"])
        return EngineStats(running, waiting, running, 16, 0, 0, 0, 0, 0)


def test_queue_limit_counts_requests_not_sequences():
    scripted = SeqCountingEngine(step_delay=0.005, max_num_seqs=1)

    async def main():
        engine = await _started(scripted, max_queued_requests=2)
        running = await engine.submit([1], SamplingParams(max_tokens=40))
        await running.__anext__()
        wide = await engine.submit([2], SamplingParams(max_tokens=3, n=8))  # one request, 8 sequences
        await asyncio.sleep(0.02)  # a few steps: the scheduler reports 8 waiting sequences
        assert engine.stats().num_waiting == 1
        second = await engine.submit([3], SamplingParams(max_tokens=3))  # room for a second request
        with pytest.raises(QueueFullError):
            await engine.submit([4], SamplingParams(max_tokens=3))
        for stream in (running, wide, second):
            stream.close()
        await engine.stop()

    run(main())


def test_isolated_step_failures_with_idle_between_do_not_kill_the_engine():
    scripted = ScriptedEngine()

    async def main():
        engine = await _started(scripted, max_consecutive_step_failures=2, failure_reset_idle_s=0.05)
        for _ in range(3):
            scripted.fail_steps = 1
            with pytest.raises(EngineStepError):
                await _collect(engine, [1], max_tokens=3)
            await asyncio.sleep(0.1)  # idle
        assert engine.is_healthy
        assert await _collect(engine, [1], max_tokens=3) == [2, 3, 4]
        await engine.stop()

    run(main())


def test_a_step_that_computes_tokens_ends_a_run_of_failures():
    scripted = ScriptedEngine()

    async def main():
        engine = await _started(scripted, max_consecutive_step_failures=2)
        for _ in range(3):
            scripted.fail_steps = 1
            with pytest.raises(EngineStepError):
                await _collect(engine, [1], max_tokens=3)
            assert await _collect(engine, [1], max_tokens=3) == [2, 3, 4]
        assert engine.is_healthy
        await engine.stop()

    run(main())


def test_failures_with_only_abort_notices_between_them_add_up():
    """A step that hands out the failed requests' abort notices computes nothing: it is no success."""
    scripted = ScriptedEngine()

    async def main():
        engine = await _started(scripted, max_consecutive_step_failures=2)
        scripted.fail_steps = 1
        with pytest.raises(EngineStepError):
            await _collect(engine, [1], max_tokens=3)
        await _until(lambda: not scripted.pending)  # the notice step ran and succeeded
        scripted.fail_steps = 1
        with pytest.raises((EngineStepError, EngineDeadError)):
            await _collect(engine, [1], max_tokens=3)
        await _until(lambda: not engine.is_healthy)
        await engine.stop()

    run(main())


def test_failures_the_model_does_not_make_alone_never_kill_the_engine():
    """Steps of one request each, failing one after the other: a probe of the model alone computes,
    so the requests are failed and the engine lives on. Before, three such requests in a row
    killed it (a request that fails on its own is a denial of service otherwise)."""
    scripted = ScriptedEngine()
    scripted.model_fails_alone = False

    async def main():
        engine = await _started(scripted, max_consecutive_step_failures=2)
        for _ in range(5):
            await _until(lambda: not scripted.pending)  # the last failure's abort notice went out
            scripted.fail_steps = 1
            with pytest.raises(EngineStepError):
                await _collect(engine, [1], max_tokens=3)
        assert engine.is_healthy
        assert await _collect(engine, [1], max_tokens=3) == [2, 3, 4]
        await engine.stop()

    run(main())
    assert scripted.num_probes == 5


@pytest.mark.slow
def test_real_engine_matches_offline_generate(tmp_path):
    from engine.config import EngineConfig
    from engine.llm import LLM
    from tests.support.tiny_models import make_tiny_llama

    model_dir = make_tiny_llama(tmp_path / "tiny")
    llm = LLM.from_config(EngineConfig(model=str(model_dir), max_model_len=128, kv_cache_memory_bytes=8 << 20))
    prompts = [llm.tokenizer.encode(text) for text in ("Hello world", "The quick brown fox", "paged KV cache")]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = [results[0].token_ids for results in llm.generate(prompts, params)]

    async def main():
        engine = AsyncEngine(llm.engine, llm.tokenizer)
        await engine.start()

        async def one(prompt):
            tokens = []
            async for output in engine.generate(prompt, params):
                tokens.extend(output.outputs[0].token_ids)
            return tokens

        got = await asyncio.gather(*(one(p) for p in prompts))
        stats = engine.stats()
        await engine.stop()
        return got, stats

    got, stats = run(main())
    assert got == expected
    assert stats.num_running == 0 and stats.num_waiting == 0


def test_text_deltas_and_a_stop_string_stop_the_sample_in_the_engine():
    """Text is made on the async side; a stop string there finishes the sample and stops it in the engine."""
    scripted = ScriptedEngine(step_delay=0.005)

    async def main():
        engine = await _started(scripted)
        outputs = [o async for o in engine.generate([1], SamplingParams(max_tokens=30, stop=["<5>"]))]
        await _until(lambda: not scripted.requests)
        await engine.stop()
        return outputs

    outputs = run(main())
    completions = [c for o in outputs for c in o.outputs]
    assert "".join(c.text for c in completions) == "<2><3><4>"
    assert completions[-1].finish_reason == "stop" and completions[-1].stop_reason == "<5>"
    assert outputs[-1].finished
    assert scripted.num_stops == 1 and scripted.num_aborts == 0


def test_the_next_step_runs_while_the_last_ones_outputs_are_turned_into_text():
    """The step is queued before the loop hands out the last step's outputs, so text work is off its path."""
    scripted = ScriptedEngine(step_delay=0.02)
    step_seen_running: list[bool] = []

    class WatchingTokenizer(ScriptedTokenizer):
        def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
            step_seen_running.append(scripted._in_step.wait(0.2))
            return super().decode(token_ids, skip_special_tokens)

    async def main():
        engine = AsyncEngine(scripted, WatchingTokenizer(), limits=RequestLimits(256, None))
        await engine.start()
        tokens = await _collect(engine, [3], max_tokens=4)
        await engine.stop()
        return tokens

    assert run(main()) == [4, 5, 6, 7]
    assert step_seen_running and step_seen_running[0]  # the first token's text: the second step was running


class CountingWorker(TorchWorker):
    """Counts the generation jobs its clients queue."""

    def __init__(self) -> None:
        super().__init__("counting")
        self.generation_jobs = 0

    def submit(self, fn, *args, kind: str = "other"):
        self.generation_jobs += kind == GENERATION_TURN
        return super().submit(fn, *args, kind=kind)


def test_steps_run_on_in_one_job_while_the_loop_has_nothing_to_apply():
    scripted = ScriptedEngine(step_delay=0.01)

    async def main():
        worker = CountingWorker()
        engine = AsyncEngine(scripted, ScriptedTokenizer(), limits=RequestLimits(256, None))
        await engine.start(worker)
        tokens = await _collect(engine, [3], max_tokens=12)
        await engine.stop()
        await worker.stop()
        return tokens, worker.generation_jobs, engine.num_steps

    tokens, jobs, steps = run(main())
    assert tokens == [(3 + k) % 50 for k in range(1, 13)]
    assert steps == 12 and jobs <= steps // 2  # each job ran several steps: no round trip through the loop
    assert scripted.calls_during_step == 0


def test_a_request_arriving_mid_job_ends_a_burst_and_the_next_job_lets_bursts_run():
    """The flag a greedy burst reads between its steps: set when the loop has something to apply while a job
    runs (here a second request), cleared as each job is queued."""
    scripted = ScriptedEngine(step_delay=0.01)

    async def main():
        engine = AsyncEngine(scripted, ScriptedTokenizer(), limits=RequestLimits(256, None))
        await engine.start(CountingWorker())
        first = asyncio.create_task(_collect(engine, [3], max_tokens=20))
        while engine.num_steps < 3:
            await asyncio.sleep(0.005)
        await _collect(engine, [4], max_tokens=2)
        await first
        await engine.stop()

    run(main())
    flags = scripted.burst_flags
    # A job queued (False), the second request arriving while it ran (True), the job after it (False).
    assert any(flags[i : i + 3] == [False, True, False] for i in range(len(flags) - 2)), flags


def test_a_job_running_on_gives_the_worker_up_to_another_models_step():
    """Two models on one worker: the first's job ends its run of steps once the second's step is queued."""
    first, second = ScriptedEngine(step_delay=0.005), ScriptedEngine(step_delay=0.005)

    async def main():
        worker = TorchWorker("shared")
        engines = [AsyncEngine(e, ScriptedTokenizer(), limits=RequestLimits(256, None)) for e in (first, second)]
        for engine in engines:
            await engine.start(worker)
        finished: list[str] = []

        async def stream(engine: AsyncEngine, name: str, max_tokens: int, started: asyncio.Event | None) -> None:
            async for _ in engine.generate([1], SamplingParams(max_tokens=max_tokens)):
                if started is not None:
                    started.set()
            finished.append(name)

        started = asyncio.Event()
        long = asyncio.create_task(stream(engines[0], "long", 40, started))
        await started.wait()
        await stream(engines[1], "short", 4, None)
        await long
        for engine in engines:
            await engine.stop()
        await worker.stop()
        return finished

    assert run(main()) == ["short", "long"]
