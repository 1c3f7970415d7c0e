"""Tokenizer work never runs on the event loop: /health and streams go on while a tokenization runs.

The text worker's tokenizer is made to block (as a 2 MB prompt does for over a second) until the
test releases it. Meanwhile /health must answer and a streamed completion of token ids must run to
its end; on the event loop, both would wait for the tokenization.
"""

from __future__ import annotations

import threading

import httpx
import pytest

from server.app import create_app
from server.state import state_of
from tests.support.server_harness import ServerThread, make_server_config, parse_sse
from tests.support.tiny_models import make_tiny_llama

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    with ServerThread(create_app(make_server_config(model_dir))) as srv:
        yield srv


def _blocking(method, started: threading.Event, release: threading.Event):
    def blocked(*args, **kwargs):
        started.set()
        assert release.wait(30), "the test never released the tokenizer"
        return method(*args, **kwargs)

    return blocked


@pytest.mark.parametrize(
    ("route", "body", "method"),
    [
        ("/tokenize", {"prompt": "a very long text"}, "encode"),
        ("/v1/completions", {"prompt": "a very long text", "max_tokens": 2}, "encode"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "long"}], "max_tokens": 2}, "render_chat"),
        ("/detokenize", {"tokens": [1, 2, 3]}, "decode"),
    ],
)
def test_health_and_streams_go_on_while_a_request_is_tokenized(server, monkeypatch, route, body, method):
    text_tokenizer = state_of(server.app).text.tokenizer
    started, release = threading.Event(), threading.Event()
    monkeypatch.setattr(text_tokenizer, method, _blocking(getattr(text_tokenizer, method), started, release))
    answers: list[httpx.Response] = []
    url = f"{server.base_url}{route}"
    slow = threading.Thread(target=lambda: answers.append(httpx.post(url, json={"model": MODEL, **body}, timeout=60)))
    slow.start()
    try:
        assert started.wait(30), "the request never reached the tokenizer"
        with httpx.Client(base_url=server.base_url, timeout=10) as client:
            assert client.get("/health").status_code == 200
            stream = client.post(
                "/v1/completions",
                json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True, "stream": True},
            )
            assert stream.status_code == 200
            events = parse_sse(stream.text)
            assert sum(len(e["choices"]) for e in events if isinstance(e, dict)) >= 4
        assert slow.is_alive() and not answers  # still tokenizing all along
    finally:
        release.set()
        slow.join(60)
    assert answers and answers[0].status_code == 200, answers[0].text if answers else "no answer"
