"""clients/client.py against a live HTTP server that speaks the kvserve API.

The server here is a small FastAPI app run by uvicorn on a free port in a thread: it
answers with deterministic text (the prompt's words upper-cased, in reverse), real SSE
framing, usage counts, and can be told to fail the next requests (429 with Retry-After,
503, 400...) so retries and error messages go over real HTTP.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from clients.client import AsyncClient, Client, KVServeAPIError, KVServeConnectionError
from clients.retry import RetryPolicy, parse_retry_after
from clients.sse import aiter_sse_data, iter_sse_data, iter_sse_events
from tests.support.server_harness import free_port

GEN_MODEL = "tiny-gen"
EMBED_MODEL = "tiny-embed"


def _error(status: int, message: str, type_: str, param: str | None = None, headers: dict | None = None):
    body = {"error": {"message": message, "type": type_, "param": param, "code": None}}
    return JSONResponse(body, status_code=status, headers=headers)


def _reply_words(prompt: str, max_tokens: int) -> list[str]:
    return [w.upper() for w in reversed(prompt.split())][:max_tokens]


def _chat_reply(messages: list[dict]) -> str:
    num_user = sum(m["role"] == "user" for m in messages)
    num_assistant = sum(m["role"] == "assistant" for m in messages)
    system = "yes" if any(m["role"] == "system" for m in messages) else "no"
    return f"You said: {messages[-1]['content']} (turn {num_user}, replies {num_assistant}, system {system})"


def _sse(chunks: list[dict]) -> Iterator[bytes]:
    yield b": keep-alive comment\n\n"
    for chunk in chunks:
        yield f"data: {json.dumps(chunk)}\n\n".encode()
    yield b"data: [DONE]\n\n"


def make_app() -> FastAPI:
    app = FastAPI()
    app.state.forced = {}  # path -> list of (status, headers, body) to answer before behaving normally
    app.state.hits = Counter()
    app.state.api_key = None
    app.state.bodies = []

    @app.middleware("http")
    async def forced_and_auth(request: Request, call_next):
        app.state.hits[request.url.path] += 1
        if request.method == "POST":
            app.state.bodies.append((request.url.path, json.loads(await request.body() or b"null")))
        queue = app.state.forced.get(request.url.path)
        if queue:
            status, headers, message = queue.pop(0)
            return _error(status, message, "server_busy" if status in (429, 503) else "test_error", headers=headers)
        key = app.state.api_key
        if key and request.url.path != "/health" and request.headers.get("authorization") != f"Bearer {key}":
            return _error(401, "invalid API key", "authentication_error")
        return await call_next(request)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {"id": EMBED_MODEL, "object": "model", "task": "embed", "max_model_len": 64},
                {"id": GEN_MODEL, "object": "model", "task": "generate", "max_model_len": 128},
            ],
        }

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        if body.get("model") != GEN_MODEL:
            return _error(404, f"model {body.get('model')!r} does not exist", "not_found_error", "model")
        max_tokens = body.get("max_tokens", 16)
        if max_tokens < 1:
            return _error(
                400, f"max_tokens must be at least 1, got {max_tokens}", "invalid_request_error", "max_tokens"
            )
        words = _reply_words(body["prompt"], max_tokens)
        finish = "length" if len(words) == max_tokens else "stop"
        usage = {
            "prompt_tokens": len(body["prompt"].split()),
            "completion_tokens": len(words),
            "total_tokens": len(body["prompt"].split()) + len(words),
        }
        if not body.get("stream"):
            return {
                "id": "cmpl-1",
                "object": "text_completion",
                "model": GEN_MODEL,
                "usage": usage,
                "choices": [{"index": 0, "text": " ".join(words), "finish_reason": finish, "logprobs": None}],
            }
        include_usage = (body.get("stream_options") or {}).get("include_usage")
        chunks = [
            {
                "id": "cmpl-1",
                "object": "text_completion",
                "model": GEN_MODEL,
                "usage": None,
                "choices": [
                    {
                        "index": 0,
                        "text": (" " if i else "") + w,
                        "finish_reason": finish if i == len(words) - 1 else None,
                    }
                ],
            }
            for i, w in enumerate(words)
        ]
        if include_usage:
            chunks.append(
                {"id": "cmpl-1", "object": "text_completion", "model": GEN_MODEL, "choices": [], "usage": usage}
            )
        return StreamingResponse(_sse(chunks), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        if body.get("model") != GEN_MODEL:
            return _error(404, f"model {body.get('model')!r} does not exist", "not_found_error", "model")
        if body["messages"][-1]["content"] == "explode mid-stream":
            chunks = [
                {"id": "c", "model": GEN_MODEL, "choices": [{"index": 0, "delta": {"content": "par"}}]},
                {"error": {"message": "engine died", "type": "internal_error", "param": None, "code": None}},
            ]
            return StreamingResponse(_sse(chunks), media_type="text/event-stream")
        text = _chat_reply(body["messages"])
        usage = {
            "prompt_tokens": len(body["messages"]),
            "completion_tokens": len(text.split()),
            "total_tokens": len(body["messages"]) + len(text.split()),
        }
        if not body.get("stream"):
            return {
                "id": "chat-1",
                "object": "chat.completion",
                "model": GEN_MODEL,
                "usage": usage,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            }
        words = text.split(" ")
        chunks = [
            {
                "id": "chat-1",
                "object": "chat.completion.chunk",
                "model": GEN_MODEL,
                "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
            }
        ]
        chunks += [
            {
                "id": "chat-1",
                "object": "chat.completion.chunk",
                "model": GEN_MODEL,
                "choices": [{"index": 0, "delta": {"content": (" " if i else "") + w}, "finish_reason": None}],
            }
            for i, w in enumerate(words)
        ]
        chunks.append(
            {
                "id": "chat-1",
                "object": "chat.completion.chunk",
                "model": GEN_MODEL,
                "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
            }
        )
        if (body.get("stream_options") or {}).get("include_usage"):
            chunks.append(
                {"id": "chat-1", "object": "chat.completion.chunk", "model": GEN_MODEL, "choices": [], "usage": usage}
            )
        return StreamingResponse(_sse(chunks), media_type="text/event-stream")

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        body = await request.json()
        texts = [body["input"]] if isinstance(body["input"], str) else body["input"]
        data = [
            {"object": "embedding", "index": i, "embedding": [float(len(t)), float(sum(c in "aeiou" for c in t))]}
            for i, t in enumerate(texts)
        ]
        data.reverse()  # the client must order by index
        return {
            "object": "list",
            "model": body["model"],
            "data": data,
            "usage": {"prompt_tokens": len(texts), "total_tokens": len(texts)},
        }

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await request.json()
        text = body["prompt"] if "prompt" in body else " ".join(m["content"] for m in body["messages"])
        tokens = [len(w) for w in text.split()]
        return {"tokens": tokens, "count": len(tokens), "max_model_len": 128}

    return app


class LiveServer:
    def __init__(self) -> None:
        self.app = make_app()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.base_url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "test server did not start"
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()

    def reset(self) -> None:
        self.app.state.forced.clear()
        self.app.state.hits.clear()
        self.app.state.api_key = None
        self.app.state.bodies.clear()

    def force(self, path: str, *responses: tuple[int, dict, str]) -> None:
        self.app.state.forced[path] = list(responses)

    def hits(self, path: str) -> int:
        return self.app.state.hits[path]


@pytest.fixture(scope="module")
def live_server_module() -> Iterator[LiveServer]:
    server = LiveServer().start()
    yield server
    server.stop()


@pytest.fixture
def live_server(live_server_module: LiveServer) -> Iterator[LiveServer]:
    live_server_module.reset()
    yield live_server_module
    live_server_module.reset()


@pytest.fixture
def client(live_server: LiveServer) -> Iterator[Client]:
    with Client(live_server.base_url, backoff_base=0.01, timeout=10) as c:
        yield c


# --------------------------------------------------------------------------- happy paths


def test_complete_returns_text_usage_and_finish_reason(client: Client) -> None:
    result = client.complete("one two three", model=GEN_MODEL, max_tokens=2)
    assert result.text == "THREE TWO"
    assert result.finish_reason == "length"
    assert (result.usage.prompt_tokens, result.usage.completion_tokens, result.usage.total_tokens) == (3, 2, 5)


def test_default_model_is_the_servers_generation_model(client: Client, live_server: LiveServer) -> None:
    # /v1/models lists the embedding model first; the client must pick by task
    assert client.complete("a b").text == "B A"
    assert client.embed("hello").model == EMBED_MODEL
    assert live_server.hits("/v1/models") == 2  # once per task, then remembered
    client.complete("c d")
    assert live_server.hits("/v1/models") == 2


def test_stream_yields_deltas_that_join_to_the_full_text(client: Client) -> None:
    prompt = "the quick brown fox jumps"
    full = client.complete(prompt, model=GEN_MODEL, max_tokens=10)
    stream = client.stream(prompt, model=GEN_MODEL, max_tokens=10)
    deltas = list(stream)
    assert len(deltas) == 5
    assert "".join(deltas) == full.text == stream.text
    assert stream.usage == full.usage
    assert stream.finish_reason == "stop" and stream.is_done


def test_chat_and_stream_chat_agree(client: Client, live_server: LiveServer) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    full = client.chat(messages, model=GEN_MODEL)
    assert full.text == "You said: hi there (turn 1, replies 0, system yes)"
    stream = client.stream_chat(messages, model=GEN_MODEL)
    deltas = list(stream)
    assert len(deltas) > 3
    assert "".join(deltas) == full.text
    assert stream.usage is not None and stream.usage.completion_tokens == len(full.text.split())
    sent = live_server.app.state.bodies[-1][1]
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}


def test_chat_accepts_a_plain_string(client: Client) -> None:
    assert client.chat("hello", model=GEN_MODEL).text.startswith("You said: hello (turn 1")


def test_sampling_params_are_sent(client: Client, live_server: LiveServer) -> None:
    client.complete("x y", model=GEN_MODEL, max_tokens=3, temperature=0.0, stop=["\n"], seed=7, top_p=None)
    path, body = live_server.app.state.bodies[-1]
    assert path == "/v1/completions"
    assert body == {"model": GEN_MODEL, "prompt": "x y", "max_tokens": 3, "temperature": 0.0, "stop": ["\n"], "seed": 7}


def test_embed_orders_vectors_by_index(client: Client) -> None:
    result = client.embed(["aaa", "b", "eio"], model=EMBED_MODEL)
    assert result.vectors == [[3.0, 3.0], [1.0, 0.0], [3.0, 3.0]]
    assert result.usage.prompt_tokens == 3


def test_tokenize_prompt_and_messages(client: Client) -> None:
    tok = client.tokenize("ab cde", model=GEN_MODEL)
    assert (tok.tokens, tok.count, tok.max_model_len) == ([2, 3], 2, 128)
    tok = client.tokenize(messages=[{"role": "user", "content": "abcd"}], model=GEN_MODEL)
    assert tok.tokens == [4]
    with pytest.raises(ValueError):
        client.tokenize("x", messages=[{"role": "user", "content": "y"}], model=GEN_MODEL)


def test_health_and_models(client: Client) -> None:
    assert client.health() is True
    models = client.models()
    assert [(m.id, m.task, m.max_model_len) for m in models] == [
        (EMBED_MODEL, "embed", 64),
        (GEN_MODEL, "generate", 128),
    ]
    client.wait_until_ready(timeout=5)


def test_health_is_false_when_nothing_listens() -> None:
    with Client(f"http://127.0.0.1:{free_port()}", timeout=2) as c:
        assert c.health() is False


# --------------------------------------------------------------------------- retries and errors


def test_429_is_retried_after_retry_after_seconds(client: Client, live_server: LiveServer) -> None:
    live_server.force("/v1/completions", (429, {"Retry-After": "1"}, "server full"))
    start = time.monotonic()
    result = client.complete("a b", model=GEN_MODEL)
    elapsed = time.monotonic() - start
    assert result.text == "B A"
    assert live_server.hits("/v1/completions") == 2
    assert elapsed >= 0.95, f"Retry-After: 1 was not honoured (retried after {elapsed:.2f}s)"


def test_503_is_retried_with_exponential_backoff(live_server: LiveServer) -> None:
    live_server.force("/v1/completions", (503, {}, "loading"), (503, {}, "loading"), (503, {}, "loading"))
    with Client(live_server.base_url, backoff_base=0.1, backoff_max=10) as c:
        start = time.monotonic()
        assert c.complete("a b", model=GEN_MODEL).text == "B A"
        elapsed = time.monotonic() - start
    assert live_server.hits("/v1/completions") == 4
    assert elapsed >= 0.1 + 0.2 + 0.4 - 0.02  # 0.1, 0.2, 0.4 (+ up to 10% jitter each)
    assert elapsed < 3


def test_retries_are_bounded_and_the_last_error_is_raised(live_server: LiveServer) -> None:
    live_server.force("/v1/chat/completions", *[(429, {"Retry-After": "0"}, "queue is full (8 waiting)")] * 5)
    with Client(live_server.base_url, max_retries=2, backoff_base=0.01) as c, pytest.raises(KVServeAPIError) as info:
        c.chat("hi", model=GEN_MODEL)
    assert live_server.hits("/v1/chat/completions") == 3
    err = info.value
    assert err.status_code == 429 and err.message == "queue is full (8 waiting)" and err.type == "server_busy"
    assert err.headers.get("retry-after") == "0"


def test_client_errors_are_not_retried_and_carry_the_server_message(client: Client, live_server: LiveServer) -> None:
    with pytest.raises(KVServeAPIError) as info:
        client.complete("a", model=GEN_MODEL, max_tokens=0)
    err = info.value
    assert live_server.hits("/v1/completions") == 1
    assert (err.status_code, err.type, err.param) == (400, "invalid_request_error", "max_tokens")
    assert err.message == "max_tokens must be at least 1, got 0"
    assert "max_tokens must be at least 1" in str(err) and "400" in str(err)
    with pytest.raises(KVServeAPIError) as info:
        client.chat("a", model="nope")
    assert info.value.status_code == 404 and "'nope' does not exist" in info.value.message


def test_api_key_is_sent_as_bearer_token(live_server: LiveServer) -> None:
    live_server.app.state.api_key = "s3cret"
    with Client(live_server.base_url, api_key="wrong") as c, pytest.raises(KVServeAPIError) as info:
        c.models()
    assert info.value.status_code == 401 and info.value.type == "authentication_error"
    with Client(live_server.base_url, api_key="s3cret") as c:
        assert [m.id for m in c.models()] == [EMBED_MODEL, GEN_MODEL]


def test_stream_retries_a_429_before_the_first_byte(client: Client, live_server: LiveServer) -> None:
    live_server.force("/v1/chat/completions", (429, {"Retry-After": "0"}, "busy"))
    assert "".join(client.stream_chat("hello", model=GEN_MODEL)).startswith("You said: hello")
    assert live_server.hits("/v1/chat/completions") == 2


def test_stream_error_status_raises_with_message(client: Client) -> None:
    stream = client.stream("a", model=GEN_MODEL, max_tokens=-1)
    with pytest.raises(KVServeAPIError) as info:
        list(stream)
    assert info.value.status_code == 400 and info.value.param == "max_tokens"


def test_error_event_in_the_middle_of_a_stream_raises(client: Client) -> None:
    stream = client.stream_chat("explode mid-stream", model=GEN_MODEL)
    received: list[str] = []
    with pytest.raises(KVServeAPIError) as info:
        received.extend(stream)
    assert received == ["par"]
    assert info.value.message == "engine died" and info.value.type == "internal_error"


def test_unreachable_server_raises_connection_error_after_retries() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with Client(url, max_retries=2, backoff_base=0.01, timeout=2) as c, pytest.raises(KVServeConnectionError):
        c.complete("x", model=GEN_MODEL)


# --------------------------------------------------------------------------- async


def test_async_client_end_to_end(live_server: LiveServer) -> None:
    async def main() -> None:
        live_server.force("/v1/completions", (503, {"Retry-After": "1"}, "loading"))
        async with AsyncClient(live_server.base_url, backoff_base=0.01) as c:
            assert await c.health()
            start = time.monotonic()
            result = await c.complete("x y z")
            assert time.monotonic() - start >= 0.95
            assert result.text == "Z Y X" and result.usage.total_tokens == 6
            stream = await c.stream_chat([{"role": "user", "content": "hey"}])
            deltas = [d async for d in stream]
            assert len(deltas) > 3 and "".join(deltas) == stream.text
            assert stream.text == "You said: hey (turn 1, replies 0, system no)"
            assert stream.usage is not None and stream.finish_reason == "stop"
            stream = await c.stream("p q r s", max_tokens=3)
            assert [d async for d in stream] == ["S", " R", " Q"] and stream.usage.completion_tokens == 3
            assert (await c.embed("abc")).vectors == [[3.0, 1.0]]
            assert (await c.tokenize("ab c")).tokens == [2, 1]
            with pytest.raises(KVServeAPIError) as info:
                await c.complete("x", max_tokens=0)
            assert info.value.param == "max_tokens"

    asyncio.run(main())
    assert live_server.hits("/v1/completions") == 4


def test_async_streams_run_concurrently(live_server: LiveServer) -> None:
    async def main() -> list[str]:
        async with AsyncClient(live_server.base_url, model=GEN_MODEL) as c:

            async def one(i: int) -> str:
                stream = await c.stream(f"w{i} v{i}")
                return "".join([d async for d in stream])

            return await asyncio.gather(*(one(i) for i in range(8)))

    assert asyncio.run(main()) == [f"V{i} W{i}" for i in range(8)]


# --------------------------------------------------------------------------- pure helpers


def test_sse_parser_handles_comments_multiline_and_done() -> None:
    lines = [
        ": ping",
        "",
        'data:{"a":1}',
        "",
        "event: x",
        "data: line1",
        "data: line2",
        "",
        "data: [DONE]",
        "",
        "data: after-done",
        "",
    ]
    assert list(iter_sse_data(lines)) == ['{"a":1}', "line1\nline2"]
    assert list(iter_sse_data(["data: tail-without-blank-line"])) == ["tail-without-blank-line"]
    assert list(iter_sse_events(lines)) == ['{"a":1}', "line1\nline2", "[DONE]", "after-done"]

    async def collect(lines: list[str]) -> list[str]:
        async def aiter_lines():
            for line in lines:
                yield line

        return [payload async for payload in aiter_sse_data(aiter_lines())]

    assert asyncio.run(collect(lines)) == ['{"a":1}', "line1\nline2"]
    assert asyncio.run(collect(["data: tail-without-blank-line"])) == ["tail-without-blank-line"]


def _response(status: int, retry_after: str | None = None) -> httpx.Response:
    return httpx.Response(status, headers={"Retry-After": retry_after} if retry_after is not None else {})


def test_retry_policy_decides_what_is_sent_again_and_when() -> None:
    policy = RetryPolicy(max_retries=3, backoff_base=0.1, backoff_max=0.3, max_retry_wait=5.0)
    for status in (400, 401, 404, 500, 502):
        assert policy.delay(0, _response(status)) is None  # no retry would change the answer
    assert policy.delay(0, _response(429, "2")) == 2.0
    assert policy.delay(0, _response(503, "120")) == 5.0  # Retry-After capped
    backoffs = [policy.delay(attempt, None) for attempt in range(3)]  # refused connection
    for backoff, expected in zip(backoffs, (0.1, 0.2, 0.3)):  # doubles up to backoff_max, plus <= 10% jitter
        assert expected <= backoff <= expected * 1.1
    assert 0.2 <= policy.delay(1, _response(503)) <= 0.22
    assert policy.delay(3, _response(429, "0")) is None and policy.delay(3, None) is None  # retries used up


def test_async_unreachable_server_raises_connection_error_after_retries() -> None:
    async def main() -> None:
        url = f"http://127.0.0.1:{free_port()}"
        async with AsyncClient(url, max_retries=2, backoff_base=0.01, timeout=2) as c:
            with pytest.raises(KVServeConnectionError, match="cannot reach"):
                await c.complete("x", model=GEN_MODEL)

    asyncio.run(main())


def test_parse_retry_after() -> None:
    assert parse_retry_after("3") == 3.0
    assert parse_retry_after(None) is None and parse_retry_after("soon") is None
    future = email.utils.formatdate(time.time() + 30, usegmt=True)
    assert 25 <= parse_retry_after(future) <= 31
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0
