"""Prompt logprobs over HTTP: completions' echo with logprobs (OpenAI's shape, what lm-evaluation-harness
reads), vLLM's prompt_logprobs on completions and chat, and /tokenizer_info. Checked against transformers."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from server.app import create_app
from tests.support.server_harness import ServerThread, make_server_config, parse_sse
from tests.support.tiny_models import load_reference, make_tiny_llama

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def server(model_dir):
    # A 16-token step budget: a prompt of a few dozen tokens is scored over several chunks.
    with ServerThread(create_app(make_server_config(model_dir, max_num_batched_tokens=16))) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference(model_dir):
    return load_reference(model_dir)


def _tokens(server, text: str) -> list[int]:
    return httpx.post(f"{server.base_url}/tokenize", json={"prompt": text}).json()["tokens"]


def _reference_logprobs(reference, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1, vocab]: row j scores token j + 1."""
    with torch.no_grad():
        return reference(torch.tensor([ids])).logits[0, :-1].float().log_softmax(dim=-1)


PROMPT = "Continuous batching lets many requests share one forward pass, and a paged cache holds their keys."


def test_echo_with_logprobs_scores_every_prompt_token_as_transformers_does(server, client, reference):
    ids = _tokens(server, PROMPT)
    answer = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=1, temperature=0, logprobs=2, echo=True
    ).choices[0]
    logprobs = answer.logprobs
    assert len(logprobs.tokens) == len(ids) + 1  # the prompt, then the generated token
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    expected = _reference_logprobs(reference, ids)
    for j in range(1, len(ids)):
        assert logprobs.token_logprobs[j] == pytest.approx(float(expected[j - 1, ids[j]]), abs=1e-4)
        # the token itself and the 2 likeliest (fewer keys when it is one of them)
        assert 2 <= len(logprobs.top_logprobs[j]) <= 3
        assert max(logprobs.top_logprobs[j].values()) == pytest.approx(float(expected[j - 1].max()), abs=1e-4)
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)
    assert answer.text.startswith(PROMPT)


def test_a_streamed_echo_carries_the_same_prompt_logprobs(server, client):
    body = {"model": MODEL, "prompt": [PROMPT, "Short one"], "max_tokens": 3, "temperature": 0, "logprobs": 1}
    whole = client.completions.create(**body, echo=True, n=2)
    streamed = list(client.completions.create(**body, echo=True, n=2, stream=True))
    for choice in whole.choices:
        parts = [c.choices[0] for c in streamed if c.choices and c.choices[0].index == choice.index]
        assert "".join(p.text for p in parts) == choice.text
        assert sum((p.logprobs.tokens for p in parts if p.logprobs), []) == choice.logprobs.tokens
        joined = sum((p.logprobs.token_logprobs for p in parts if p.logprobs), [])
        assert joined == pytest.approx(choice.logprobs.token_logprobs, abs=1e-6)


def test_vllm_prompt_logprobs_on_completions_and_chat(server, client, reference):
    ids = _tokens(server, PROMPT)
    answer = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 3}
    )
    entries = answer.choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    expected = _reference_logprobs(reference, ids)
    for j in range(1, len(ids)):
        entry = entries[j]
        own = entry[str(ids[j])]
        assert own["logprob"] == pytest.approx(float(expected[j - 1, ids[j]]), abs=1e-4)
        assert own["rank"] == int((expected[j - 1] > expected[j - 1, ids[j]]).sum()) + 1
        top_ids = expected[j - 1].topk(3).indices.tolist()
        assert set(entry) == {str(ids[j]), *map(str, top_ids)}
        assert entry[str(top_ids[0])]["rank"] == 1 and entry[str(top_ids[0])]["decoded_token"]

    chat = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "prompt_logprobs": 0},
    ).json()
    rendered = httpx.post(f"{server.base_url}/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()[
        "tokens"
    ]
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == len(rendered)
    assert all(list(e) == [str(t)] for e, t in zip(chat["prompt_logprobs"][1:], rendered[1:]))
    plain = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1}).json()
    assert plain["choices"][0]["prompt_logprobs"] is None


def test_prompt_logprobs_on_a_stream_is_a_400_and_the_server_goes_on(server):
    for path, body in (
        ("/v1/completions", {"prompt": "Hi", "stream": True, "prompt_logprobs": 1}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hi"}], "stream": True, "prompt_logprobs": 1},
        ),
        ("/v1/completions", {"prompt": "Hi", "prompt_logprobs": 21}),
    ):
        response = httpx.post(f"{server.base_url}{path}", json=body)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "prompt_logprobs"
    events = parse_sse(
        httpx.post(
            f"{server.base_url}/v1/completions",
            json={"prompt": "Hi", "stream": True, "echo": True, "logprobs": 0, "max_tokens": 2},
        ).text
    )
    assert events[-1] == "[DONE]"


def test_tokenizer_info_lets_a_client_tokenize_like_the_server(server):
    info = httpx.get(f"{server.base_url}/tokenizer_info").json()
    assert info["eos_token"] and info["model_max_length"] == 256 and info["vocab_size"] > 0
    assert "chat_template" in info and info["tokenizer_class"]
    missing = httpx.get(f"{server.base_url}/tokenizer_info", params={"model": "nope"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
