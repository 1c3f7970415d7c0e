"""POST /v1/responses through the real openai SDK: greedy text equals chat's for the same request
(instructions and item input included), streamed events come in order and add up to the JSON answer,
max_output_tokens makes a response incomplete, text.format and function tools map onto structured
output and tool calling (a whole call -> result -> answer round trip), bad requests are 400s, a failing
stream ends with error and response.failed, and a client leaving mid-stream leaves nothing running."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from server.app import create_app
from server.state import state_of
from tests.server.test_no_leaks import _wait_idle, without_gc  # noqa: F401 - without_gc is a fixture
from tests.support.flaky_engine import flaky_factory
from tests.support.server_harness import (
    ServerThread,
    make_server_config,
    parse_named_sse,
    send_and_hang_up,
    smollm2_server,
)
from tests.support.tiny_models import make_tiny_llama

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
GREEDY = {"model": MODEL, "temperature": 0, "max_output_tokens": 12}
ITEM = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "count"],
    "additionalProperties": False,
}
ITEM_FORMAT = {"format": {"type": "json_schema", "name": "item", "schema": ITEM, "strict": True}}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"],
    },
}
CHAT_WEATHER = {
    "type": "function",
    "function": {k: v for k, v in WEATHER.items() if k != "type"},
}
ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # The tool instructions are long in the tiny test tokenizer's tokens; the flaky engine's knobs
    # slow steps down (a client leaving mid-stream) and fail one request (a stream that fails).
    model_dir = make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), max_position_embeddings=2048)
    config = make_server_config(model_dir, max_model_len=2048)
    with ServerThread(create_app(config, engine_factory=flaky_factory)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0) as sdk:
        yield sdk


def chat_completion(client, messages: list[dict], **fields):
    fields = {"max_tokens": fields.pop("max_output_tokens", 12), "temperature": 0, **fields}
    return client.chat.completions.create(model=MODEL, messages=messages, **fields)


def chat_text(client, messages: list[dict], **fields) -> str:
    return chat_completion(client, messages, **fields).choices[0].message.content


def named_events(body: str) -> list[dict]:
    """A Responses stream's events (strict framing), numbered in order."""
    events = parse_named_sse(body)
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    return events


def stream_events(server, **body) -> list[dict]:
    response = httpx.post(f"{server.base_url}/v1/responses", json={**body, "stream": True}, timeout=60)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    return named_events(response.text)


# ---- the text, against chat ----

CONVERSATION_ITEMS = [
    {"role": "developer", "content": "Answer briefly."},
    {"role": "user", "content": [{"type": "input_text", "text": "Hi, "}, {"type": "input_text", "text": "there"}]},
    {
        "type": "message",
        "role": "assistant",
        "id": "msg_1",
        "status": "completed",
        "content": [{"type": "output_text", "text": "Hello!", "annotations": [], "logprobs": []}],
    },
    {"type": "message", "role": "user", "content": "Count to three."},
]
CONVERSATION_CHAT = [
    {"role": "developer", "content": "Answer briefly."},
    {"role": "user", "content": "Hi, there"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Count to three."},
]


@pytest.mark.parametrize(
    ("fields", "messages"),
    [
        ({"input": "Hello"}, [{"role": "user", "content": "Hello"}]),
        (
            {"input": "Hello", "instructions": "You are a pirate."},
            [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Hello"}],
        ),
        ({"input": CONVERSATION_ITEMS}, CONVERSATION_CHAT),
    ],
    ids=["string", "instructions", "items"],
)
def test_greedy_text_equals_chat(client, fields, messages):
    response = client.responses.create(**GREEDY, **fields)
    chat = chat_completion(client, messages)
    assert response.output_text == chat.choices[0].message.content
    assert response.object == "response" and response.id.startswith("resp_") and response.model == MODEL
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [part.type for part in message.content] == ["output_text"] and message.content[0].annotations == []
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    finished = chat.choices[0].finish_reason
    assert response.status == ("incomplete" if finished == "length" else "completed")
    assert usage.input_tokens_details.cached_tokens == 0 and usage.output_tokens_details.reasoning_tokens == 0
    assert response.instructions == fields.get("instructions")


def test_max_output_tokens_makes_the_response_incomplete(client):
    response = client.responses.create(model=MODEL, input="Hello", max_output_tokens=3)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete" and response.usage.output_tokens == 3
    done = client.responses.create(model=MODEL, input="Hello", max_output_tokens=120, text=ITEM_FORMAT)
    assert done.status == "completed" and done.incomplete_details is None and done.output[0].status == "completed"


def test_settings_are_echoed_and_hints_accepted(client):
    response = client.responses.create(
        **GREEDY,
        input="Hello",
        store=True,
        metadata={"team": "kv"},
        user="u1",
        reasoning={"effort": "low"},
        truncation="auto",
        parallel_tool_calls=False,
        text={"format": {"type": "text"}, "verbosity": "low"},
        extra_body={"seed": 3},
    )
    assert response.output_text == chat_text(client, [{"role": "user", "content": "Hello"}])
    assert response.metadata == {"team": "kv"} and response.user == "u1" and response.parallel_tool_calls is False
    assert response.temperature == 0 and response.top_p == 1 and response.max_output_tokens == 12
    assert response.text.format.type == "text" and response.tools == [] and response.tool_choice == "none"
    assert response.reasoning.effort == "low"  # given to the chat template as reasoning_effort
    assert response.to_dict()["store"] is False  # nothing is stored, whatever the request asked


def test_seed_makes_sampling_repeatable(client):
    def sample(seed: int) -> str:
        return client.responses.create(
            model=MODEL, input="Hello", temperature=1.0, max_output_tokens=12, extra_body={"seed": seed}
        ).output_text

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


# ---- streaming ----


def test_streamed_events_come_in_order_and_add_up_to_the_json_answer(server):
    answer = httpx.post(f"{server.base_url}/v1/responses", json={**GREEDY, "input": "Hello"}, timeout=60).json()
    events = stream_events(server, **GREEDY, input="Hello")
    types = [event["type"] for event in events]
    deltas = [event for event in events if event["type"] == "response.output_text.delta"]
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * len(deltas),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        f"response.{answer['status']}",
    ]
    created, final = events[0]["response"], events[-1]["response"]
    assert created["status"] == "in_progress" and created["output"] == [] and created["usage"] is None
    item_id = events[2]["item"]["id"]
    assert all(e["item_id"] == item_id and e["output_index"] == 0 and e["content_index"] == 0 for e in deltas)
    assert all(e["logprobs"] == [] for e in deltas)
    text = "".join(event["delta"] for event in deltas)
    assert text == events[-4]["text"] == events[-3]["part"]["text"] == events[-2]["item"]["content"][0]["text"]
    assert final["id"] == created["id"] and final["output"] == [events[-2]["item"]]
    answer_item = answer["output"][0]
    assert {**answer_item, "id": item_id} == events[-2]["item"] and answer_item["content"][0]["text"] == text
    for field in ("status", "incomplete_details", "usage", "model", "text", "tools", "tool_choice", "temperature"):
        assert final[field] == answer[field], field


def test_sdk_stream_context_manager_gives_the_final_response(client):
    body = {"model": MODEL, "input": "Describe one item.", "max_output_tokens": 120, "text": ITEM_FORMAT}
    expected = client.responses.create(**body, temperature=0)
    with client.responses.stream(**body, temperature=0) as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == expected.status == "completed"
    assert final.output_text == "".join(deltas) == expected.output_text
    json.loads(final.output_text)


# ---- structured output ----


class Item(BaseModel):
    name: str = Field(max_length=6)
    count: int = Field(ge=0, le=99)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_json_schema_output_parses_and_validates(server, client, stream):
    body = {"model": MODEL, "input": "Describe one item.", "max_output_tokens": 120, "text": ITEM_FORMAT}
    if stream:
        text = next(e for e in stream_events(server, **body) if e["type"] == "response.output_text.done")["text"]
    else:
        response = client.responses.create(**body)
        assert response.text.format.type == "json_schema" and response.text.format.name == "item"
        text = response.output_text
    Item.model_validate_json(text)
    assert set(json.loads(text)) == {"name", "count"}


def test_sdk_parse_and_json_object(client):
    parsed = client.responses.parse(model=MODEL, input="Describe one item.", text_format=Item, max_output_tokens=120)
    assert isinstance(parsed.output_parsed, Item)
    response = client.responses.create(
        model=MODEL, input="Any JSON object.", text={"format": {"type": "json_object"}}, max_output_tokens=200
    )
    if response.status == "completed":
        assert isinstance(json.loads(response.output_text), dict)
    else:  # cut by max_output_tokens: still a JSON object's prefix
        assert response.output_text.startswith("{")


# ---- function tools ----


def _call_arguments(call) -> dict:
    arguments = json.loads(call.arguments)
    assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("C", "F") and len(arguments["city"]) <= 8
    return arguments


def test_function_tool_round_trip(client):
    """required -> one function_call item (the same call chat makes), then its output sent back with the
    earlier output items -> an answer, the same text chat gives for the same conversation."""
    tools = {"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False, "max_output_tokens": 150}
    first = client.responses.create(model=MODEL, input=ASK, temperature=0, **tools)
    assert first.status == "completed" and first.output_text == ""
    [call] = first.output
    assert call.type == "function_call" and call.status == "completed" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_") and call.id != call.call_id
    arguments = _call_arguments(call)
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": ASK}],
        tools=[CHAT_WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=150,
        temperature=0,
    )
    assert json.loads(chat.choices[0].message.tool_calls[0].function.arguments) == arguments

    result = '{"temperature_c": 21, "sky": "clear"}'
    history = [{"role": "user", "content": ASK}, *first.output]
    history.append({"type": "function_call_output", "call_id": call.call_id, "output": result})
    final = client.responses.create(
        model=MODEL, input=history, tools=[WEATHER], tool_choice="none", temperature=0, max_output_tokens=12
    )
    chat_history = [
        {"role": "user", "content": ASK},
        {
            "role": "assistant",
            "tool_calls": [
                {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": result},
    ]
    assert final.output_text == chat_text(client, chat_history)
    assert final.tool_choice == "none" and final.tools[0].name == "get_weather"


def test_streamed_function_call(server, client):
    body = {
        "model": MODEL,
        "input": ASK,
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "temperature": 0,
        "max_output_tokens": 150,
    }
    events = stream_events(server, **body)
    types = [event["type"] for event in events]
    deltas = [event for event in events if event["type"] == "response.function_call_arguments.delta"]
    assert deltas and types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        *["response.function_call_arguments.delta"] * len(deltas),
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    added, done = events[2]["item"], events[-2]["item"]
    assert added["type"] == "function_call" and added["arguments"] == "" and added["status"] == "in_progress"
    assert done["id"] == added["id"] and done["call_id"] == added["call_id"] and done["status"] == "completed"
    arguments = "".join(event["delta"] for event in deltas)
    assert arguments == events[-3]["arguments"] == done["arguments"]
    assert json.loads(arguments) == json.loads(client.responses.create(**body).output[0].arguments)
    with client.responses.stream(**body) as stream:
        final = stream.get_final_response()
    assert final.status == "completed" and final.output[0].type == "function_call"
    assert _call_arguments(final.output[0]) == json.loads(arguments)


# ---- refusals ----


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"input": []}, "input"),
        ({"input": ""}, "input"),
        ({"no_such_field": 1}, "no_such_field"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"tools": [{"type": "function", "name": "bad name"}]}, "tools.0.name"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "text": {"format": {"type": "json_object"}}}, "text.format"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}, "text.format"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, None),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input.0"),
        ({"background": True}, "background"),
        ({"stream_options": {"include_obfuscation": False}}, "stream_options"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"max_output_tokens": 4000}, "max_output_tokens"),  # past the context: errors name this API's fields
        ({"input": "word " * 3000}, "input"),
    ],
)
def test_bad_requests_are_400_naming_the_field(server, fields, param):
    body = {"model": MODEL, "input": "Hello", "max_output_tokens": 4, **fields}
    response = httpx.post(f"{server.base_url}/v1/responses", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param, error
    else:
        assert error["param"].startswith("input.0"), error
    if "previous_response_id" in fields:
        assert "does not store responses" in error["message"]
    ok = httpx.post(f"{server.base_url}/v1/responses", json={"input": "Hi", "max_output_tokens": 2}, timeout=60)
    assert ok.status_code == 200 and ok.json()["status"] == "incomplete"


def test_unknown_model_is_404_and_stored_responses_are_not_offered(server, client):
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="no-such-model", input="Hi")
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_123")


def test_the_api_document_describes_the_json_answer_and_the_named_events(server):
    document = httpx.get(f"{server.base_url}/openapi.json").json()
    content = document["paths"]["/v1/responses"]["post"]["responses"]["200"]["content"]
    assert content["application/json"]["schema"] == {"$ref": "#/components/schemas/ResponseObject"}
    item = content["text/event-stream"]["itemSchema"]
    assert item["required"] == ["event", "data"]
    assert item["properties"]["data"]["contentSchema"] == {"$ref": "#/components/schemas/ResponseStreamEvent"}
    assert "ResponseStreamEvent" in document["components"]["schemas"]


# ---- failures and clients leaving ----


def test_a_failing_stream_ends_with_error_and_response_failed(server, client):
    engine = state_of(server.app).engine.llm_engine
    engine.fail_seed = 777
    try:
        events = stream_events(server, **GREEDY, input="Hello", seed=777)
        json_answer = httpx.post(
            f"{server.base_url}/v1/responses", json={**GREEDY, "input": "Hello", "seed": 777}, timeout=60
        )
        with client.responses.stream(**GREEDY, input="Hello", extra_body={"seed": 777}) as stream:
            sdk_events = list(stream)
            with pytest.raises(RuntimeError):  # the SDK's own answer to a stream that never completed
                stream.get_final_response()
    finally:
        engine.fail_seed = None
    assert [event["type"] for event in events[:2]] == ["response.created", "response.in_progress"]
    error, failed = events[-2:]
    assert error["type"] == "error" and error["code"] == "engine_step_failed" and error["message"]
    assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
    assert failed["response"]["error"]["code"] == "server_error"
    assert json_answer.status_code == 500 and json_answer.json()["error"]["code"] == "engine_step_failed"
    assert [event.type for event in sdk_events][-2:] == ["error", "response.failed"]
    assert sdk_events[-2].code == "engine_step_failed" and sdk_events[-1].response.status == "failed"
    assert client.responses.create(**GREEDY, input="Hello").output_text  # the server goes on


def test_clients_leaving_mid_stream_leave_nothing_running(server, without_gc):  # noqa: F811
    engine = state_of(server.app).engine
    engine.llm_engine.step_delay = 0.02  # 200 steps: every client leaves while its answer is generated
    body = {"model": MODEL, "input": "Hello", "max_output_tokens": 200}
    clients = [
        threading.Thread(target=send_and_hang_up, args=(server.base_url, "/v1/responses", payload, linger))
        for linger in (0.0, 0.05, 0.3)
        for payload in ({**body, "stream": True}, body)
    ]
    try:
        for thread in clients:
            thread.start()
        url = f"{server.base_url}/v1/responses"
        with httpx.Client(timeout=30) as http, http.stream("POST", url, json={**body, "stream": True}) as response:
            for line in response.iter_lines():  # leave at the first text delta
                if line == "event: response.output_text.delta":
                    break
        for thread in clients:
            thread.join(timeout=30)
        _wait_idle(engine, timeout=3.0)
    finally:
        engine.llm_engine.step_delay = 0.0


# ---- the real default model ----


def test_smollm2_tool_round_trip_equals_chat():
    """SmolLM2 (its template has no tool support: the generic format), the SDK's usual pattern: a
    required call, then the output items sent back with the call's result. The answer equals chat's
    for the same conversation, streamed or not (skipped if the model is not pulled). Prefix caching off: each
    request computes its whole prompt, so the same prompt gives the same numbers. With it, a later request
    continues a cached prefix through the masked attention path, whose last-bit difference from the first
    request's causal one flips this answer near a tie (where to stop), in a float32 cache too."""
    with smollm2_server(max_model_len=2048, kv_cache="64MiB", prefix_caching=False) as srv:
        client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0)
        model = "smollm2-135m-instruct"
        system = "You are a weather assistant."
        greedy = {"model": model, "tools": [WEATHER], "temperature": 0, "parallel_tool_calls": False}
        chat_greedy = {"model": model, "tools": [CHAT_WEATHER], "temperature": 0, "parallel_tool_calls": False}
        ask = [{"role": "system", "content": system}, {"role": "user", "content": ASK}]

        first = client.responses.create(
            **greedy, instructions=system, input=ASK, tool_choice="required", max_output_tokens=120
        )
        [call] = first.output
        assert first.status == "completed" and call.type == "function_call" and call.name == "get_weather"
        assert set(json.loads(call.arguments)) == {"city", "unit"}

        result = '{"temperature_c": 21, "sky": "clear"}'
        history = [{"role": "user", "content": ASK}, *first.output]
        history.append({"type": "function_call_output", "call_id": call.call_id, "output": result})
        final = client.responses.create(**greedy, instructions=system, input=history, max_output_tokens=32)
        chat_call = {
            "id": call.call_id,
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }
        chat_history = [*ask, {"role": "assistant", "tool_calls": [chat_call]}]
        chat_history.append({"role": "tool", "tool_call_id": call.call_id, "content": result})
        chat_final = client.chat.completions.create(**chat_greedy, messages=chat_history, max_tokens=32).choices[0]
        if chat_final.finish_reason == "tool_calls":
            [again] = final.output
            assert again.type == "function_call"
            assert json.loads(again.arguments) == json.loads(chat_final.message.tool_calls[0].function.arguments)
        else:
            assert final.output_text == chat_final.message.content and final.output_text

        with client.responses.stream(**greedy, instructions=system, input=history, max_output_tokens=32) as stream:
            events = list(stream)
        streamed = events[-1].response
        assert [_plain(item) for item in streamed.output] == [_plain(item) for item in final.output]


def _plain(item) -> dict:
    """An output item without its ids, and without the `parsed` field the SDK's stream() adds to text parts."""
    dumped = item.model_dump(exclude={"id", "call_id"})
    for part in dumped.get("content") or []:
        part.pop("parsed", None)
    return dumped
