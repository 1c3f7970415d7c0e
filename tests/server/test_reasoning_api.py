"""Reasoning models through chat and Responses (--reasoning-parser think), on a tiny model whose greedy
answer is a fixed script (tests/support/thinking_model.py): the thought apart from the answer, whole and
streamed; chat_template_kwargs, --default-chat-template-kwargs and reasoning_effort switching thinking off;
structured output and tool calls applied after the thought; the thinking's token count. Also the OpenAI
fields that carry no generation semantics, and --served-model-name aliases."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from server.app import create_app
from tests.support.server_harness import ServerThread, make_server_config, parse_sse
from tests.support.thinking_model import OPENING_TEMPLATE, make_thinking_model, thinking_server_config
from tests.support.tiny_models import make_tiny_llama

pytestmark = pytest.mark.slow

THOUGHT, ANSWER = "quick fox", "Hello world"
SCRIPT = f"<think>{THOUGHT}</think>{ANSWER}"  # <think> qu ick ' fo' x </think> ...: 6 thinking tokens
THINKING_TOKENS = 6
THINK = {"chat_template_kwargs": {"enable_thinking": True}}  # the server's default turns thinking off
ASK = [{"role": "user", "content": "What is 2 + 3?"}]
YES_NO = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"enum": ["yes", "no"]}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    config = thinking_server_config(
        tmp_path_factory.mktemp("thinker"), SCRIPT, served_model_name=("tiny-thinker", "alias")
    )
    with ServerThread(create_app(config)) as srv:
        yield srv


@pytest.fixture(scope="module")
def opening_server(tmp_path_factory):
    """A template that opens the thinking block itself, so the output holds only its end tag."""
    model_dir = make_thinking_model(tmp_path_factory.mktemp("opener"), f"{THOUGHT}</think>{ANSWER}", OPENING_TEMPLATE)
    with ServerThread(create_app(make_server_config(model_dir, reasoning_parser="deepseek_r1"))) as srv:
        yield srv


def chat(server, **fields) -> httpx.Response:
    body = {"messages": ASK, "max_tokens": 40, "temperature": 0, **fields}
    return httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)


def streamed(server, **fields) -> tuple[list[dict], dict]:
    body = {"messages": ASK, "max_tokens": 40, "temperature": 0, "stream": True, **fields}
    body["stream_options"] = {"include_usage": True}
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    chunks = [c for c in parse_sse(response.text) if isinstance(c, dict)]
    return [c["choices"][0]["delta"] for c in chunks if c["choices"]], chunks[-1]["usage"]


def test_the_thought_is_apart_from_the_answer(server):
    response = chat(server, **THINK)
    assert response.status_code == 200, response.text
    body = response.json()
    message = body["choices"][0]["message"]
    assert (message["reasoning_content"], message["reasoning"], message["content"]) == (THOUGHT, THOUGHT, ANSWER)
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": THINKING_TOKENS}


def test_the_streamed_thought_comes_first_and_adds_up_to_the_whole(server):
    deltas, usage = streamed(server, **THINK)
    thought = "".join(d.get("reasoning_content", "") for d in deltas)
    answer = "".join(d.get("content") or "" for d in deltas)
    assert (thought, answer) == (THOUGHT, ANSWER)
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
    kinds = [("r" if d.get("reasoning_content") else "") + ("c" if d.get("content") else "") for d in deltas]
    kinds = [k for k in kinds if k]
    assert kinds == sorted(kinds, key=lambda k: k != "r"), kinds  # no answer text before the last thought
    assert usage["completion_tokens_details"] == {"reasoning_tokens": THINKING_TOKENS}


@pytest.mark.parametrize(
    "fields",
    [{}, {"reasoning_effort": "none"}, {"chat_template_kwargs": {"enable_thinking": True}, "reasoning_effort": "none"}],
    ids=["server-default", "reasoning-effort-none", "request-kwargs-win"],
)
def test_thinking_switched_off_gives_the_output_as_content(server, fields):
    """The template closes an empty block in the prompt, so whatever the model writes is its answer."""
    message = chat(server, **fields).json()["choices"][0]["message"]
    if fields.get("chat_template_kwargs"):
        assert message["reasoning_content"] == THOUGHT  # the request's enable_thinking beats the effort's
    else:
        assert "reasoning_content" not in message and message["content"] is not None


def test_reasoning_effort_turns_thinking_on_over_the_server_default(server):
    message = chat(server, reasoning_effort="low").json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (THOUGHT, ANSWER)


@pytest.mark.parametrize("stream", [False, True])
def test_structured_output_applies_to_the_answer_after_the_thought(server, stream):
    """The grammar leaves the thinking free (its script comes out whole) and constrains what follows."""
    fields = {**THINK, "response_format": YES_NO}
    if stream:
        deltas, usage = streamed(server, **fields)
        thought = "".join(d.get("reasoning_content", "") for d in deltas)
        answer = "".join(d.get("content") or "" for d in deltas)
    else:
        body = chat(server, **fields).json()
        thought, answer = body["choices"][0]["message"]["reasoning_content"], body["choices"][0]["message"]["content"]
        usage = body["usage"]
    assert thought == THOUGHT
    assert json.loads(answer) in ("yes", "no")
    assert usage["completion_tokens_details"] == {"reasoning_tokens": THINKING_TOKENS}


def test_a_constrained_tool_call_follows_the_thought(server):
    tool = {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"enum": [1, 2]}, "b": {"enum": [3, 4]}},
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    }
    response = chat(server, **THINK, tools=[tool], tool_choice="required", parallel_tool_calls=False, max_tokens=200)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["message"]["reasoning_content"] == THOUGHT
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "add" and set(json.loads(call["function"]["arguments"])) == {"a", "b"}


def test_a_reply_cut_while_thinking_has_no_answer(server):
    message = chat(server, **THINK, max_tokens=3).json()["choices"][0]["message"]
    assert message["content"] is None and THOUGHT.startswith(message["reasoning_content"])


def test_responses_give_a_reasoning_item_before_the_message(server):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    response = client.responses.create(
        model="alias", input="What is 2 + 3?", reasoning={"effort": "high"}, temperature=0
    )
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == THOUGHT
    assert message.type == "message" and response.output_text == ANSWER
    assert response.usage.output_tokens_details.reasoning_tokens == THINKING_TOKENS
    assert response.reasoning.effort == "high"
    with client.responses.stream(
        model="alias", input="What is 2 + 3?", reasoning={"effort": "high"}, temperature=0
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert thought == THOUGHT and kinds.index("response.reasoning_text.done") < kinds.index(
        "response.output_text.delta"
    )
    assert [item.type for item in final.output] == ["reasoning", "message"] and final.output_text == ANSWER


def test_a_template_that_opens_the_block_gives_the_same_split(opening_server):
    body = chat(opening_server).json()
    message = body["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (THOUGHT, ANSWER)
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 5}  # qu ick ' fo' x </think>
    deltas, _ = streamed(opening_server, response_format=YES_NO)
    assert "".join(d.get("reasoning_content", "") for d in deltas) == THOUGHT
    assert json.loads("".join(d.get("content") or "" for d in deltas)) in ("yes", "no")


def test_openai_fields_without_generation_semantics_are_accepted(server):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    answer = client.chat.completions.create(
        model="tiny-thinker",
        messages=ASK,
        max_tokens=40,
        temperature=0,
        metadata={"team": "a"},
        store=False,
        service_tier="auto",
        prompt_cache_key="tenant-1",
        prompt_cache_retention="in-memory",
        safety_identifier="user-1",
        verbosity="low",
        user="u",
        parallel_tool_calls=True,
        extra_body=THINK,
    )
    assert answer.choices[0].message.content == ANSWER and answer.model == "tiny-thinker"
    with pytest.raises(openai.BadRequestError) as stored:
        client.chat.completions.create(model="tiny-thinker", messages=ASK, max_tokens=2, store=True)
    assert stored.value.body["code"] == "unsupported_field" and stored.value.body["param"] == "store"
    for bad in (
        {"service_tier": "fastest"},
        {"no_such_field": 1},
        {"chat_template_kwargs": {"add_generation_prompt": 1}},
    ):
        response = chat(server, **bad)
        assert response.status_code == 400, (bad, response.text)
        assert response.json()["error"]["param"] == next(iter(bad)), response.json()


def test_every_alias_is_served_and_listed(server):
    cards = httpx.get(f"{server.base_url}/v1/models").json()["data"]
    assert [c["id"] for c in cards if c["task"] == "generate"] == ["tiny-thinker", "alias"]
    answered = chat(server, model="alias").json()
    assert answered["model"] == "tiny-thinker"  # the first name, as every answer gives it
    assert httpx.get(f"{server.base_url}/v1/models/alias").status_code == 200
    missing = chat(server, model="other")
    assert missing.status_code == 404 and "'tiny-thinker', 'alias'" not in missing.text
    assert "tiny-thinker, alias" in missing.json()["error"]["message"]


def test_a_parser_for_a_model_without_think_tokens_is_refused_at_start(tmp_path):
    app = create_app(make_server_config(make_tiny_llama(tmp_path / "plain"), reasoning_parser="think"))
    server = ServerThread(app).start(wait_ready=False)
    try:
        for _ in range(600):
            health = httpx.get(f"{server.base_url}/health")
            if health.json()["status"] == "error":
                break
        assert "--reasoning-parser think" in health.json()["message"] and "<think>" in health.json()["message"]
    finally:
        server.stop()
