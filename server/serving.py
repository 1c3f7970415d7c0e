"""The one owner of a request's life, from the engine submit to the last byte sent.

Routes validate the body and map its fields onto engine parameters; everything that can
leak lives here. This module alone:

- submits a generation's fan-out (every prompt; its n samples ride in one engine request)
  and, if one is refused or the submit is cancelled, aborts the others;
- merges the engine streams into one sequence of (prompt index, output), counting usage
  and observing latencies on the way;
- races a JSON answer (generation or embeddings) against the client leaving: the work is
  cancelled, which aborts its engine requests or drops its queued embedding inputs, and the
  answer is a bare 499;
- frames SSE: the chunks, the usage chunk when `stream_options.include_usage` asks, then
  `[DONE]`; an engine error becomes an error event (the JSON error body) then `[DONE]` (the
  Responses API's framing instead names each event and turns an error into its own events);
- names the failure of a request the server's stop cut (server/shutdown.py): the engine or
  embedder stopped under it, and the answer is 503 `shutting_down`, not `engine_dead`;
- closes every engine stream however the answer ends.

The last is one mechanism. A `Generation` owns the streams of one HTTP request (and the tasks
merging them); the `_Answer` response that carries it closes it in the `finally` of its
`__call__`, which Starlette awaits exactly once for every response a route returns. So no
path depends on a generator's `finally` or the garbage collector: not a task cancelled
before it ever ran, not a streamed body that Starlette cancelled before it started (the
client left while the head was sent), not a send that raised.
"""

from __future__ import annotations

import asyncio
import functools
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from engine import AsyncEngine, RequestStream
from engine.errors import EngineDeadError, KVServeError
from engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from engine.params import SamplingParams
from server.errors import APIError, api_error_for
from server.http.json_answer import json_response
from server.metrics.server_metrics import RequestTimer, TokenCounts
from server.protocol.common import StreamOptions, Usage
from server.shutdown import is_stopping, shutting_down_error

CLIENT_CLOSED_REQUEST = 499  # nginx's code: the client left before the answer
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # NDJSON streams' too
NDJSON = "application/x-ndjson"

T = TypeVar("T")
SendAnswer = Callable[[Scope, Receive, Send], Awaitable[None]]


def response_id(request: Request, prefix: str) -> str:
    """The id of an answer body: "cmpl-<X-Request-Id>" (the middleware made or echoed that id)."""
    return f"{prefix}-{request.state.request_id}"


# ---- what a generation adds up to ----


@dataclass
class Sample:
    """One choice, whole: its deltas joined."""

    text_parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    def add(self, delta: CompletionOutput) -> None:
        self.text_parts.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.stop_reason = delta.stop_reason

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


class Generation:
    """The engine requests of one HTTP request (one per prompt), from submit until `close()`.

    Choice i of the answer is sample i % n of prompt i // n. `close()` aborts every request
    that has not finished and stops the merge; only the `_Answer` carrying it calls it.
    """

    def __init__(self, streams: list[RequestStream], n: int, timer: RequestTimer) -> None:
        self._streams = streams
        self._n = n
        self._timer = timer
        self._tokens = TokenCounts()  # the usage, and the per-request token histograms at the end
        self._finish_reasons: dict[int, str] = {}  # choice index -> why it ended
        self._prompt_logprobs: dict[int, list[TokenLogprob | None]] = {}  # prompt index -> its scored tokens
        self._pumps: list[asyncio.Task] = []

    @property
    def first_token_time(self) -> float | None:
        """When the answer's first token arrived (time.monotonic()); None before it."""
        return self._timer.first_token_time

    @property
    def num_choices(self) -> int:
        return len(self._streams) * self._n

    def choice_index(self, prompt_index: int, delta: CompletionOutput) -> int:
        return prompt_index * self._n + delta.index

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output delta) from every stream as they arrive; raises an engine error."""
        async for prompt_index, output in self._merged():
            self._timer.on_output(output)
            self._tokens.add(prompt_index, output)
            if output.prompt_logprobs is not None:
                self._prompt_logprobs[prompt_index] = output.prompt_logprobs
            for delta in output.outputs:
                if delta.finish_reason is not None:
                    self._finish_reasons[self.choice_index(prompt_index, delta)] = delta.finish_reason
            yield prompt_index, output

    async def samples(self) -> list[Sample]:
        """Every choice, whole, in choice order (reads the streams to their end)."""
        samples = [Sample() for _ in range(self.num_choices)]
        async for prompt_index, output in self.outputs():
            for delta in output.outputs:
                samples[self.choice_index(prompt_index, delta)].add(delta)
        return samples

    def prompt_logprobs(self, prompt_index: int) -> list[TokenLogprob | None] | None:
        """The prompt's scored tokens (when the request asked), once its first output has arrived."""
        return self._prompt_logprobs.get(prompt_index)

    def usage(self) -> Usage:
        """Tokens so far: the prompts, and every sample's completion."""
        prompt, completion = self._tokens.num_prompt_tokens, self._tokens.num_generated_tokens
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    def record_finish(self) -> None:
        """Observe the end-to-end latency and the first choice's finish reason ("abort" if none finished)."""
        reasons = self._finish_reasons
        self._timer.finish(reasons[min(reasons)] if reasons else "abort", self._tokens)

    def close(self) -> None:
        for pump in self._pumps:
            pump.cancel()
        for stream in self._streams:
            stream.close()

    async def _merged(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        if len(self._streams) == 1:
            async for output in self._streams[0]:
                yield 0, output
            return
        queue: asyncio.Queue[tuple[int, RequestOutput | Exception | None]] = asyncio.Queue()
        self._pumps = [asyncio.create_task(_pump(i, stream, queue)) for i, stream in enumerate(self._streams)]
        remaining = len(self._streams)
        while remaining:
            prompt_index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield prompt_index, item


async def _pump(prompt_index: int, stream: RequestStream, queue: asyncio.Queue) -> None:
    try:
        async for output in stream:
            queue.put_nowait((prompt_index, output))
        queue.put_nowait((prompt_index, None))
    except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
        queue.put_nowait((prompt_index, exc))


async def _submit(
    engine: AsyncEngine, prompts: Sequence[list[int]], params: SamplingParams, timer: RequestTimer
) -> Generation:
    """Submit every prompt together; if any is refused, abort the others and raise its error.

    Engine request ids are made here (unique), never taken from the client's X-Request-Id:
    a retry with the same header must not collide with, or be aborted as, the old request.
    """
    timer.on_submit(params)
    submits = [asyncio.ensure_future(engine.submit(ids, params, uuid.uuid4().hex)) for ids in prompts]
    try:
        await asyncio.wait(submits)  # each ends on its own: accepted, refused or timed out
    except BaseException:  # cancelled: the handler is being torn down
        _withdraw(submits)
        raise
    errors = [s.exception() for s in submits if s.exception() is not None]
    if errors:
        _withdraw(submits)
        raise errors[0]
    return Generation([s.result() for s in submits], params.n, timer)


def _withdraw(submits: list[asyncio.Future]) -> None:
    """Abort every request these submits made or are still making, whenever each one ends."""

    def close_if_accepted(submit: asyncio.Future) -> None:
        if not submit.cancelled() and submit.exception() is None:
            submit.result().close()

    for submit in submits:
        submit.cancel()  # a submit cancelled mid-way withdraws its own request; a done one ignores this
        submit.add_done_callback(close_if_accepted)


# ---- the answers ----


@dataclass(frozen=True)
class SseFraming:
    """How a stream's events go on the wire. Completions and chat: `data: <json>` each, a failure as
    the error body, then `data: [DONE]`. The Responses and Messages APIs name each event after its
    "type" (an `event: <type>` line first), make a failure their own events, and send no [DONE].
    Ollama's API sends newline-delimited JSON instead of SSE (`ndjson`): one object a line."""

    named: bool = False
    ndjson: bool = False
    done: bool = True
    failure: Callable[[APIError], list[dict]] | None = None  # None: the error body, as one event
    keeps_usage: bool = False  # the events' own "usage" keys are theirs (Anthropic's), not stream_options'


DATA_EVENTS = SseFraming()


class _Answer(Response):
    """An answer produced while it is sent; it owns `generation` (if any) and closes it however it ends."""

    def __init__(self, send_answer: SendAnswer, generation: Generation | None = None) -> None:
        super().__init__()
        self._send_answer = send_answer
        self._generation = generation

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self._send_answer(scope, receive, send)
        finally:
            if self._generation is not None:
                self._generation.close()


async def generation_json(
    engine: AsyncEngine,
    prompts: Sequence[list[int]],
    params: SamplingParams,
    timer: RequestTimer,
    body: Callable[[Generation], Awaitable[Any]],
) -> Response:
    """Submit, then answer `await body(generation)` (JSON-able; it reads the outputs) as JSON.

    The client leaving first aborts the requests (499); an engine error raised while reading
    reaches the app's error handlers (nothing was sent yet).
    """
    generation = await _submit(engine, prompts, params, timer)
    return _Answer(_json_sender(lambda: body(generation), generation), generation)


async def generation_stream(
    engine: AsyncEngine,
    prompts: Sequence[list[int]],
    params: SamplingParams,
    timer: RequestTimer,
    chunks: Callable[[Generation], AsyncIterator[dict]],
    usage_chunk: Callable[[Usage], dict],
    stream_options: StreamOptions | None,
    framing: SseFraming = DATA_EVENTS,
) -> Response:
    """Submit, then answer SSE: each of `chunks(generation)` (dicts; their "usage" key is set or
    dropped here, as `stream_options` asks), the `usage_chunk(usage)` if asked, then `[DONE]`
    (each as `framing` writes it)."""
    generation = await _submit(engine, prompts, params, timer)
    include_usage = stream_options is not None and stream_options.include_usage
    continuous_usage = include_usage and stream_options is not None and stream_options.continuous_usage_stats

    def encode(payload: dict) -> str:
        return json.dumps(payload, ensure_ascii=False) + "\n" if framing.ndjson else _sse(payload, framing.named)

    async def events(scope: Scope) -> AsyncIterator[str]:
        try:
            async for payload in chunks(generation):
                if include_usage:
                    payload["usage"] = generation.usage().model_dump() if continuous_usage else None
                elif not framing.keeps_usage:
                    payload.pop("usage", None)
                yield encode(payload)
            generation.record_finish()
            usage = generation.usage()
            _record_usage(scope, usage)
            if include_usage:
                yield _sse(usage_chunk(usage))
            if framing.done:
                yield _sse("[DONE]")
        except KVServeError as exc:
            error = _error_for(exc, scope)
            for payload in framing.failure(error) if framing.failure is not None else [error.to_body()]:
                yield encode(payload)
            if framing.done:
                yield _sse("[DONE]")

    async def send_events(scope: Scope, receive: Receive, send: Send) -> None:
        media_type = NDJSON if framing.ndjson else "text/event-stream"
        response = StreamingResponse(events(scope), media_type=media_type, headers=SSE_HEADERS)
        await response(scope, receive, send)

    return _Answer(send_events, generation)


async def named_event_stream(
    engine: AsyncEngine,
    prompt_ids: list[int],
    params: SamplingParams,
    timer: RequestTimer,
    events: Callable[[Generation], AsyncIterator[dict]],
    failure: Callable[[APIError], list[dict]],
) -> Response:
    """The Responses and Messages streams: one prompt's `events`, each named after its type, a failure as
    `failure`'s events, no [DONE]. Their usage is in their own events, never a chunk of its own."""
    framing = SseFraming(named=True, done=False, failure=failure, keeps_usage=True)
    return await generation_stream(engine, [prompt_ids], params, timer, events, _no_usage_chunk, None, framing)


async def ndjson_stream(
    engine: AsyncEngine,
    prompt_ids: list[int],
    params: SamplingParams,
    timer: RequestTimer,
    lines: Callable[[Generation], AsyncIterator[dict]],
    failure: Callable[[APIError], list[dict]],
) -> Response:
    """Ollama's streams: one prompt's `lines`, one JSON object a line, a failure as `failure`'s lines."""
    framing = SseFraming(ndjson=True, done=False, failure=failure, keeps_usage=True)
    return await generation_stream(engine, [prompt_ids], params, timer, lines, _no_usage_chunk, None, framing)


def _no_usage_chunk(usage: Usage) -> dict:
    raise AssertionError("a named-event stream sends no usage chunk")


def abandoned_when_client_leaves(handler: Callable[..., Awaitable[Response]]) -> Callable[..., Awaitable[Response]]:
    """A generation route whose work before the answer (rendering the prompt, compiling a grammar, the
    submit) is cancelled when the client leaves meanwhile, with a bare 499; the route takes `request`.

    The answer itself races the client from its start (`generation_json`, `generation_stream`); this
    covers the seconds before it, which a long prompt or a new grammar can take.
    """

    @functools.wraps(handler)
    async def handle(*args: Any, **kwargs: Any) -> Response:
        request: Request = kwargs["request"]
        try:
            return await _unless_client_leaves(handler(*args, **kwargs), request.receive)
        except _ClientGone:
            return Response(status_code=CLIENT_CLOSED_REQUEST)

    return handle


def raced_json(work: Callable[[], Awaitable[Any]]) -> Response:
    """Answer `await work()` (JSON-able) as JSON; if the client leaves first, cancel it and answer 499."""
    return _Answer(_json_sender(work, None))


def _json_sender(work: Callable[[], Awaitable[Any]], generation: Generation | None) -> SendAnswer:
    async def send_json(scope: Scope, receive: Receive, send: Send) -> None:
        try:
            content = await _unless_client_leaves(work(), receive)
        except _ClientGone:
            await Response(status_code=CLIENT_CLOSED_REQUEST)(scope, receive, send)
            return
        except EngineDeadError:
            if is_stopping(scope):  # nothing sent yet: the app's error handlers answer it
                raise shutting_down_error() from None
            raise
        if generation is not None:
            generation.record_finish()
            _record_usage(scope, generation.usage())
        response = await json_response(content)  # a large body is encoded in pieces, between turns of the loop
        await response(scope, receive, send)

    return send_json


class _ClientGone(Exception):
    pass


async def _unless_client_leaves(work: Awaitable[T], receive: Receive) -> T:
    """`work`'s result; if the client leaves first, cancel it, let it unwind, and raise _ClientGone."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_client_left(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.done():
        return task.result()
    await asyncio.gather(task, return_exceptions=True)
    raise _ClientGone()


async def _client_left(receive: Receive) -> None:
    """Returns when the client disconnects (the request body was read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def _error_for(exc: KVServeError, scope: Scope) -> APIError:
    """The answer to an engine error; an engine stopped by the server's stop is 503 `shutting_down`."""
    if isinstance(exc, EngineDeadError) and is_stopping(scope):
        return shutting_down_error()
    return api_error_for(exc)


def _sse(payload: dict | str, named: bool = False) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    event = f"event: {payload['type']}\n" if named and isinstance(payload, dict) else ""
    return f"{event}data: {data}\n\n"


def _record_usage(scope: Scope, usage: Usage) -> None:
    """For the access-log line the middleware writes when the request ends."""
    scope.setdefault("state", {})["usage"] = usage.model_dump()
