"""Ollama's API (/api/...) through the `ollama` client, on a tiny model whose greedy answer is a fixed script
(tests/support/thinking_model.py) and the default embedding model where it is cached: answers equal
chat's for the same conversation, streamed and whole, thinking apart from the answer, `format` through
structured output, tool calls, options mapped (num_predict, stop, num_ctx), generate's raw prompts and
`context`, the model routes, embeddings equal /v1/embeddings', and errors in Ollama's shape."""

from __future__ import annotations

import dataclasses
import json
import math

import anthropic
import httpx
import ollama
import pytest

from server.app import create_app
from server.state import state_of
from tests.support.flaky_engine import flaky_factory
from tests.support.server_harness import ServerThread, make_server_config, parse_sse
from tests.support.thinking_model import make_thinking_model, thinking_server_config

pytestmark = pytest.mark.slow

THOUGHT, ANSWER = "quick fox", "Hello world"
SCRIPT = f"<think>{THOUGHT}</think>{ANSWER}"
EMBEDDING_MODEL = "all-minilm-l6-v2"
ASK = [{"role": "user", "content": "What is 2 + 3?"}]
GREEDY = {"temperature": 0}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Adds two numbers",
        "parameters": {
            "type": "object",
            "properties": {"a": {"enum": [1, 2]}, "b": {"enum": [3, 4]}},
            "required": ["a", "b"],
        },
    },
}


@pytest.fixture(scope="module")
def serves_embeddings() -> bool:
    from engine.hub import models_hub

    return models_hub.is_cached(EMBEDDING_MODEL)


@pytest.fixture(scope="module")
def server(tmp_path_factory, serves_embeddings):
    from engine.config import EmbedderConfig

    config = thinking_server_config(
        tmp_path_factory.mktemp("thinker"), SCRIPT, max_model_len=512, served_model_name=("tiny-thinker", "alias")
    )
    if serves_embeddings:
        config = dataclasses.replace(config, embedder=EmbedderConfig(model=EMBEDDING_MODEL, max_model_len=64))
    with ServerThread(create_app(config, engine_factory=flaky_factory)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server.base_url)


def chat(server, **fields) -> dict:
    body = {"model": "tiny-thinker", "messages": ASK, "max_tokens": 40, "temperature": 0, **fields}
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_chat_answers_equal_chats_whole_and_streamed(server, client):
    expected = chat(server)
    answer = client.chat(model="tiny-thinker", messages=ASK, options=GREEDY, stream=False)
    assert answer.message.role == "assistant" and answer.message.content == expected["choices"][0]["message"]["content"]
    assert answer.done and answer.done_reason == "stop" and answer.model == "tiny-thinker"
    assert answer.prompt_eval_count == expected["usage"]["prompt_tokens"]
    assert answer.eval_count == expected["usage"]["completion_tokens"]
    assert answer.total_duration >= answer.prompt_eval_duration + answer.eval_duration > 0

    lines = list(client.chat(model="alias:latest", messages=ASK, options=GREEDY, stream=True))
    assert [line.done for line in lines] == [False] * (len(lines) - 1) + [True]
    assert "".join(line.message.content for line in lines) == answer.message.content
    assert lines[-1].message.content == "" and lines[-1].eval_count == answer.eval_count
    assert lines[0].model == "alias:latest"  # the name the client used

    raw = httpx.post(f"{server.base_url}/api/chat", json={"model": "tiny-thinker", "messages": ASK}, timeout=60)
    assert raw.headers["content-type"].startswith("application/x-ndjson")  # streamed unless told not to
    assert all(json.loads(line)["model"] == "tiny-thinker" for line in raw.text.splitlines())


def test_thinking_comes_apart_from_the_answer(client):
    whole = client.chat(model="tiny-thinker", messages=ASK, options=GREEDY, think=True, stream=False)
    assert (whole.message.thinking, whole.message.content) == (THOUGHT, ANSWER)
    lines = list(client.chat(model="tiny-thinker", messages=ASK, options=GREEDY, think=True, stream=True))
    thought = "".join(line.message.thinking or "" for line in lines)
    assert (thought, "".join(line.message.content for line in lines)) == (THOUGHT, ANSWER)
    effort = client.chat(model="tiny-thinker", messages=ASK, options=GREEDY, think="high", stream=False)
    assert effort.message.thinking == THOUGHT  # an effort switches the template's thinking on
    off = client.chat(model="tiny-thinker", messages=ASK, options=GREEDY, think=False, stream=False)
    assert off.message.thinking is None


@pytest.mark.parametrize("stream", [False, True])
def test_format_constrains_the_answer_after_the_thought(client, stream):
    schema = {"enum": ["yes", "no"]}
    fields = {"model": "tiny-thinker", "messages": ASK, "options": GREEDY, "think": True, "format": schema}
    if stream:
        lines = list(client.chat(stream=True, **fields))
        thought = "".join(line.message.thinking or "" for line in lines)
        text = "".join(line.message.content for line in lines)
    else:
        answer = client.chat(stream=False, **fields)
        thought, text = answer.message.thinking, answer.message.content
    assert thought == THOUGHT and json.loads(text) in ("yes", "no")
    as_json = client.chat(model="tiny-thinker", messages=ASK, options={**GREEDY, "num_predict": 60}, format="json")
    assert as_json.done_reason == "length" or isinstance(json.loads(as_json.message.content), dict)


@pytest.fixture(scope="module")
def caller(tmp_path_factory):
    """A model that calls a tool: its script opens a generic tool reply (`{"tool`, then `}]`), and the
    grammar writes the rest of one call."""
    model_dir = make_thinking_model(tmp_path_factory.mktemp("caller"), '{"tool}]', max_position_embeddings=2048)
    with ServerThread(create_app(make_server_config(model_dir, max_model_len=512))) as srv:
        yield srv


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_call_is_chats(caller, stream):
    """Ollama has no tool_choice: the model answers or calls (chat's `auto`), and its reply is chat's."""
    ask = [{"role": "user", "content": "What is 1 + 3?"}]
    expected = chat(caller, model="tiny-llama", messages=ask, tools=[ADD], max_tokens=None)["choices"][0]
    assert expected["finish_reason"] == "tool_calls"
    client = ollama.Client(host=caller.base_url)
    fields = {"model": "tiny-llama", "messages": ask, "tools": [ADD], "options": GREEDY}
    if stream:
        lines = list(client.chat(stream=True, **fields))
        assert lines[-1].done and lines[-1].done_reason == "stop"
        content = "".join(line.message.content for line in lines)
        calls = [call for line in lines for call in (line.message.tool_calls or [])]
    else:
        message = client.chat(stream=False, **fields).message
        content, calls = message.content, list(message.tool_calls or [])
    assert content == ""
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in expected["message"]["tool_calls"]
    ]


def test_a_conversation_with_a_tool_round_trip_is_chats(server, client):
    ask = [{"role": "user", "content": "What is 1 + 3?"}]
    call = {"function": {"name": "add", "arguments": {"a": 1, "b": 3}}}
    turns = [
        *ask,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "4", "tool_name": "add"},
    ]
    second = client.chat(model="tiny-thinker", messages=turns, tools=[ADD], options=GREEDY, stream=False)
    chat_turns = [
        *ask,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1_0", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 3}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1_0", "content": "4"},
    ]
    expected = chat(server, messages=chat_turns, tools=[ADD], max_tokens=None)
    assert second.prompt_eval_count == expected["usage"]["prompt_tokens"]
    assert second.message.content == (expected["choices"][0]["message"]["content"] or "")


def test_options_are_mapped(server, client):
    cut = client.chat(model="tiny-thinker", messages=ASK, options={**GREEDY, "num_predict": 2}, stream=False)
    assert cut.done_reason == "length" and cut.eval_count == 2
    stopped = client.chat(model="tiny-thinker", messages=ASK, options={**GREEDY, "stop": ["world"]}, stream=False)
    assert stopped.message.content == chat(server, stop=["world"])["choices"][0]["message"]["content"]
    prompt_tokens = cut.prompt_eval_count
    room = client.chat(model="tiny-thinker", messages=ASK, options={**GREEDY, "num_ctx": prompt_tokens + 3})
    assert room.done_reason == "length" and room.eval_count == 3
    for options, param in (({"num_ctx": 513}, "num_ctx"), ({"mirostat": 2}, "mirostat"), ({"no_such": 1}, "no_such")):
        with pytest.raises(ollama.ResponseError) as refused:
            client.chat(model="tiny-thinker", messages=ASK, options=options, stream=False)
        assert refused.value.status_code == 400 and param in refused.value.error
    sampled = [
        client.chat(model="tiny-thinker", messages=ASK, options={"seed": 7, "temperature": 1.0}).message.content
        for _ in range(2)
    ]
    assert sampled[0] == sampled[1]


def test_generate_renders_the_template_or_takes_a_raw_prompt_and_carries_context(server, client):
    answer = client.generate(model="tiny-thinker", prompt="What is 2 + 3?", options=GREEDY, stream=False)
    assert answer.response == chat(server)["choices"][0]["message"]["content"]
    assert (
        answer.context[: answer.prompt_eval_count]
        and len(answer.context) == answer.prompt_eval_count + answer.eval_count
    )
    streamed = list(client.generate(model="tiny-thinker", prompt="What is 2 + 3?", options=GREEDY, stream=True))
    assert "".join(line.response for line in streamed) == answer.response
    assert streamed[-1].context == answer.context

    raw = client.generate(model="tiny-thinker", prompt="Hello", raw=True, options={**GREEDY, "num_predict": 3})
    completion = httpx.post(
        f"{server.base_url}/v1/completions",
        json={"prompt": "Hello", "max_tokens": 3, "temperature": 0},
        timeout=60,
    ).json()
    assert (
        raw.response == completion["choices"][0]["text"]
        and raw.prompt_eval_count == completion["usage"]["prompt_tokens"]
    )
    follow = client.generate(model="tiny-thinker", prompt="Again?", context=answer.context, options=GREEDY)
    assert follow.prompt_eval_count > len(answer.context)
    loaded = client.generate(model="tiny-thinker", prompt="")
    assert loaded.done and loaded.done_reason == "load" and loaded.response == ""


def test_the_model_routes(server, client, serves_embeddings):
    assert httpx.get(f"{server.base_url}/api/version").json()["version"].count(".") == 2
    listed = client.list().models
    names = [model.model for model in listed]
    assert names[:2] == ["tiny-thinker", "alias"] and (EMBEDDING_MODEL in names) == serves_embeddings
    assert listed[0].size > 0 and listed[0].details.format == "safetensors" and listed[0].details.family == "llama"
    assert listed[0].details.quantization_level == "NONE"  # the method the weights run under, auto resolved
    shown = client.show("tiny-thinker")
    assert shown.capabilities == ["completion", "tools", "thinking"]
    assert shown.modelinfo["llama.context_length"] == 512 and "enable_thinking" in shown.template
    assert shown.modelinfo["general.parameter_count"] > 0
    running = client.ps().models
    assert [model.model for model in running] == names and running[0].context_length == 512
    if serves_embeddings:
        assert client.show(EMBEDDING_MODEL).capabilities == ["embedding"]
    with pytest.raises(ollama.ResponseError) as missing:
        client.show("no-such-model")
    assert missing.value.status_code == 404 and "no-such-model" in missing.value.error


def test_embeddings_equal_the_openai_routes(server, client, serves_embeddings):
    if not serves_embeddings:
        pytest.skip(f"{EMBEDDING_MODEL} is not cached")
    texts = ["a cat", "a dog"]
    answer = client.embed(model=EMBEDDING_MODEL, input=texts)
    reference = httpx.post(f"{server.base_url}/v1/embeddings", json={"input": texts}, timeout=60).json()
    for vector, item in zip(answer.embeddings, reference["data"], strict=True):
        assert max(abs(a - b) for a, b in zip(vector, item["embedding"], strict=True)) < 1e-5
        assert math.isclose(sum(v * v for v in vector), 1.0, rel_tol=1e-4)
    assert answer.prompt_eval_count == reference["usage"]["prompt_tokens"]
    single = client.embeddings(model=EMBEDDING_MODEL, prompt="a cat").embedding
    raw = httpx.post(f"{server.base_url}/embed", json={"inputs": "a cat", "normalize": False}, timeout=60).json()[0]
    assert max(abs(a - b) for a, b in zip(single, raw, strict=True)) < 1e-5
    with pytest.raises(ollama.ResponseError) as too_long:
        client.embed(model=EMBEDDING_MODEL, input="word " * 200, truncate=False)
    assert too_long.value.status_code == 400


def test_errors_come_in_ollamas_shape(server, client):
    with pytest.raises(ollama.ResponseError) as missing:
        client.chat(model="no-such-model", messages=ASK, stream=False)
    assert missing.value.status_code == 404
    response = httpx.post(f"{server.base_url}/api/chat", json={"model": "tiny-thinker", "messages": ASK, "x": 1})
    assert response.status_code == 400 and set(response.json()) == {"error"} and "x" in response.json()["error"]
    image = [{"role": "user", "content": "see", "images": ["AAAA"]}]
    with pytest.raises(ollama.ResponseError) as unread:
        client.chat(model="tiny-thinker", messages=image, stream=False)
    assert unread.value.status_code == 400 and "images" in unread.value.error
    with pytest.raises(ollama.ResponseError) as fim:
        client.generate(model="tiny-thinker", prompt="def f(", suffix="return 1")
    assert "suffix" in fim.value.error
    loaded = client.chat(model="tiny-thinker", messages=[])
    assert loaded.done_reason == "load"
    # Ollama's own docs post with `curl -d`: a form content type (or none), the body JSON all the same
    form = {"content-type": "application/x-www-form-urlencoded"}
    body = json.dumps({"model": "tiny-thinker", "messages": ASK, "stream": False, "options": {"num_predict": 2}})
    answer = httpx.post(f"{server.base_url}/api/chat", content=body, headers=form, timeout=60)
    assert answer.status_code == 200 and answer.json()["done_reason"] == "length"


def test_a_stream_that_fails_ends_with_an_error_line(server, client):
    engine = state_of(server.app).engine.llm_engine
    engine.fail_seed = 777  # the model runner raises for a batch holding this request; the engine goes on
    failing = {"model": "tiny-thinker", "messages": ASK, "options": {"seed": 777}}
    try:
        response = httpx.post(f"{server.base_url}/api/chat", json=failing, timeout=60)
        with pytest.raises(ollama.ResponseError):
            list(client.chat(stream=True, **failing))
    finally:
        engine.fail_seed = None
    lines = [json.loads(line) for line in response.text.splitlines()]
    assert response.status_code == 200 and set(lines[-1]) == {"error"} and lines[-1]["error"]
    assert not any(line.get("done") for line in lines)
    assert client.chat(model="tiny-thinker", messages=ASK, options={"num_predict": 2}).done_reason == "length"


def test_a_tool_reply_cut_at_the_limit_ends_for_length_in_every_api(caller):
    """Cut mid-call, the call is unfinished: every API says the limit ended the reply, streamed or not."""
    ask = [{"role": "user", "content": "What is 1 + 3?"}]
    body = {"model": "tiny-llama", "messages": ask, "tools": [ADD], "max_tokens": 40, "temperature": 0}
    for stream in (False, True):
        response = httpx.post(f"{caller.base_url}/v1/chat/completions", json={**body, "stream": stream}, timeout=60)
        if stream:
            reasons = [c["choices"][0]["finish_reason"] for c in parse_sse(response.text)[:-1] if c["choices"]]
            assert reasons[-1] == "length", reasons
        else:
            assert response.json()["choices"][0]["finish_reason"] == "length"
    claude = anthropic.Anthropic(base_url=caller.base_url, api_key="unused", max_retries=0)
    tool = {"name": "add", "input_schema": ADD["function"]["parameters"]}
    fields = {"model": "tiny-llama", "max_tokens": 40, "messages": ask, "tools": [tool], "extra_body": GREEDY}
    assert claude.messages.create(tool_choice={"type": "any"}, **fields).stop_reason == "max_tokens"
    with claude.messages.stream(tool_choice={"type": "any"}, **fields) as events:
        assert events.get_final_message().stop_reason == "max_tokens"
    local = ollama.Client(host=caller.base_url)
    options = {**GREEDY, "num_predict": 40}
    assert local.chat(model="tiny-llama", messages=ask, tools=[ADD], options=options).done_reason == "length"


def test_think_needs_a_reasoning_parser_and_format_excludes_tools(caller, client):
    plain = ollama.Client(host=caller.base_url)
    with pytest.raises(ollama.ResponseError) as refused:
        plain.chat(model="tiny-llama", messages=ASK, think=True)
    assert refused.value.status_code == 400 and "--reasoning-parser" in refused.value.error
    assert plain.chat(model="tiny-llama", messages=ASK, think=False, options={"num_predict": 2}).done
    with pytest.raises(ollama.ResponseError) as both:
        client.chat(model="tiny-thinker", messages=ASK, tools=[ADD], format="json")
    assert both.value.status_code == 400 and "format" in both.value.error
    by_old_name = httpx.post(f"{caller.base_url}/api/show", json={"name": "tiny-llama:latest"}, timeout=10).json()
    assert by_old_name["capabilities"] == ["completion", "tools"]  # no --reasoning-parser: no thinking
