"""No engine request outlives its client, and none waits for the garbage collector to go.

Every test runs with `RequestStream.__del__` patched away (were it there) and the collector
off: an engine request abandoned by a client must be aborted by the server's own bookkeeping
(server/serving.py), on every path a client can leave by.
"""

from __future__ import annotations

import asyncio
import gc
import json
import threading
import time

import httpx
import pytest

from engine.serving.async_engine import RequestStream
from server.app import create_app
from server.serving import CLIENT_CLOSED_REQUEST
from server.state import state_of
from tests.support.asgi import post_and_leave_async, post_scope
from tests.support.flaky_engine import flaky_factory
from tests.support.server_harness import ServerThread, make_server_config, send_and_hang_up
from tests.support.tiny_models import make_tiny_llama

MODEL = "tiny-llama"
LONG = {"model": MODEL, "max_tokens": 200, "ignore_eos": True}  # 200 steps of 20 ms: longer than any wait here
CHAT = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def without_gc(monkeypatch):
    monkeypatch.delattr(RequestStream, "__del__", raising=False)
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _is_idle(engine) -> bool:
    stats = engine.stats()
    return (
        engine.num_active_requests == 0
        and stats.num_running == 0
        and stats.num_waiting == 0
        and stats.num_used_blocks == 0
    )


def _wait_idle(engine, timeout: float) -> float:
    start = time.monotonic()
    while not _is_idle(engine):
        assert time.monotonic() - start < timeout, (
            f"still busy after {timeout} s: {engine.num_active_requests} active, {engine.stats()}"
        )
        time.sleep(0.01)
    return time.monotonic() - start


def _read_first_chunk_and_leave(base_url: str, path: str, body: dict, statuses: list[int]) -> None:
    with httpx.Client(base_url=base_url, timeout=30) as http, http.stream("POST", path, json=body) as response:
        statuses.append(response.status_code)
        next(response.iter_lines())


def test_many_clients_leaving_at_every_moment_free_every_request(model_dir, without_gc):
    """Streams and JSON answers, one prompt or a fan-out of prompts x n, dropped before the head,
    right after it, mid-stream, or while a JSON answer is being generated."""
    config = make_server_config(model_dir, max_num_seqs=64, max_queued_requests=512)
    with ServerThread(create_app(config, engine_factory=flaky_factory)) as srv:
        engine = state_of(srv.app).engine
        engine.llm_engine.step_delay = 0.02  # the loop is always mid-step: submits wait, streams are alive
        requests = [
            ("/v1/completions", {**LONG, "prompt": "Hello", "stream": True}),
            ("/v1/completions", {**LONG, "prompt": ["Hello", "The quick brown fox"], "n": 2, "stream": True}),
            ("/v1/completions", {**LONG, "prompt": "Hello", "stream": True, "echo": True}),
            ("/v1/chat/completions", {**LONG, "messages": CHAT, "stream": True}),
            ("/v1/chat/completions", {**LONG, "messages": CHAT, "n": 3, "stream": True}),
            ("/v1/completions", {**LONG, "prompt": "Hello"}),
            ("/v1/completions", {**LONG, "prompt": ["Hello", "A paged KV cache", "Hi"], "n": 2}),
            ("/v1/chat/completions", {**LONG, "messages": CHAT}),
        ]
        clients = [
            threading.Thread(target=send_and_hang_up, args=(srv.base_url, path, body, linger))
            for linger in (0.0, 0.01, 0.05, 0.2, 0.5)
            for path, body in requests
        ]
        statuses: list[int] = []
        clients += [
            threading.Thread(target=_read_first_chunk_and_leave, args=(srv.base_url, path, body, statuses))
            for path, body in requests
            if body.get("stream")
        ]
        for client in clients:
            client.start()
        for client in clients:
            client.join(timeout=30)
        assert statuses == [200] * 5
        assert engine.stats().num_generation_tokens > 0
        elapsed = _wait_idle(engine, timeout=3.0)
        print(f"{len(clients)} abandoned requests: engine idle {elapsed * 1000:.0f} ms after the last client left")
        engine.llm_engine.step_delay = 0.0
        answer = httpx.post(f"{srv.base_url}/v1/completions", json={**LONG, "prompt": "Hi", "max_tokens": 3})
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 3
        assert _is_idle(engine)


FAN_OUT = {"prompt": ["Hello", "A paged KV cache"], "n": 2}
LEAVINGS = [
    # (path, body, when the client leaves, the status it was sent)
    ("/v1/chat/completions", {**LONG, "messages": CHAT, "stream": True}, "during_head", 200),
    ("/v1/completions", {**LONG, **FAN_OUT, "stream": True}, "during_head", 200),
    ("/v1/completions", {**LONG, **FAN_OUT, "stream": True}, "mid_stream", 200),
    ("/v1/chat/completions", {**LONG, "messages": CHAT}, "while_generating", CLIENT_CLOSED_REQUEST),
    ("/v1/completions", {**LONG, **FAN_OUT}, "while_generating", CLIENT_CLOSED_REQUEST),
    ("/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 200}, "while_generating", 499),
]


@pytest.mark.parametrize(("path", "body", "leaves", "status"), LEAVINGS, ids=[f"{p}-{w}" for p, _, w, _ in LEAVINGS])
def test_client_leaving_at_each_moment_aborts_every_request(model_dir, without_gc, path, body, leaves, status):
    """On the ASGI app itself, so the moment is exact. "during_head": the disconnect comes while
    the response head is being sent, so Starlette cancels the body before it ever starts."""
    app = create_app(make_server_config(model_dir), engine_factory=flaky_factory)
    payload = json.dumps(body).encode()
    scope = post_scope(path, payload)

    async def main() -> list[dict]:
        async with app.router.lifespan_context(app):
            state = state_of(app)
            while not state.is_ready:
                await asyncio.sleep(0.01)
            engine = state.engine
            engine.llm_engine.step_delay = 0.02
            sent: list[dict] = []
            is_body_read = False
            is_head_sending = asyncio.Event()
            num_chunks_sent = 0

            async def receive() -> dict:
                nonlocal is_body_read
                if not is_body_read:
                    is_body_read = True
                    return {"type": "http.request", "body": payload, "more_body": False}
                if leaves == "during_head":
                    await is_head_sending.wait()
                elif leaves == "mid_stream":
                    while num_chunks_sent < 3:
                        await asyncio.sleep(0.01)
                else:
                    while engine.stats().num_generation_tokens == 0:
                        await asyncio.sleep(0.01)
                return {"type": "http.disconnect"}

            async def send(message: dict) -> None:
                nonlocal num_chunks_sent
                sent.append(message)
                if message["type"] == "http.response.start":
                    is_head_sending.set()
                    await asyncio.sleep(0.1)  # a slow network: the client leaves meanwhile
                elif message.get("body"):
                    num_chunks_sent += 1

            await asyncio.wait_for(app(scope, receive, send), timeout=10)
            deadline = time.monotonic() + 1.0
            while not _is_idle(engine):
                assert time.monotonic() < deadline, f"not aborted: {engine.num_active_requests} active"
                await asyncio.sleep(0.01)
            return sent

    sent = asyncio.run(main())
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == status


BEFORE_THE_ANSWER = [
    ("/v1/chat/completions", {**LONG, "messages": CHAT}, "server.routes.chat.compile_structured"),
    ("/v1/completions", {**LONG, "prompt": "Hi"}, "server.routes.completions.compile_structured"),
    ("/v1/responses", {"model": MODEL, "input": "Hi"}, "server.routes.responses.compile_structured"),
]


@pytest.mark.parametrize(("path", "body", "slow_step"), BEFORE_THE_ANSWER, ids=[p for p, _, _ in BEFORE_THE_ANSWER])
def test_a_client_leaving_before_the_answer_starts_is_noticed_at_once(model_dir, monkeypatch, path, body, slow_step):
    """The work before the submit (here a grammar compile that takes 30 s) is cancelled the moment the
    client leaves: a 499 within a second, and nothing ever reaches the engine."""
    app = create_app(make_server_config(model_dir))
    payload = json.dumps(body).encode()
    compiling = asyncio.Event()

    async def slow_compile(*args, **kwargs) -> None:
        compiling.set()
        await asyncio.sleep(30)

    monkeypatch.setattr(slow_step, slow_compile)

    async def main() -> tuple[list[dict], float]:
        async with app.router.lifespan_context(app):
            state = state_of(app)
            while not state.is_ready:
                await asyncio.sleep(0.01)
            start = time.monotonic()
            sent = await post_and_leave_async(app, path, payload, compiling, timeout=5)
            elapsed = time.monotonic() - start
            assert state.engine.num_active_requests == 0 and state.engine.stats().num_generation_tokens == 0
            return sent, elapsed

    sent, elapsed = asyncio.run(main())
    assert sent[0]["status"] == CLIENT_CLOSED_REQUEST
    assert elapsed < 1.0
