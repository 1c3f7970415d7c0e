"""No request, however bad or however abandoned, hurts the others: a real server under abuse.

The engine is wrapped in `FlakyEngine` (tests/support/flaky_engine.py), which the tests steer
(slow steps, failing steps, a failing add) to reproduce slow generation and internal errors on demand.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server.app import create_app
from server.errors import ERROR_CODES
from server.state import state_of
from tests.support.asgi import post_scope
from tests.support.flaky_engine import flaky_factory
from tests.support.server_harness import ServerProcess, ServerThread, make_server_config, parse_sse, send_and_hang_up
from tests.support.tiny_models import make_tiny_llama

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
API_KEY = "sekret-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
ORIGIN = "http://example.com"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def server(model_dir):
    config = make_server_config(model_dir, max_request_bytes=4096, request_timeout=3.0)
    with ServerThread(create_app(config, engine_factory=flaky_factory)) as srv:
        yield srv


@pytest.fixture(scope="module")
def guarded(model_dir):
    """API key, CORS, one running sequence and a waiting queue of one."""
    config = make_server_config(
        model_dir, api_key=API_KEY, allowed_origins=(ORIGIN,), max_num_seqs=1, max_queued_requests=1
    )
    with ServerThread(create_app(config, engine_factory=flaky_factory)) as srv:
        yield srv


@pytest.fixture
def knobs(server):
    engine = state_of(server.app).engine.llm_engine
    yield engine
    engine.step_delay, engine.fail_steps, engine.fail_adds = 0.0, 0, False
    engine.fail_seed, engine.model_broken = None, False


def gauges(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics", headers=AUTH).text  # the key is ignored where none is set
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.labels == {"model_name": MODEL}
    }


def wait_until(predicate, timeout: float) -> float:
    """Seconds until predicate() held; fails the test after `timeout`."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, "condition not reached in time"
        time.sleep(0.01)
    return time.monotonic() - start


def assert_error_shape(response: httpx.Response, status: int, param: str | None = "", type_: str | None = None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["code"] in ERROR_CODES, error  # one snake_case vocabulary, never null
    if param != "":
        assert (error["param"] or "").startswith(param or ""), error
    if type_:
        assert error["type"] == type_
    return error


def assert_still_serves(base_url: str, headers: dict | None = None) -> None:
    body = {"model": MODEL, "prompt": "Hello world", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    response = httpx.post(f"{base_url}/v1/completions", json=body, headers=headers, timeout=30)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4


# ---- abandoned requests ----


def test_dropped_streams_free_their_blocks_within_a_second(server, knobs):
    knobs.step_delay = 0.02  # 200 tokens take seconds: the streams are surely alive when dropped
    body = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 200, "ignore_eos": True, "stream": True}
    clients = [httpx.Client(base_url=server.base_url, timeout=30) for _ in range(8)]
    responses = []
    for http in clients:
        response = http.send(http.build_request("POST", "/v1/completions", json=body), stream=True)
        assert response.status_code == 200
        lines = response.iter_lines()  # keep the iterator: dropping it closes the connection
        next(lines)  # the first chunk
        responses.append((response, lines))
    before = gauges(server.base_url)
    assert before["kvserve:num_requests_running"] == 8 and before["kvserve:kv_cache_usage_perc"] > 0
    for (response, _), http in zip(responses, clients):
        response.close()
        http.close()
    elapsed = wait_until(
        lambda: (
            (g := gauges(server.base_url))["kvserve:kv_cache_usage_perc"] == 0
            and g["kvserve:num_requests_running"] == 0
        ),
        timeout=1.0,
    )
    print(f"8 dropped streams: blocks back in {elapsed * 1000:.0f} ms")
    assert_still_serves(server.base_url)


def test_client_leaving_a_non_streamed_request_aborts_it(server, knobs):
    knobs.step_delay = 0.02
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 200, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=0.5)
    wait_until(lambda: gauges(server.base_url)["kvserve:num_requests_running"] == 0, timeout=1.0)
    assert gauges(server.base_url)["kvserve:kv_cache_usage_perc"] == 0


def test_non_streamed_request_dropped_right_away_is_aborted_without_gc(server, knobs):
    """The client hangs up as soon as the request is sent: the abort must not wait for the GC."""
    import gc
    import json as jsonlib
    from urllib.parse import urlparse

    knobs.step_delay = 0.02
    body = jsonlib.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 200, "ignore_eos": True}).encode()
    url = urlparse(server.base_url)
    gc.disable()
    try:
        for _ in range(3):
            with socket.create_connection((url.hostname, url.port)) as sock:
                sock.sendall(
                    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    + f"Content-Length: {len(body)}\r\n\r\n".encode()
                    + body
                )
                time.sleep(0.05)
            time.sleep(0.2)  # let the server take the request in (it may not have been running yet)
            wait_until(lambda: _is_idle(gauges(server.base_url)), timeout=1.0)
    finally:
        gc.enable()


def _is_idle(values: dict[str, float]) -> bool:
    return values["kvserve:num_requests_running"] == 0 and values["kvserve:kv_cache_usage_perc"] == 0


def test_request_timeout_aborts_and_answers_an_error(server, knobs):
    knobs.step_delay = 0.05  # 200 tokens would take 10 s; the timeout is 3 s
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 200, "ignore_eos": True}
    result: dict = {}

    def streamed():
        response = httpx.post(f"{server.base_url}/v1/completions", json={**body, "stream": True}, timeout=30)
        result["events"] = parse_sse(response.text)

    thread = threading.Thread(target=streamed)
    thread.start()
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=30)
    thread.join()
    assert_error_shape(response, 504, type_="timeout_error")
    assert "error" in result["events"][-2] and result["events"][-2]["error"]["code"] == "request_timeout"
    knobs.step_delay = 0.0
    wait_until(lambda: gauges(server.base_url)["kvserve:num_requests_running"] == 0, timeout=1.0)
    assert_still_serves(server.base_url)


# ---- bad requests ----

BAD_COMPLETIONS = [
    ({"prompt": "Hi", "suffix": "x"}, "suffix"),
    ({"prompt": "Hi", "best_of": 3}, "best_of"),
    ({"prompt": "Hi", "temperature": -1}, "temperature"),
    ({"prompt": "Hi", "max_tokens": "ten"}, "max_tokens"),
    ({"prompt": "Hi", "n": 0}, "n"),
    ({"prompt": "Hi", "top_p": 0}, "top_p"),
    ({"prompt": "Hi", "logprobs": 50}, "logprobs"),
    ({"prompt": "Hi", "frobnicate": 1}, "frobnicate"),
    ({}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [999999]}, "prompt"),
    ({"prompt": "Hi", "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"prompt": "Hi", "logit_bias": {"\u00b2": 1}}, "logit_bias"),
    ({"prompt": "Hi", "logit_bias": {"--5": 1}}, "logit_bias"),
    ({"prompt": "Hi", "logit_bias": {"5\u00b2": 1}}, "logit_bias"),
    ({"prompt": "Hi", "logit_bias": {"1" * 40: 1}}, "logit_bias"),
    ({"prompt": "Hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "Hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt": "Hi", "stop": ["x"] * 20}, "stop"),
    ({"prompt": "Hi", "stop": "x" * 1025}, "stop"),
    ({"prompt": "Hi", "stop": ["x", "y" * 1025]}, "stop"),
    # Every number is bounded and strict: a value the engine cannot use never reaches it.
    ({"prompt": "Hi", "top_k": 10**30}, "top_k"),
    ({"prompt": "Hi", "top_k": 2**31}, "top_k"),
    ({"prompt": "Hi", "n": True}, "n"),
    ({"prompt": "Hi", "max_tokens": 10**30}, "max_tokens"),
    ({"prompt": "Hi", "min_tokens": 10**30}, "min_tokens"),
    ({"prompt": "Hi", "seed": 2**64}, "seed"),
    ({"prompt": "Hi", "seed": -1}, "seed"),
    ({"prompt": "Hi", "logprobs": True}, "logprobs"),
    ({"prompt": "Hi", "logit_bias": {"5": 1000}}, "logit_bias"),
    ({"prompt": "Hi", "stop_token_ids": [10**30]}, "stop_token_ids"),
    ({"prompt": [5, True]}, "prompt"),
    ({"prompt": [[5], [True]]}, "prompt"),
]
BAD_CHATS = [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "function", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages.0"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools.0.function"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}}, "response_format.type"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 10**30}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "top_k": 10**30}, "top_k"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
]


@pytest.mark.parametrize(("body", "param"), BAD_COMPLETIONS, ids=[p for _, p in BAD_COMPLETIONS])
def test_bad_completion_fields_get_400_naming_them(server, body, param):
    assert_error_shape(httpx.post(f"{server.base_url}/v1/completions", json=body), 400, param)


@pytest.mark.parametrize(("body", "param"), BAD_CHATS, ids=[p for _, p in BAD_CHATS])
def test_bad_chat_fields_get_400_naming_them(server, body, param):
    assert_error_shape(httpx.post(f"{server.base_url}/v1/chat/completions", json=body), 400, param)


def test_a_huge_top_k_is_refused_without_touching_the_streams_beside_it(server, knobs):
    """A top_k past int64 used to reach the sampler and fail the whole step, and every request in it."""
    knobs.step_delay = 0.02
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 20, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=body) as stream:
            lines = stream.iter_lines()
            next(lines)  # the stream is running
            bad = http.post("/v1/completions", json={"prompt": "Hi", "top_k": 10**30, "max_tokens": 3})
            error = assert_error_shape(bad, 400, "top_k")
            assert "top_k" in error["message"]
            data = [line[len("data: ") :] for line in lines if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert all("error" not in chunk for chunk in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("content", "param", "words"),
    [
        (b'{"prompt": "Hi", "temperature": NaN}', "temperature", "finite"),
        (b'{"prompt": "Hi", "top_p": Infinity}', "top_p", "finite"),
        (b'["Hi"]', None, "request body"),
        (b"", None, "request body"),
    ],
)
def test_validation_messages_name_the_field_or_the_body(server, content, param, words):
    url = f"{server.base_url}/v1/completions"
    response = httpx.post(url, content=content, headers={"content-type": "application/json"})
    error = assert_error_shape(response, 400)
    assert error["param"] == param and words in error["message"], error
    if param:
        assert error["message"].startswith(f"{param}: ")


def test_prompt_too_long_names_the_numbers(server):
    response = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "Hello world", "max_tokens": 1000})
    error = assert_error_shape(response, 400, "max_tokens")
    assert "1000" in error["message"] and "256" in error["message"]


def test_malformed_json_unknown_model_and_routes(server):
    url = f"{server.base_url}/v1/completions"
    assert_error_shape(httpx.post(url, content=b'{"prompt": ', headers={"content-type": "application/json"}), 400)
    error = assert_error_shape(httpx.post(url, json={"model": "gpt-9", "prompt": "Hi"}), 404, "model")
    assert "gpt-9" in error["message"] and MODEL in error["message"]
    assert_error_shape(httpx.get(f"{server.base_url}/v1/nothing-here"), 404)
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="Hi")
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=-1)
    assert_still_serves(server.base_url)


def test_bodies_over_the_limit_get_413(server):
    url = f"{server.base_url}/v1/completions"
    big = {"prompt": "x" * 5000}
    assert_error_shape(httpx.post(url, json=big), 413)

    def chunked():  # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"y" * 1000
        yield b'"}'

    assert_error_shape(httpx.post(url, content=chunked(), headers={"content-type": "application/json"}), 413)
    assert_still_serves(server.base_url)


def test_retry_with_the_same_request_id_is_served(server, knobs):
    """X-Request-Id is for logs only: a retry reusing it while the first is alive is not refused."""
    knobs.step_delay = 0.02
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 200, "ignore_eos": True, "stream": True}
    headers = {"X-Request-Id": "retry-me"}
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=body, headers=headers) as first:
            lines = first.iter_lines()  # keep the iterator: dropping it closes the connection
            next(lines)
            retry = httpx.post(
                f"{server.base_url}/v1/completions",
                headers=headers,
                timeout=30,
                json={"model": MODEL, "prompt": "Hello", "max_tokens": 4, "ignore_eos": True},
            )
    assert retry.status_code == 200, retry.text
    assert retry.headers["x-request-id"] == "retry-me"
    assert retry.json()["usage"]["completion_tokens"] == 4


def test_stream_dropped_before_its_first_chunk_is_aborted(server, knobs):
    """The client leaves while the request is being submitted: the body generator never starts."""
    knobs.step_delay = 0.5  # submit waits for the step in flight to end
    keeper_body = {"model": MODEL, "prompt": "Hello", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=keeper_body) as keeper:
            lines = keeper.iter_lines()
            next(lines)  # the loop is busy stepping now
            body = {
                "model": MODEL,
                "prompt": "The quick brown fox",
                "max_tokens": 200,
                "ignore_eos": True,
                "stream": True,
            }
            send_and_hang_up(server.base_url, "/v1/completions", body, linger=0.15)
            time.sleep(0.5)  # the dropped request got submitted meanwhile
    knobs.step_delay = 0.02
    wait_until(
        lambda: (
            (g := gauges(server.base_url))["kvserve:num_requests_running"] == 0
            and g["kvserve:kv_cache_usage_perc"] == 0
            and state_of(server.app).engine.num_active_requests == 0
        ),
        timeout=2.0,
    )
    assert_still_serves(server.base_url)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stream_whose_first_send_fails_aborts_its_request(model_dir, path):
    """ASGI spec 2.4: a send to a gone client raises OSError. The first chunk (echo / role) is
    yielded before the engine output is ever awaited, so only the response itself can abort."""
    config = make_server_config(model_dir)
    app = create_app(config, engine_factory=flaky_factory)
    if path == "/v1/completions":
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 200, "ignore_eos": True, "stream": True, "echo": True}
    else:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 200,
            "ignore_eos": True,
            "stream": True,
        }
    payload = json.dumps(body).encode()

    async def main():
        async with app.router.lifespan_context(app):
            while not state_of(app).is_ready:
                await asyncio.sleep(0.01)
            engine = state_of(app).engine
            engine.llm_engine.step_delay = 0.02  # 200 tokens take 4 s
            scope = post_scope(path, payload, spec_version="2.4")
            sent = []

            async def receive():
                if not sent:
                    return {"type": "http.request", "body": payload, "more_body": False}
                await asyncio.Event().wait()

            async def send(message):
                sent.append(message["type"])
                if message["type"] == "http.response.body":
                    raise OSError("client gone")

            await app(scope, receive, send)
            assert sent[:2] == ["http.response.start", "http.response.body"]
            deadline = time.monotonic() + 1.0
            while engine.num_active_requests or engine.stats().num_running:
                assert time.monotonic() < deadline, "the abandoned request was not aborted"
                await asyncio.sleep(0.01)
            assert engine.stats().kv_cache_usage == 0

    asyncio.run(main())


# ---- internal errors ----


def test_internal_errors_fail_only_their_request(server, knobs):
    url = f"{server.base_url}/v1/completions"
    knobs.fail_steps = 1
    assert_error_shape(httpx.post(url, json={"prompt": "Hi", "max_tokens": 3}), 500, type_="internal_error")
    knobs.fail_adds = True
    assert_error_shape(httpx.post(url, json={"prompt": "Hi", "max_tokens": 3}), 500, type_="internal_error")
    knobs.fail_adds = False
    assert httpx.get(f"{server.base_url}/health").json() == {"status": "ok"}
    assert_still_serves(server.base_url)


def _stream_payloads(lines) -> list[dict | str]:
    """The `data:` payloads of an SSE stream read line by line (dicts, then "[DONE]")."""
    data = [line[len("data: ") :] for line in lines if line.startswith("data: ")]
    return [d if d == "[DONE]" else json.loads(d) for d in data]


def test_a_failing_request_fails_alone_while_six_streams_go_on(model_dir):
    """A request whose computation raises (here: any batch holding its seed) fails with an error event;
    the six streams sharing its steps finish with exactly the text they get alone."""
    prompts = ["Hello world", "The quick brown fox", "A paged cache", "keys and values", "lazy dog", "0123"]

    def body(prompt: str, **extra) -> dict:
        return {"model": MODEL, "prompt": prompt, "max_tokens": 32, "temperature": 0, "ignore_eos": True, **extra}

    # Its own server: the shared one's 3 s request timeout is too tight for seven streams on a busy machine.
    with ServerThread(create_app(make_server_config(model_dir), engine_factory=flaky_factory)) as srv:
        url = f"{srv.base_url}/v1/completions"
        expected = [httpx.post(url, json=body(p), timeout=30).json()["choices"][0]["text"] for p in prompts]
        knobs = state_of(srv.app).engine.llm_engine
        knobs.step_delay = 0.02  # the six are surely mid-stream when the seventh joins
        knobs.fail_seed = 777
        clients = [httpx.Client(base_url=srv.base_url, timeout=30) for _ in prompts]
        try:
            streams = []
            for http, prompt in zip(clients, prompts):
                request = http.build_request("POST", "/v1/completions", json=body(prompt, stream=True))
                response = http.send(request, stream=True)
                assert response.status_code == 200
                lines = response.iter_lines()
                first = [next(lines)]  # the first chunk: this stream is running
                streams.append((first, lines))
            failing = httpx.post(url, json=body("Hello", stream=True, seed=777), timeout=30)
            events = parse_sse(failing.text)
            texts = []
            for first, lines in streams:
                payloads = _stream_payloads(first + list(lines))
                errors = [p for p in payloads[:-1] if "error" in p]
                assert payloads[-1] == "[DONE]" and not errors, errors
                texts.append("".join(p["choices"][0]["text"] for p in payloads[:-1] if p["choices"]))
        finally:
            for http in clients:
                http.close()
        assert events[-2]["error"]["code"] == "engine_step_failed" and events[-1] == "[DONE]"
        assert texts == expected
        assert httpx.get(f"{srv.base_url}/health").json() == {"status": "ok"}
        wait_until(lambda: gauges(srv.base_url)["kvserve:kv_cache_usage_perc"] == 0, timeout=1.0)


def test_a_broken_model_trips_the_dead_engine_switch(model_dir):
    """Every forward raises: each request fails (the switch counts them although the engine is idle
    between them), and the third failure in a row marks the engine dead."""

    def broken_model(engine_config):
        llm = flaky_factory(engine_config)
        llm.engine.model_broken = True
        return llm

    with ServerThread(create_app(make_server_config(model_dir), engine_factory=broken_model)) as srv:
        url = f"{srv.base_url}/v1/completions"
        statuses = [httpx.post(url, json={"prompt": "Hi", "max_tokens": 2}).status_code for _ in range(3)]
        assert statuses == [500, 500, 503]
        assert httpx.get(f"{srv.base_url}/health").status_code == 503
        assert_error_shape(httpx.post(url, json={"prompt": "Hi"}), 503, type_="service_unavailable")


def test_dead_engine_loop_turns_health_503(model_dir):
    def always_failing(engine_config):
        llm = flaky_factory(engine_config)
        llm.engine.fail_steps = 10**9
        return llm

    with ServerThread(create_app(make_server_config(model_dir), engine_factory=always_failing)) as srv:
        url = f"{srv.base_url}/v1/completions"
        statuses = [httpx.post(url, json={"prompt": "Hi", "max_tokens": 2}).status_code for _ in range(3)]
        assert statuses[0] == 500 and set(statuses) <= {500, 503}
        wait_until(lambda: httpx.get(f"{srv.base_url}/health").status_code == 503, timeout=5)
        assert httpx.get(f"{srv.base_url}/health").json()["status"] == "error"
        assert_error_shape(httpx.post(url, json={"prompt": "Hi"}), 503, type_="service_unavailable")


# ---- auth, CORS, backpressure ----


def test_api_key_is_required_on_every_route_but_health_metrics_included(guarded):
    url = guarded.base_url
    error = assert_error_shape(httpx.get(f"{url}/v1/models"), 401, type_="authentication_error")
    assert error["code"] == "invalid_api_key"
    wrong = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer nope"})
    assert_error_shape(wrong, 401)
    assert wrong.headers["www-authenticate"] == "Bearer"
    assert httpx.get(f"{url}/health").status_code == 200
    # /metrics tells whether a prefix is cached (prefix-cache hits): it needs the key too.
    assert_error_shape(httpx.get(f"{url}/metrics"), 401, type_="authentication_error")
    assert httpx.get(f"{url}/metrics", headers=AUTH).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0).models.list()
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_cors_preflight_and_headers(guarded):
    preflight = httpx.options(
        f"{guarded.base_url}/v1/chat/completions",
        headers={
            "Origin": ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type",
        },
    )
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    response = httpx.get(f"{guarded.base_url}/health", headers={"Origin": ORIGIN})
    assert response.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.get(f"{guarded.base_url}/health", headers={"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in other.headers


def test_full_queue_answers_429_with_retry_after(guarded, monkeypatch):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    text_tokenizer = state_of(guarded.app).text.tokenizer
    encoded: list[str] = []
    real_encode = text_tokenizer.encode
    monkeypatch.setattr(text_tokenizer, "encode", lambda text, **kw: encoded.append(text) or real_encode(text, **kw))
    engine = state_of(guarded.app).engine.llm_engine
    engine.step_delay = 0.01
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 200, "ignore_eos": True, "stream": True}
    http = httpx.Client(base_url=guarded.base_url, headers=headers, timeout=30)
    try:
        running = http.send(http.build_request("POST", "/v1/completions", json=body), stream=True)
        running_lines = running.iter_lines()  # keep the iterator: dropping it closes the connection
        next(running_lines)
        waiting_client = httpx.Client(base_url=guarded.base_url, headers=headers, timeout=30)
        waiting = waiting_client.send(waiting_client.build_request("POST", "/v1/completions", json=body), stream=True)
        assert waiting.status_code == 200
        wait_until(lambda: gauges(guarded.base_url)["kvserve:num_requests_waiting"] == 1, timeout=5)
        num_encoded = len(encoded)
        refused = http.post("/v1/completions", json={**body, "prompt": "refused early", "stream": False})
        assert_error_shape(refused, 429, type_="rate_limit_error")
        assert int(refused.headers["retry-after"]) >= 1
        assert len(encoded) == num_encoded  # refused before its prompt was tokenized
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "refused too"}]}
        assert_error_shape(http.post("/v1/chat/completions", json=chat), 429, type_="rate_limit_error")
        running.close()
        waiting.close()
        waiting_client.close()
    finally:
        engine.step_delay = 0.0
        http.close()
    wait_until(lambda: gauges(guarded.base_url)["kvserve:num_requests_running"] == 0, timeout=2)
    assert_still_serves(guarded.base_url, headers)


def test_sigterm_lets_running_requests_finish_then_exits_0(model_dir, tmp_path):
    proc = ServerProcess(
        [
            "--model",
            str(model_dir),
            "--embedding-model",
            "none",
            "--max-model-len",
            "256",
            "--kv-cache-memory",
            "16MiB",
            "--shutdown-timeout",
            "20",
        ],
        tmp_path / "server.log",
        env={"KVSERVE_SERVED_MODEL_NAME": "from-env", "KVSERVE_LOG_LEVEL": "info"},
    )
    try:
        started = time.monotonic()
        seen = proc.wait_ready(timeout=180)
        print(f"subprocess ready in {time.monotonic() - started:.1f} s")
        assert seen[-1] == 200
        assert httpx.get(f"{proc.base_url}/v1/models").json()["data"][0]["id"] == "from-env"
        body = {"prompt": "Hello", "max_tokens": 200, "ignore_eos": True, "stream": True}
        raw = ""
        with httpx.stream("POST", f"{proc.base_url}/v1/completions", json=body, timeout=60) as response:
            for text in response.iter_text():
                if not raw:
                    proc.terminate()  # mid-stream: after the first chunk
                raw += text
        events = parse_sse(raw)
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        assert proc.wait(timeout=60) == 0
        print(f"subprocess done at {time.monotonic() - started:.1f} s")
        log = proc.log()
        assert "Shutting down" in log
        # One access-log line per request, with status, tokens and latency.
        access_line = r'"POST /v1/completions" 200 [0-9.]+ms prompt_tokens=\d+ completion_tokens=200 request_id='
        assert re.search(access_line, log)
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{proc.base_url}/health", timeout=2)
    finally:
        proc.kill()
