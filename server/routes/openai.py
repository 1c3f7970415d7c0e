"""OpenAI-compatible generation routes: /v1/completions, /v1/chat/completions, /v1/models.

Thin: map request fields onto SamplingParams, submit to the AsyncEngine, shape its
RequestOutput deltas into OpenAI's JSON bodies or SSE chunks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from engine.errors import InvalidRequestError, KVServeError
from engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from engine.params import SamplingParams
from engine.serving.async_engine import AsyncEngine, RequestStream
from server.errors import APIError
from server.metrics import RequestTimer
from server.schemas import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    TopLogprob,
    Usage,
    _SamplingFields,
)

logger = logging.getLogger(__name__)
router = APIRouter()

CLIENT_CLOSED_REQUEST = 499  # nginx's code: the client left before the answer
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


# ---- shared helpers (also used by native.py) ----


def embedding_model_names(request: Request) -> set[str]:
    config = request.app.state.config
    embedder = getattr(request.app.state, "embedder", None)
    names = {config.embedder.model if config.embedder is not None else None}
    if embedder is not None:
        names.add(embedder.model_name)
    return {n for n in names if n}


def generation_model_names(request: Request) -> set[str]:
    config = request.app.state.config
    engine = getattr(request.app.state, "engine", None)
    names = {config.model_name, config.engine.model}
    if engine is not None:
        names.add(engine.model_name)
    return {n for n in names if n}


_TASK_ROUTES = {
    "generate": "Text generation (/v1/completions, /v1/chat/completions)",
    "embed": "Embeddings (/v1/embeddings, /embed)",
}


def check_model(request: Request, model: str | None, task: Literal["generate", "embed"]) -> None:
    """400 if `model` is served for the other task, 404 if it is not served at all (None: the default)."""
    if model is None:
        return
    own, other = (
        (generation_model_names(request), embedding_model_names(request))
        if task == "generate"
        else (embedding_model_names(request), generation_model_names(request))
    )
    if model in own:
        return
    if model in other:
        kind, use = (
            ("an embedding model", "/v1/embeddings or /embed")
            if task == "generate"
            else ("a generation model", "/v1/completions or /v1/chat/completions")
        )
        servers = ", ".join(repr(n) for n in sorted(own)) or "no model on this server"
        raise APIError(
            400,
            f"model {model!r} is {kind}: use {use} with it. {_TASK_ROUTES[task]}: served by {servers}.",
            param="model",
            code="wrong_model_task",
        )
    served = [request.app.state.config.model_name, *sorted(embedding_model_names(request))]
    raise APIError(
        404,
        f"the model {model!r} does not exist; served models: {', '.join(served)}",
        type="not_found_error",
        param="model",
        code="model_not_found",
    )


def generation_engine(request: Request, model: str | None) -> AsyncEngine:
    """The AsyncEngine serving `model` (None: the default one); 400/404/503 otherwise."""
    check_model(request, model, "generate")
    engine: AsyncEngine | None = request.app.state.engine
    if engine is None:
        raise APIError(503, "the generation model is not loaded", type="service_unavailable")
    if not engine.is_healthy:
        raise APIError(503, "the generation engine is not running", type="service_unavailable")
    return engine


def check_batch_size(request: Request, num_items: int, param: str) -> None:
    """413 naming --max-client-batch-size when a request carries more items than it allows."""
    limit = request.app.state.config.max_client_batch_size
    if num_items > limit:
        raise APIError(
            413,
            f"{param} has {num_items} items, more than this server's limit of {limit} "
            f"(--max-client-batch-size); split it into several requests",
            param=param,
            code="batch_too_large",
        )


def check_token_ids(token_ids: list[int], vocab_size: int, param: str) -> None:
    for token_id in token_ids:
        if not 0 <= token_id < vocab_size:
            message = f"{param}: token id {token_id} is outside the vocabulary [0, {vocab_size})"
            raise InvalidRequestError(message, param)


def _reject_unsupported(fields: list[str]) -> None:
    if fields:
        raise APIError(
            400,
            f"unsupported field(s) for this server: {', '.join(fields)}",
            param=fields[0],
            code="unsupported_field",
        )


_TOKEN_ID_KEY = re.compile(r"-?[0-9]{1,10}", re.ASCII)


def _sampling_params(
    body: _SamplingFields, max_tokens: int | None, logprobs: int | None, vocab_size: int
) -> SamplingParams:
    logit_bias = None
    if body.logit_bias:
        logit_bias = {}
        for key, bias in body.logit_bias.items():
            if not _TOKEN_ID_KEY.fullmatch(key):
                raise InvalidRequestError(f"logit_bias: keys must be token ids, got {key[:32]!r}", "logit_bias")
            logit_bias[int(key)] = bias
        check_token_ids(list(logit_bias), vocab_size, "logit_bias")
    if body.stream_options is not None and not body.stream:
        raise InvalidRequestError("stream_options: only allowed when stream is true", "stream_options")
    return SamplingParams(
        n=body.n,
        max_tokens=max_tokens,
        min_tokens=body.min_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        repetition_penalty=body.repetition_penalty,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        logit_bias=logit_bias,
        seed=body.seed,
        stop=body.stop or (),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        include_stop_str_in_output=body.include_stop_str_in_output,
        logprobs=logprobs,
        skip_special_tokens=body.skip_special_tokens,
    )


async def _submit_all(engine: AsyncEngine, prompts: list[list[int]], params: SamplingParams) -> list[RequestStream]:
    """Submit every prompt together; if any is refused, abort the others and raise its error.

    Engine request ids are made here (unique), never taken from the client's X-Request-Id:
    a retry with the same header must not collide with, or be aborted as, the old request.
    """
    ids = [uuid.uuid4().hex for _ in prompts]
    results = await asyncio.gather(
        *(engine.submit(p, params, rid) for p, rid in zip(prompts, ids)), return_exceptions=True
    )
    streams = [r for r in results if isinstance(r, RequestStream)]
    for r in results:
        if isinstance(r, BaseException):
            for stream in streams:
                stream.close()
            raise r
    return streams


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from several streams as they come; closing it closes them all."""
    try:
        if len(streams) == 1:
            async for output in streams[0]:
                yield 0, output
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, stream: RequestStream) -> None:
            try:
                async for output in stream:
                    queue.put_nowait((i, output))
                queue.put_nowait((i, None))
            except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
                queue.put_nowait((i, exc))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        try:
            remaining = len(streams)
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for task in tasks:
                task.cancel()
    finally:
        for stream in streams:
            stream.close()


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_disconnected(request: Request, work: asyncio.Future | asyncio.Task) -> object:
    """Await `work`; if the client leaves first, cancel it (which aborts its requests)."""
    watcher = asyncio.create_task(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        work.cancel()
        raise
    finally:
        watcher.cancel()
    if work in done:
        return work.result()
    work.cancel()
    await asyncio.gather(work, return_exceptions=True)
    raise _ClientGone()


class _ClientGone(Exception):
    pass


@dataclass
class _Sample:
    """One choice accumulated from deltas."""

    text_parts: list[str] = field(default_factory=list)
    num_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    def add(self, delta: CompletionOutput) -> None:
        self.text_parts.append(delta.text)
        self.num_tokens = delta.num_generated_tokens or (self.num_tokens + len(delta.token_ids))
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.stop_reason = delta.stop_reason

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


class _UsageCounter:
    def __init__(self) -> None:
        self.prompt_tokens: dict[int, int] = {}
        self.completion_tokens: dict[tuple[int, int], int] = {}

    def add(self, prompt_index: int, output: RequestOutput) -> None:
        self.prompt_tokens[prompt_index] = output.num_prompt_tokens
        for o in output.outputs:
            key = (prompt_index, o.index)
            previous = self.completion_tokens.get(key, 0)
            self.completion_tokens[key] = o.num_generated_tokens or (previous + len(o.token_ids))

    def usage(self) -> Usage:
        prompt = sum(self.prompt_tokens.values())
        completion = sum(self.completion_tokens.values())
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


def _error_payload(exc: BaseException) -> dict:
    from server.app import api_error_for  # the one mapping from exceptions to API errors

    return api_error_for(exc).to_body()


def _finish_timer(timer: RequestTimer, reasons: list[str | None]) -> None:
    timer.finish(next((r for r in reasons if r), "abort"))


def _record_usage(request: Request, usage: Usage) -> None:
    request.scope.setdefault("state", {})["usage"] = usage.model_dump()


def _request_id(request: Request, prefix: str) -> str:
    return f"{prefix}-{request.state.request_id}"


# ---- logprobs shapes ----


def _completion_logprobs(tokenizer, items: list[TokenLogprob], text_offset: int) -> CompletionLogprobs:
    result = CompletionLogprobs()
    for item in items:
        token = tokenizer.id_to_token(item.token_id)
        result.tokens.append(token)
        result.token_logprobs.append(item.logprob)
        top: dict[str, float] = {}
        for token_id, logprob in [*item.top, (item.token_id, item.logprob)]:
            text = tokenizer.id_to_token(token_id)
            # Keys are token texts: distinct byte tokens can share one (U+FFFD); keep the best logprob.
            top[text] = max(logprob, top.get(text, logprob))
        result.top_logprobs.append(top)
        result.text_offset.append(text_offset)
        text_offset += len(token)
    return result


def _chat_logprobs(tokenizer, items: list[TokenLogprob], num_top: int) -> ChatLogprobs:
    content = []
    for item in items:
        token = tokenizer.id_to_token(item.token_id)
        top = [
            TopLogprob(token=(t := tokenizer.id_to_token(tid)), logprob=lp, bytes=list(t.encode()))
            for tid, lp in item.top[:num_top]
        ]
        content.append(
            ChatTokenLogprob(token=token, logprob=item.logprob, bytes=list(token.encode()), top_logprobs=top)
        )
    return ChatLogprobs(content=content)


# ---- /v1/models ----


@router.get("/v1/models")
async def list_models(request: Request) -> ModelList:
    state = request.app.state
    config = state.config
    cards = []
    if state.engine is not None:
        cards.append(
            ModelCard(
                id=config.model_name,
                root=config.engine.model,
                max_model_len=state.engine.max_model_len,
                task="generate",
            )
        )
    if state.embedder is not None:
        cards.append(
            ModelCard(
                id=state.embedder.model_name,
                root=config.embedder.model if config.embedder is not None else state.embedder.model_name,
                max_model_len=state.embedder.max_model_len,
                task="embed",
            )
        )
    return ModelList(data=cards)


# ---- /v1/completions ----


def _completion_prompts(
    body: CompletionRequest, tokenizer, vocab_size: int, request: Request
) -> list[tuple[str | None, list[int]]]:
    """(text or None, token ids) for each prompt; token-id prompts must lie in [0, vocab_size)."""
    prompt = body.prompt
    if isinstance(prompt, str):
        raw: list = [prompt]
    elif len(prompt) == 0:
        raise InvalidRequestError("prompt: must not be empty", "prompt")
    elif isinstance(prompt[0], int):
        raw = [prompt]
    else:
        raw = list(prompt)
    check_batch_size(request, len(raw), "prompt")
    prompts = []
    for item in raw:
        if isinstance(item, str):
            ids = tokenizer.encode(item, add_special_tokens=body.add_special_tokens)
            prompts.append((item, ids))
        else:
            check_token_ids(item, vocab_size, "prompt")
            prompts.append((None, list(item)))
        if not prompts[-1][1]:
            raise InvalidRequestError("prompt: must contain at least one token", "prompt")
    return prompts


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    engine = generation_engine(request, body.model)
    _reject_unsupported(body.unsupported_fields())
    if body.echo and body.logprobs is not None:
        raise APIError(400, "echo with logprobs is not supported (no prompt logprobs)", param="echo")
    tokenizer = engine.tokenizer
    prompts = _completion_prompts(body, tokenizer, engine.vocab_size, request)
    params = _sampling_params(body, body.max_tokens, body.logprobs, engine.vocab_size)
    request_id = _request_id(request, "cmpl")
    model_name = request.app.state.config.model_name
    timer = request.app.state.metrics.start_request()
    streams = await _submit_all(engine, [ids for _, ids in prompts], params)
    echoes = [
        (text if text is not None else tokenizer.decode(ids, skip_special_tokens=False)) if body.echo else ""
        for text, ids in prompts
    ]
    if body.stream:
        state = _StreamState(request, streams, timer, body.stream_options)
        chunks = _completion_chunks(state, body, echoes, request_id, model_name, tokenizer)
        return _sse_response(
            state,
            chunks,
            lambda usage: CompletionResponse(id=request_id, model=model_name, choices=[], usage=usage).model_dump(),
        )

    async def collect() -> CompletionResponse:
        samples: dict[int, _Sample] = {}
        usage = _UsageCounter()
        async for prompt_index, output in _merge(streams):
            timer.on_output(output)
            usage.add(prompt_index, output)
            for delta in output.outputs:
                samples.setdefault(prompt_index * params.n + delta.index, _Sample()).add(delta)
        choices = []
        for index in range(len(prompts) * params.n):
            sample = samples.get(index, _Sample())
            echo = echoes[index // params.n]
            logprobs = None
            if params.logprobs is not None:
                logprobs = _completion_logprobs(tokenizer, sample.logprobs, len(echo))
            choices.append(
                CompletionChoice(
                    index=index,
                    text=echo + sample.text,
                    logprobs=logprobs,
                    finish_reason=sample.finish_reason,
                    stop_reason=sample.stop_reason,
                )
            )
        _finish_timer(timer, [c.finish_reason for c in choices])
        return CompletionResponse(id=request_id, model=model_name, choices=choices, usage=usage.usage())

    return await _respond(request, collect(), streams)


async def _respond(request: Request, work, streams: list[RequestStream]) -> Response:
    try:
        response = await _unless_disconnected(request, asyncio.ensure_future(work))
    except _ClientGone:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    finally:
        # Cancelling `work` does not close the generators it iterates (nor does a task cancelled
        # before it ever ran): close the streams here, so the engine requests are aborted now,
        # not whenever the garbage collector gets to them. Closing a finished stream is a no-op.
        for stream in streams:
            stream.close()
    _record_usage(request, response.usage)
    return JSONResponse(response.model_dump())


class _StreamState:
    """What one SSE response shares between its chunk generator and the framing around it."""

    def __init__(self, request: Request, streams: list[RequestStream], timer: RequestTimer, stream_options) -> None:
        self.request = request
        self.streams = streams
        self.timer = timer
        self.include_usage = stream_options is not None and stream_options.include_usage
        self.continuous_usage = stream_options is not None and stream_options.continuous_usage_stats
        self.usage = _UsageCounter()
        self.reasons: dict[int, str | None] = {}

    def chunk(self, payload: dict) -> str:
        """One SSE chunk; its usage field as stream_options asks (continuous, null, or absent)."""
        if self.include_usage:
            payload["usage"] = self.usage.usage().model_dump() if self.continuous_usage else None
        else:
            payload.pop("usage", None)
        return _sse(payload)

    def close(self) -> None:
        for stream in self.streams:
            stream.close()


class _ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that aborts its requests however it ends.

    Starlette cancels the body iterator when the client leaves; if that happens before the
    iterator started (e.g. while the response head is sent), its `finally` never runs. This
    `finally` always does.
    """

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _sse_response(
    state: _StreamState, chunks: AsyncIterator[str], usage_payload: Callable[[Usage], dict]
) -> StreamingResponse:
    """The SSE framing shared by both stream kinds: the chunks, then the usage chunk (if asked) and
    `[DONE]`; an engine error becomes an error event then `[DONE]`. The requests are closed however it ends."""

    async def framed() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield chunk
            _finish_timer(state.timer, list(state.reasons.values()))
            usage = state.usage.usage()
            _record_usage(state.request, usage)
            if state.include_usage:
                yield _sse(usage_payload(usage))
            yield _sse("[DONE]")
        except KVServeError as exc:
            yield _sse(_error_payload(exc))
            yield _sse("[DONE]")
        finally:
            await chunks.aclose()
            state.close()

    return _ClosingStreamingResponse(
        framed(), on_close=state.close, media_type="text/event-stream", headers=SSE_HEADERS
    )


async def _completion_chunks(
    state: _StreamState,
    body: CompletionRequest,
    echoes: list[str],
    request_id: str,
    model_name: str,
    tokenizer,
) -> AsyncIterator[str]:
    n = body.n
    offsets: dict[int, int] = {}
    wants_logprobs = body.logprobs is not None

    def chunk(choices: list[CompletionChoice]) -> str:
        return state.chunk(CompletionResponse(id=request_id, model=model_name, choices=choices).model_dump())

    if body.echo:
        for index in range(len(echoes) * n):
            yield chunk([CompletionChoice(index=index, text=echoes[index // n])])
    merged = _merge(state.streams)
    try:
        async for prompt_index, output in merged:
            state.timer.on_output(output)
            state.usage.add(prompt_index, output)
            for delta in output.outputs:
                if not delta.text and delta.finish_reason is None and not (wants_logprobs and delta.logprobs):
                    continue
                index = prompt_index * n + delta.index
                logprobs = None
                if wants_logprobs:
                    offset = offsets.get(index, len(echoes[prompt_index]))
                    logprobs = _completion_logprobs(tokenizer, delta.logprobs or [], offset)
                    offsets[index] = offset + sum(len(t) for t in logprobs.tokens)
                state.reasons[index] = delta.finish_reason
                yield chunk(
                    [
                        CompletionChoice(
                            index=index,
                            text=delta.text,
                            logprobs=logprobs,
                            finish_reason=delta.finish_reason,
                            stop_reason=delta.stop_reason,
                        )
                    ]
                )
    finally:
        await merged.aclose()


# ---- /v1/chat/completions ----


def chat_prompt_ids(tokenizer, messages: list[ChatMessage], add_generation_prompt: bool) -> list[int]:
    rendered = []
    for message in messages:
        item = {"role": "system" if message.role == "developer" else message.role, "content": message.text()}
        if message.name:
            item["name"] = message.name
        rendered.append(item)
    return tokenizer.apply_chat_template(rendered, add_generation_prompt=add_generation_prompt)


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    engine = generation_engine(request, body.model)
    _reject_unsupported(body.unsupported_fields())
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequestError("top_logprobs: requires logprobs to be true", "top_logprobs")
    tokenizer = engine.tokenizer
    prompt_ids = chat_prompt_ids(tokenizer, body.messages, body.add_generation_prompt)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    num_top = body.top_logprobs or 0
    params = _sampling_params(body, max_tokens, num_top if body.logprobs else None, engine.vocab_size)
    request_id = _request_id(request, "chatcmpl")
    model_name = request.app.state.config.model_name
    timer = request.app.state.metrics.start_request()
    streams = await _submit_all(engine, [prompt_ids], params)
    if body.stream:
        state = _StreamState(request, streams, timer, body.stream_options)
        chunks = _chat_chunks(state, body, num_top, request_id, model_name, tokenizer)
        return _sse_response(
            state,
            chunks,
            lambda usage: ChatCompletionChunk(id=request_id, model=model_name, choices=[], usage=usage).model_dump(),
        )

    async def collect() -> ChatCompletionResponse:
        samples: dict[int, _Sample] = {}
        usage = _UsageCounter()
        async for _, output in _merge(streams):
            timer.on_output(output)
            usage.add(0, output)
            for delta in output.outputs:
                samples.setdefault(delta.index, _Sample()).add(delta)
        choices = []
        for index in range(params.n):
            sample = samples.get(index, _Sample())
            logprobs = _chat_logprobs(tokenizer, sample.logprobs, num_top) if body.logprobs else None
            choices.append(
                ChatChoice(
                    index=index,
                    message=ChatResponseMessage(content=sample.text),
                    logprobs=logprobs,
                    finish_reason=sample.finish_reason,
                    stop_reason=sample.stop_reason,
                )
            )
        _finish_timer(timer, [c.finish_reason for c in choices])
        return ChatCompletionResponse(id=request_id, model=model_name, choices=choices, usage=usage.usage())

    return await _respond(request, collect(), streams)


async def _chat_chunks(
    state: _StreamState,
    body: ChatCompletionRequest,
    num_top: int,
    request_id: str,
    model_name: str,
    tokenizer,
) -> AsyncIterator[str]:
    wants_logprobs = body.logprobs

    def chunk(choices: list[ChatChunkChoice]) -> str:
        return state.chunk(ChatCompletionChunk(id=request_id, model=model_name, choices=choices).model_dump())

    # OpenAI's first chunk of each choice carries the role and an empty content.
    for index in range(body.n):
        yield chunk([ChatChunkChoice(index=index, delta=ChatDelta(role="assistant", content=""))])
    merged = _merge(state.streams)
    try:
        async for _, output in merged:
            state.timer.on_output(output)
            state.usage.add(0, output)
            for delta in output.outputs:
                if not delta.text and delta.finish_reason is None and not (wants_logprobs and delta.logprobs):
                    continue
                logprobs = _chat_logprobs(tokenizer, delta.logprobs or [], num_top) if wants_logprobs else None
                state.reasons[delta.index] = delta.finish_reason
                yield chunk(
                    [
                        ChatChunkChoice(
                            index=delta.index,
                            delta=ChatDelta(content=delta.text if delta.text else None),
                            logprobs=logprobs,
                            finish_reason=delta.finish_reason,
                        )
                    ]
                )
    finally:
        await merged.aclose()
