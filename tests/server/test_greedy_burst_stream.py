"""Greedy bursts through the server: a streamed greedy completion arrives several tokens a chunk with the text a
step-at-a-time request gets (logprobs keep a request out of bursts), a stop string inside a burst cuts the text
where it cuts it without bursts, and the KV blocks all come back, also from clients that leave mid-burst."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from server.app import create_app
from server.state import state_of
from tests.support.native_kernels import needs_kernels
from tests.support.server_harness import ServerThread, make_server_config, parse_sse, send_and_hang_up
from tests.support.tiny_models import make_tiny_llama

MODEL = "tiny-llama"
PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    config = make_server_config(model_dir, quantization="int8", greedy_burst=8, greedy_burst_ms=0)
    with ServerThread(create_app(config)) as srv:
        yield srv


def _stream(server, **body) -> tuple[list[dict], str, str]:
    """(the chunks with text, their text, the finish reason) of a streamed greedy completion."""
    payload = {"model": MODEL, "prompt": PROMPT, "temperature": 0, "stream": True, **body}
    response = httpx.post(f"{server.base_url}/v1/completions", json=payload, timeout=60)
    assert response.status_code == 200, response.text
    events = [e for e in parse_sse(response.text) if isinstance(e, dict) and e.get("choices")]
    chunks = [e for e in events if e["choices"][0]["text"]]
    finish = next(e["choices"][0]["finish_reason"] for e in events if e["choices"][0]["finish_reason"])
    return chunks, "".join(e["choices"][0]["text"] for e in chunks), finish


@needs_kernels
def test_a_streamed_burst_has_the_text_of_steps_one_at_a_time(server):
    runner = state_of(server.app).engine.llm_engine.runner
    assert runner.greedy_burst is not None
    chunks, text, finish = _stream(server, max_tokens=30, ignore_eos=True)
    one_at_a_time, reference, _ = _stream(server, max_tokens=30, ignore_eos=True, logprobs=0)
    assert text == reference and finish == "length"
    assert len(chunks) < len(one_at_a_time)  # several tokens a chunk
    pool = state_of(server.app).engine.llm_engine.pool
    assert pool.num_free_blocks == pool.num_blocks - 1


def _counter(server, name: str) -> float:
    line = next(
        line for line in httpx.get(f"{server.base_url}/metrics").text.splitlines() if line.startswith(f"{name}{{")
    )
    return float(line.rsplit(" ", 1)[1])


@needs_kernels
def test_metrics_count_the_bursts_and_their_tokens(server):
    before = {name: _counter(server, f"kvserve:{name}_total") for name in ("greedy_bursts", "greedy_burst_tokens")}
    generated = _counter(server, "kvserve:generation_tokens_total")
    _stream(server, max_tokens=30, ignore_eos=True)  # the first token from the prefill, then bursts of 8
    bursts = _counter(server, "kvserve:greedy_bursts_total") - before["greedy_bursts"]
    tokens = _counter(server, "kvserve:greedy_burst_tokens_total") - before["greedy_burst_tokens"]
    assert _counter(server, "kvserve:generation_tokens_total") - generated == 30
    assert bursts >= 3 and 3 * 8 <= tokens <= 29
    _stream(server, max_tokens=30, ignore_eos=True, logprobs=0)  # never bursts
    assert _counter(server, "kvserve:greedy_bursts_total") - before["greedy_bursts"] == bursts


@needs_kernels
def test_a_stop_string_inside_a_burst_cuts_the_text_where_steps_one_at_a_time_do(server):
    _, reference, _ = _stream(server, max_tokens=30, ignore_eos=True, logprobs=0)
    stop = reference[len(reference) // 2 : len(reference) // 2 + 3]
    _, text, finish = _stream(server, max_tokens=30, ignore_eos=True, stop=[stop])
    _, expected, _ = _stream(server, max_tokens=30, ignore_eos=True, stop=[stop], logprobs=0)
    assert text == expected == reference[: reference.index(stop)] and finish == "stop"


def _read_first_chunk_and_leave(base_url: str, body: dict) -> None:
    with httpx.Client(base_url=base_url, timeout=30) as http, http.stream("POST", "/v1/completions", json=body) as r:
        next(r.iter_lines())


@needs_kernels
def test_clients_leaving_mid_burst_free_every_block(server):
    """Greedy streams long enough to burst many times, dropped after their first chunk or at moments between:
    the engine ends up with no request, sequence or block, and serves the next request."""
    body = {"model": MODEL, "prompt": PROMPT, "temperature": 0, "max_tokens": 200, "ignore_eos": True}
    clients = [
        threading.Thread(target=send_and_hang_up, args=(server.base_url, "/v1/completions", {**body, "stream": s}, t))
        for t in (0.0, 0.02, 0.1)
        for s in (True, False)
    ]
    clients += [
        threading.Thread(target=_read_first_chunk_and_leave, args=(server.base_url, {**body, "stream": True}))
        for _ in range(3)
    ]
    for client in clients:
        client.start()
    for client in clients:
        client.join(timeout=30)
    engine = state_of(server.app).engine
    deadline = time.monotonic() + 10
    while engine.num_active_requests or engine.stats().num_used_blocks or engine.stats().num_running:
        assert time.monotonic() < deadline, f"still busy: {engine.stats()}"
        time.sleep(0.01)
    _, text, finish = _stream(server, max_tokens=5, ignore_eos=True)
    assert text and finish == "length"
