"""Each generation tokenizer object is used by one thread only, however many requests use it at once.

Prompt encoding, chat templates, /tokenize and echo run on the text worker with its own copy of
the tokenizer; the streaming detokenizer and logprob token texts run on the event loop with the
engine's; the torch worker never touches text. Hundreds of concurrent requests of every kind
must all succeed, agree with each other, and leave each tokenizer's calls on its one thread.
"""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from server.app import create_app
from server.state import state_of
from tests.support.server_harness import ServerThread, make_server_config, parse_sse
from tests.support.tiny_models import make_tiny_llama

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
NUM_EACH = 100  # requests of each of the three kinds
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
GREEDY = {"model": MODEL, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def _record_threads(tokenizer, monkeypatch) -> set[int]:
    """Wrap every public tokenizer method; the set fills with the ids of the threads that call them."""
    thread_ids: set[int] = set()
    for name in ("encode", "decode", "id_to_token", "render_chat", "apply_chat_template"):
        method = getattr(tokenizer, name)

        def recording(*args, _method=method, **kwargs):
            thread_ids.add(threading.get_ident())
            return _method(*args, **kwargs)

        monkeypatch.setattr(tokenizer, name, recording)
    return thread_ids


async def _streamed_chat(client: httpx.AsyncClient, i: int) -> str:
    body = {**GREEDY, "messages": CHAT, "stream": True, "stop": [f"never-{i}"]}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    events = parse_sse(response.text)
    chunks = [e for e in events if isinstance(e, dict) and e["choices"]]
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in chunks)


async def _tokenized_chat(client: httpx.AsyncClient) -> list[int]:
    response = await client.post("/tokenize", json={"model": MODEL, "messages": CHAT})
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


async def _completion(client: httpx.AsyncClient, i: int) -> dict:
    """Even requests echo their prompt, odd ones ask for token logprobs (token texts)."""
    extra = {"echo": True} if i % 2 == 0 else {"logprobs": 2}
    body = {**GREEDY, "prompt": f"Request {i} says hello", **extra}
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def test_hundreds_of_concurrent_text_requests_use_the_tokenizer_on_one_thread(model_dir, monkeypatch):
    config = make_server_config(model_dir, max_num_seqs=32, max_queued_requests=4 * NUM_EACH)
    app = create_app(config)
    with ServerThread(app) as srv:
        loop_threads = _record_threads(state_of(app).engine.tokenizer, monkeypatch)
        text_threads = _record_threads(state_of(app).text.tokenizer, monkeypatch)
        assert state_of(app).text.tokenizer is not state_of(app).engine.tokenizer

        async def main():
            limits = httpx.Limits(max_connections=64)
            async with httpx.AsyncClient(base_url=srv.base_url, timeout=120, limits=limits) as client:
                expected = await _streamed_chat(client, -1)
                return expected, await asyncio.gather(
                    *(_streamed_chat(client, i) for i in range(NUM_EACH)),
                    *(_tokenized_chat(client) for _ in range(NUM_EACH)),
                    *(_completion(client, i) for i in range(NUM_EACH)),
                )

        expected, results = asyncio.run(main())
        streamed = results[:NUM_EACH]
        tokenized = results[NUM_EACH : 2 * NUM_EACH]
        completions = results[2 * NUM_EACH :]

    assert expected and all(text == expected for text in streamed)  # greedy: every stream says the same
    assert all(tokens == tokenized[0] for tokens in tokenized) and tokenized[0]
    for i, choice in enumerate(completions):
        if i % 2 == 0:
            assert choice["text"].startswith(f"Request {i} says hello")
        else:
            assert len(choice["logprobs"]["tokens"]) == GREEDY["max_tokens"]
    # The detokenizer and logprob texts: the event loop's thread; the routes' text work: the text worker's.
    assert len(loop_threads) == 1 and len(text_threads) == 1
    assert loop_threads != text_threads
    assert threading.get_ident() not in loop_threads | text_threads  # the server's threads, not this test's
