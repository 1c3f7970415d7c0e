"""Logprob work is priced at admission (--max-request-logprobs): a request that would make the
engine score and the server list hundreds of thousands of logprob entries is a 400 naming the
limit, and a client sending such requests does not slow a neighbour's short completion."""

from __future__ import annotations

import statistics
import threading
import time

import httpx
import pytest

from engine.params import SamplingParams
from server.openai.params import logprob_entries
from tests.support.server_harness import ServerProcess
from tests.support.tiny_models import make_tiny_llama

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
MAX_MODEL_LEN = 256
MAX_LOGPROBS = 20_000


def test_logprob_entries_count_every_listing_in_every_choice():
    params = SamplingParams(n=2, max_tokens=10, logprobs=3, prompt_logprobs=5)
    # Generated: 2 samples x 10 tokens x (3 + 1); the prompt (100 tokens): its prompt_logprobs (5 + 1) and
    # echo's logprobs (3 + 1), each repeated in both choices.
    assert logprob_entries([100], params, MAX_MODEL_LEN, (5, 3), True) == 2 * 10 * 4 + 2 * 100 * (6 + 4)
    assert logprob_entries([100], params, MAX_MODEL_LEN, (5, None), False) == 2 * 10 * 4 + 100 * 6
    # max_tokens unset: the rest of the context; over two prompts.
    unset = SamplingParams(max_tokens=None, logprobs=0)
    assert logprob_entries([100, 56], unset, MAX_MODEL_LEN) == (256 - 100) + (256 - 56)
    assert logprob_entries([100], SamplingParams(max_tokens=10), MAX_MODEL_LEN) == 0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    proc = ServerProcess(
        [
            "--model",
            str(model_dir),
            "--served-model-name",
            MODEL,
            "--embedding-model",
            "none",
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--kv-cache-memory",
            "16MiB",
            "--max-request-logprobs",
            str(MAX_LOGPROBS),
            "--log-level",
            "warning",
        ],
        tmp_path_factory.mktemp("logs") / "server.log",
    )
    try:
        proc.wait_ready(timeout=180)
        yield proc
    finally:
        proc.kill()


def _post(client: httpx.Client, route: str, body: dict) -> httpx.Response:
    return client.post(route, json={"model": MODEL, **body}, timeout=120)


# The request that held the engine for minutes: many long prompts, each scored with 20 alternatives
# and listed twice (prompt_logprobs and echo), for one generated token.
HEAVY = {
    "prompt": [[(7 * p + i) % 200 + 10 for i in range(200)] for p in range(30)],
    "prompt_logprobs": 20,
    "echo": True,
    "logprobs": 20,
    "max_tokens": 1,
}


def _refused(response: httpx.Response, param: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "request_too_large" and error["param"] == param, error
    assert "--max-request-logprobs" in error["message"] and str(MAX_LOGPROBS) in error["message"]


def test_requests_listing_too_many_logprobs_are_refused(server):
    with httpx.Client(base_url=server.base_url) as client:
        _refused(_post(client, "/v1/completions", HEAVY), "logprobs")
        _refused(_post(client, "/v1/completions", {**HEAVY, "logprobs": None, "echo": False}), "prompt_logprobs")
        # Many samples x tokens x alternatives, streamed: the same shape.
        streamed = {"prompt": "Hi", "n": 16, "max_tokens": 200, "logprobs": 20, "stream": True}
        _refused(_post(client, "/v1/completions", streamed), "logprobs")
        # Chat with no max_tokens is priced to the end of the context: 236 x 21 x 5 > 20,000 ...
        messages = [{"role": "user", "content": "Hi"}]
        chat = {"messages": messages, "logprobs": True, "top_logprobs": 20, "n": 5}
        _refused(_post(client, "/v1/chat/completions", chat), "logprobs")
        # ... and admitted once max_tokens bounds it; prompt logprobs under the cap are served.
        assert _post(client, "/v1/chat/completions", {**chat, "max_tokens": 8}).status_code == 200
        light = {**HEAVY, "prompt": HEAVY["prompt"][:2]}  # 2 x 200 x 21 x 2 + 21 entries
        answer = _post(client, "/v1/completions", light)
        assert answer.status_code == 200, answer.text
        assert len(answer.json()["choices"][1]["prompt_logprobs"]) == 200


def _neighbour_seconds(client: httpx.Client, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        response = _post(client, "/v1/completions", {"prompt": "The cat", "max_tokens": 8, "temperature": 0})
        assert response.status_code == 200
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def test_a_client_sending_heavy_logprob_requests_does_not_slow_a_neighbour(server):
    with httpx.Client(base_url=server.base_url) as client:
        _neighbour_seconds(client, 2)  # warm-up
        idle = _neighbour_seconds(client, 7)
        stop = threading.Event()
        statuses: list[int] = []

        def hammer() -> None:
            with httpx.Client(base_url=server.base_url) as heavy:
                while not stop.is_set():  # ten a second: admitted, one alone held the engine for seconds
                    statuses.append(_post(heavy, "/v1/completions", HEAVY).status_code)
                    stop.wait(0.1)

        thread = threading.Thread(target=hammer)
        thread.start()
        try:
            time.sleep(0.2)
            loaded = _neighbour_seconds(client, 7)
        finally:
            stop.set()
            thread.join(timeout=300)
        assert statuses and set(statuses) == {400}
        # 2x the idle time, plus 20 ms for the scheduling noise of two processes on a busy machine.
        assert loaded <= 2 * idle + 0.02, f"neighbour {loaded * 1000:.1f} ms under load vs {idle * 1000:.1f} ms idle"
