"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) through the `anthropic` SDK, on a tiny
model whose greedy answer is a fixed script (tests/support/thinking_model.py): answers equal chat's for the
same conversation, thinking blocks from the reasoning parser, the stream's event order, a tool-use round
trip, stop sequences, token counts, the x-api-key header and errors in Anthropic's shape."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from server.app import create_app
from server.state import state_of
from tests.support.flaky_engine import flaky_factory
from tests.support.server_harness import ServerThread, parse_named_sse
from tests.support.thinking_model import thinking_server_config

pytestmark = pytest.mark.slow

THOUGHT, ANSWER = "quick fox", "Hello world"
SCRIPT = f"<think>{THOUGHT}</think>{ANSWER}"
KEY = "sk-messages"
THINK = {"type": "enabled", "budget_tokens": 1024}
ONE_CALL = {"type": "any", "disable_parallel_tool_use": True}
GREEDY = {"temperature": 0}  # older SDKs' field (the current one leaves sampling to the server)
ASK = [{"role": "user", "content": "What is 2 + 3?"}]
ADD = {
    "name": "add",
    "description": "Adds two numbers",
    "input_schema": {
        "type": "object",
        "properties": {"a": {"enum": [1, 2]}, "b": {"enum": [3, 4]}},
        "required": ["a", "b"],
    },
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    config = thinking_server_config(
        tmp_path_factory.mktemp("thinker"), SCRIPT, served_model_name=("tiny-thinker", "claude-local"), api_key=KEY
    )
    with ServerThread(create_app(config, engine_factory=flaky_factory)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.base_url, api_key=KEY, max_retries=0)


def chat(server, **fields) -> dict:
    body = {"model": "tiny-thinker", "messages": ASK, "max_tokens": 40, "temperature": 0, **fields}
    headers = {"Authorization": f"Bearer {KEY}"}
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_an_answer_equals_chats_and_thinking_comes_as_its_block(server, client):
    plain = client.messages.create(model="claude-local", max_tokens=40, messages=ASK, extra_body=GREEDY)
    expected = chat(server)["choices"][0]["message"]["content"]
    assert [block.type for block in plain.content] == ["text"] and plain.content[0].text == expected
    assert plain.stop_reason == "end_turn" and plain.model == "tiny-thinker" and plain.role == "assistant"
    assert plain.usage.input_tokens == chat(server)["usage"]["prompt_tokens"]

    thought = client.messages.create(
        model="claude-local", max_tokens=40, messages=ASK, thinking=THINK, extra_body=GREEDY
    )
    assert [block.type for block in thought.content] == ["thinking", "text"]
    assert (thought.content[0].thinking, thought.content[1].text) == (THOUGHT, ANSWER)
    reference = chat(server, chat_template_kwargs={"enable_thinking": True})
    assert thought.usage.output_tokens == reference["usage"]["completion_tokens"]


def test_the_stream_sends_anthropics_event_sequence(server, client):
    with client.messages.stream(
        model="tiny-thinker", max_tokens=40, messages=ASK, thinking=THINK, extra_body=GREEDY
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [event.type for event in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    starts = [event.content_block.type for event in events if event.type == "content_block_start"]
    assert starts == ["thinking", "text"] and kinds.count("content_block_stop") == 2
    thought = "".join(e.delta.thinking for e in events if e.type == "content_block_delta" and e.index == 0)
    answer = "".join(e.delta.text for e in events if e.type == "content_block_delta" and e.index == 1)
    assert (thought, answer) == (THOUGHT, ANSWER)
    assert [block.type for block in final.content] == ["thinking", "text"] and final.stop_reason == "end_turn"
    whole = client.messages.create(model="tiny-thinker", max_tokens=40, messages=ASK, thinking=THINK, extra_body=GREEDY)
    assert final.usage.output_tokens == whole.usage.output_tokens and [b.to_dict() for b in final.content] == [
        b.to_dict() for b in whole.content
    ]

    # the raw wire: every event named after its type, no [DONE]
    body = {"model": "tiny-thinker", "max_tokens": 3, "messages": ASK, "stream": True}
    response = httpx.post(f"{server.base_url}/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60)
    data = parse_named_sse(response.text)
    names = [event["type"] for event in data]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert data[-2]["delta"]["stop_reason"] == "max_tokens" and data[-2]["usage"] == {
        "output_tokens": 3,
        "output_tokens_details": {"thinking_tokens": 0},
    }


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_use_round_trip(server, client, stream):
    ask = [{"role": "user", "content": "What is 1 + 3?"}]
    fields = {"model": "tiny-thinker", "max_tokens": 200, "tools": [ADD], "extra_body": GREEDY}
    if stream:
        with client.messages.stream(messages=ask, tool_choice=ONE_CALL, **fields) as stream:
            events = list(stream)
            first = stream.get_final_message()
        opened = [e.content_block.type for e in events if e.type == "content_block_start"]
        fragments = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
        assert opened == ["tool_use"] and len(fragments) > 1  # the input streams in pieces as it is generated
        assert json.loads("".join(fragments)) == first.content[0].input
    else:
        first = client.messages.create(messages=ask, tool_choice=ONE_CALL, **fields)
    assert first.stop_reason == "tool_use"
    (call,) = [block for block in first.content if block.type == "tool_use"]
    assert call.name == "add" and call.input["a"] in (1, 2) and call.input["b"] in (3, 4)

    result = {"type": "tool_result", "tool_use_id": call.id, "content": "4"}
    turns = [*ask, {"role": "assistant", "content": first.content}, {"role": "user", "content": [result]}]
    second = client.messages.create(messages=turns, **fields)
    chat_turns = [
        *ask,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": call.id, "type": "function", "function": {"name": "add", "arguments": json.dumps(call.input)}}
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "4"},
    ]
    tools = [
        {
            "type": "function",
            "function": {"name": "add", "description": ADD["description"], "parameters": ADD["input_schema"]},
        }
    ]
    expected = chat(server, messages=chat_turns, tools=tools, max_tokens=200)
    assert second.usage.input_tokens == expected["usage"]["prompt_tokens"]
    text = "".join(block.text for block in second.content if block.type == "text")
    assert text == (expected["choices"][0]["message"]["content"] or "")


def test_stop_sequences_and_count_tokens(server, client):
    cut = client.messages.create(
        model="tiny-thinker", max_tokens=40, messages=ASK, stop_sequences=["world"], extra_body=GREEDY
    )
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == "world"
    assert cut.content[0].text == chat(server, stop=["world"])["choices"][0]["message"]["content"]
    counted = client.messages.count_tokens(model="tiny-thinker", messages=ASK, system="Be brief.", tools=[ADD])
    answered = client.messages.create(
        model="tiny-thinker", max_tokens=1, messages=ASK, system="Be brief.", tools=[ADD], extra_body=GREEDY
    )
    assert counted.input_tokens == answered.usage.input_tokens
    assert counted.input_tokens > client.messages.count_tokens(model="tiny-thinker", messages=ASK).input_tokens


def test_a_max_tokens_past_the_context_is_held_to_the_room_left(client):
    """Anthropic's clients (coding agents) ask for 32,000 tokens and more: the answer ends where it ends."""
    with client.messages.stream(model="tiny-thinker", max_tokens=64_000, messages=ASK, extra_body=GREEDY) as stream:
        answer = stream.get_final_message()  # the SDK streams a request this large
    assert answer.stop_reason == "end_turn" and answer.content[0].text == SCRIPT
    with pytest.raises(anthropic.BadRequestError) as full:
        client.messages.create(model="tiny-thinker", max_tokens=4, messages=[{"role": "user", "content": "hi " * 3000}])
    assert "context" in full.value.body["error"]["message"]


def test_errors_come_in_anthropics_shape(server, client):
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="claude-opus", max_tokens=4, messages=ASK)
    assert missing.value.body["type"] == "error" and missing.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model="tiny-thinker", max_tokens=4, messages=ASK, extra_body={"temperature": 1.5})
    assert (
        bad.value.body["error"]["type"] == "invalid_request_error"
        and "temperature" in bad.value.body["error"]["message"]
    )
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    with pytest.raises(anthropic.BadRequestError) as unread:
        client.messages.create(model="tiny-thinker", max_tokens=4, messages=[{"role": "user", "content": [image]}])
    assert "image blocks are not supported" in unread.value.body["error"]["message"]
    with pytest.raises(anthropic.AuthenticationError) as keyless:
        anthropic.Anthropic(base_url=server.base_url, api_key="wrong", max_retries=0).messages.create(
            model="tiny-thinker", max_tokens=4, messages=ASK
        )
    assert keyless.value.body["error"]["type"] == "authentication_error"
    # the OpenAI routes keep their own shape
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json={"messages": ASK}, timeout=10)
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    assert client.messages.create(model="tiny-thinker", max_tokens=4, messages=ASK).stop_reason == "max_tokens"


def test_output_config_constrains_the_answer_after_the_thought(client):
    config = {"effort": "high", "format": {"type": "json_schema", "schema": {"enum": ["yes", "no"]}}}
    answer = client.messages.create(
        model="tiny-thinker", max_tokens=40, messages=ASK, output_config=config, extra_body=GREEDY
    )
    thinking, text = answer.content  # effort turns the template's thinking on over the server's default
    assert thinking.thinking == THOUGHT and json.loads(text.text) in ("yes", "no")
    assert answer.usage.output_tokens_details.thinking_tokens == 6  # <think> qu ick ' fo' x </think>
    with pytest.raises(anthropic.BadRequestError) as both:
        client.messages.create(model="tiny-thinker", max_tokens=4, messages=ASK, output_config=config, tools=[ADD])
    assert "output_config.format" in both.value.body["error"]["message"]


def test_a_stream_that_fails_ends_with_an_error_event(server, client):
    engine = state_of(server.app).engine.llm_engine
    engine.fail_steps = 1  # the step computing this request raises; the engine goes on
    body = {"model": "tiny-thinker", "max_tokens": 8, "messages": ASK, "stream": True}
    response = httpx.post(f"{server.base_url}/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60)
    events = parse_named_sse(response.text)
    assert [event["type"] for event in events[:2]] == ["message_start", "ping"]
    assert events[-1] == {"type": "error", "error": {"type": "api_error", "message": events[-1]["error"]["message"]}}
    assert "message_stop" not in [event["type"] for event in events]
    assert client.messages.create(model="tiny-thinker", max_tokens=4, messages=ASK).stop_reason == "max_tokens"
