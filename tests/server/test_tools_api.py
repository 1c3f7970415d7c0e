"""Tool calling through the chat API: required, named and auto tool_choice, parallel_tool_calls,
streamed tool-call deltas, a whole call -> tool result -> answer round trip, and 400s naming the field."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from server.app import create_app
from tests.support.server_harness import ServerThread, make_server_config, parse_sse, smollm2_server
from tests.support.tiny_models import make_tiny_llama

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # The tool instructions are long in the tiny test tokenizer's tokens.
    model_dir = make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), max_position_embeddings=2048)
    with ServerThread(create_app(make_server_config(model_dir, max_model_len=2048))) as srv:
        yield srv


def chat(server, **fields) -> httpx.Response:
    body = {"model": MODEL, "messages": ASK, "tools": [WEATHER, CLOCK], "max_tokens": 150, **fields}
    return httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)


def _check_call(call: dict, names=("get_weather", "get_time")) -> None:
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] in names
    arguments = json.loads(call["function"]["arguments"])
    if call["function"]["name"] == "get_weather":
        assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("C", "F") and len(arguments["city"]) <= 8
    else:
        assert arguments == {"zone": "UTC"} or arguments == {"zone": "CET"}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_required_always_calls_a_tool_with_valid_arguments(server, seed):
    response = chat(server, tool_choice="required", temperature=1.0, seed=seed, max_tokens=600)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"]
    for call in choice["message"]["tool_calls"]:
        _check_call(call)


def test_a_named_function_is_called_exactly_once(server):
    named = {"type": "function", "function": {"name": "get_time"}}
    for seed in range(3):
        calls = chat(server, tool_choice=named, temperature=1.0, seed=seed).json()["choices"][0]["message"][
            "tool_calls"
        ]
        assert len(calls) == 1
        _check_call(calls[0], names=("get_time",))


def test_no_parallel_calls_means_at_most_one(server):
    for seed in range(3):
        body = chat(server, tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=seed).json()
        assert len(body["choices"][0]["message"]["tool_calls"]) == 1


def test_auto_gives_a_tool_call_or_a_text_answer(server):
    for seed in range(4):
        choice = chat(server, tool_choice="auto", temperature=1.0, seed=seed, max_tokens=300).json()["choices"][0]
        if choice["finish_reason"] == "tool_calls":
            for call in choice["message"]["tool_calls"]:
                _check_call(call)
        else:
            assert isinstance(choice["message"]["content"], str) and "tool_calls" not in choice["message"]


def test_streamed_tool_calls_arrive_as_deltas(server):
    response = chat(server, tool_choice="required", temperature=1.0, seed=4, stream=True)
    assert response.status_code == 200
    events = [e for e in parse_sse(response.text) if isinstance(e, dict)]
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = [d for e in events for c in e["choices"] for d in c["delta"].get("tool_calls", [])]
    calls = _assemble(deltas)
    assert calls and len(deltas) > len(calls)  # the arguments came in fragments
    for call in calls:
        _check_call(call)
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def _assemble(deltas: list[dict]) -> list[dict]:
    """Stream deltas -> whole calls, as a client joins them: the first delta of an index opens the call."""
    calls: dict[int, dict] = {}
    for delta in deltas:
        if delta["index"] not in calls:
            assert delta["id"] and delta["function"]["name"], delta  # the opening delta names the call
            calls[delta["index"]] = {"id": delta["id"], "type": "function", "function": dict(delta["function"])}
        else:
            assert set(delta) == {"index", "function"} and set(delta["function"]) == {"arguments"}, delta
            calls[delta["index"]]["function"]["arguments"] += delta["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return [calls[i] for i in sorted(calls)]


def test_a_round_trip_through_the_openai_sdk(server):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    first = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, seed=1
    )
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls" and message.tool_calls[0].function.name == "get_weather"
    history = [
        *ASK,
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": '{"temperature": 21}'},
    ]
    final = client.chat.completions.create(
        model=MODEL, messages=history, tools=[WEATHER], tool_choice="none", max_tokens=8
    )
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls
    stream = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        seed=1,
        stream=True,
    )
    deltas = [d for chunk in stream for c in chunk.choices for d in (c.delta.tool_calls or [])]
    assert {d.function.name for d in deltas if d.function.name} == {"get_weather"}
    arguments = "".join(d.function.arguments or "" for d in deltas)
    assert set(json.loads(arguments)) == {"city", "unit"}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required", "tools": None}, "tool_choice"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
        ({"tool_choice": "required", "guided_regex": "a"}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}]}, "tools"),
    ],
)
def test_bad_tool_requests_are_a_400_naming_the_field(server, fields, param):
    response = chat(server, **fields)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.json()


def test_smollm2_required_round_trip_streamed_and_not():
    """The real default model (no tool support in its own template): call -> tool result -> answer,
    with and without streaming (skipped if the model is not pulled)."""
    with smollm2_server(max_model_len=2048, kv_cache="64MiB") as srv:
        client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0)
        model = "smollm2-135m-instruct"
        for stream in (False, True):
            kwargs = {"model": model, "tools": [WEATHER], "max_tokens": 120, "temperature": 0}
            if stream:
                chunks = list(
                    client.chat.completions.create(messages=ASK, tool_choice="required", stream=True, **kwargs)
                )
                deltas = [d for chunk in chunks for c in chunk.choices for d in (c.delta.tool_calls or [])]
                call = _assemble([d.model_dump(exclude_none=True) for d in deltas])[0]
                assert chunks[-1].choices[0].finish_reason == "tool_calls"
            else:
                first = client.chat.completions.create(messages=ASK, tool_choice="required", **kwargs)
                assert first.choices[0].finish_reason == "tool_calls"
                call = first.choices[0].message.tool_calls[0].model_dump()
            assert call["function"]["name"] == "get_weather"
            assert set(json.loads(call["function"]["arguments"])) == {"city", "unit"}
            history = [
                *ASK,
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": call["id"], "content": '{"temperature_c": 21, "sky": "clear"}'},
            ]
            final = client.chat.completions.create(messages=history, tool_choice="auto", **kwargs)
            message = final.choices[0].message
            if final.choices[0].finish_reason == "tool_calls":
                assert message.tool_calls[0].function.name == "get_weather"
            else:  # a text answer, even when max_tokens cut it short
                assert message.content and not message.content.startswith('{"response"')
        _langchain_structured_output(srv.base_url, model)


def test_replies_are_read_back_whole_or_cut_short():
    from engine.structured.spec import StructuredOutput
    from server.openai.tools import ToolPlan

    plan = ToolPlan(style="generic", spec=StructuredOutput(json_object=True), instructions="", definitions=())
    content, calls = plan.parse('{"tool_calls":[{"name":"f","arguments":{"a":1}},{"name":"g","arguments":{}}]}')
    assert content is None and [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("f", {"a": 1}),
        ("g", {}),
    ]
    assert len({c.id for c in calls}) == 2
    assert plan.parse('{"response":"It is sunny."}') == ("It is sunny.", [])
    assert plan.parse('{"response":"It is sun') == ("It is sun", [])  # cut by max_tokens
    assert plan.parse('{"response":"a \\u00e') == ("a ", [])  # cut inside an escape
    assert plan.parse('{"tool_calls":[{"na') == ('{"tool_calls":[{"na', [])


HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
For each call, return <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- for tc in message.tool_calls %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@pytest.fixture(scope="module")
def hermes_server(tmp_path_factory):
    """A tiny model whose chat template renders tools itself and writes calls as <tool_call> blocks."""
    model_dir = make_tiny_llama(tmp_path_factory.mktemp("tiny-hermes"), max_position_embeddings=2048)
    (model_dir / "chat_template.jinja").write_text(HERMES_TEMPLATE)
    with ServerThread(create_app(make_server_config(model_dir, max_model_len=2048))) as srv:
        yield srv


def test_a_template_with_its_own_tool_format_gets_hermes_blocks(hermes_server):
    from server.state import state_of

    assert state_of(hermes_server.app).engine.tokenizer.tool_call_format == "hermes"
    for seed in range(3):
        response = chat(hermes_server, tool_choice="required", temperature=1.0, seed=seed, max_tokens=600)
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        for call in choice["message"]["tool_calls"]:
            _check_call(call)
    named = {"type": "function", "function": {"name": "get_weather"}}
    calls = chat(hermes_server, tool_choice=named, seed=5).json()["choices"][0]["message"]["tool_calls"]
    assert len(calls) == 1
    _check_call(calls[0], names=("get_weather",))
    free = chat(hermes_server, tool_choice="auto", max_tokens=8).json()["choices"][0]
    assert free["finish_reason"] in ("stop", "length", "tool_calls")


def test_hermes_prompts_carry_the_tools_and_the_earlier_calls(hermes_server):
    from server.openai.prompts import chat_prompt_ids
    from server.openai.tools import plan_tools
    from server.protocol.chat import ChatCompletionRequest
    from server.state import state_of

    tokenizer = state_of(hermes_server.app).engine.tokenizer
    history = [
        *ASK,
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "c1", "function": {"name": "get_weather", "arguments": '{"city":"Oslo","unit":"C"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "cold"},
    ]
    body = ChatCompletionRequest(model=MODEL, messages=history, tools=[WEATHER], tool_choice="auto")
    plan = plan_tools(body, tokenizer.tool_call_format)
    text = tokenizer.decode(chat_prompt_ids(tokenizer, body.messages, True, plan), skip_special_tokens=False)
    assert '"name": "get_weather"' in text.split("</tools>")[0]  # the definitions, rendered by the template
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}\n</tool_call>' in text
    assert "<tool_response>\ncold\n</tool_response>" in text


def test_hermes_replies_are_read_back():
    from server.openai.tools import ToolPlan

    plan = ToolPlan(style="hermes", spec=None, instructions="", definitions=())
    text = (
        'Let me check.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>'
    )
    content, calls = plan.parse(text)
    assert content == "Let me check." and [c.function.name for c in calls] == ["f", "g"]
    assert json.loads(calls[0].function.arguments) == {"a": 1}
    assert plan.parse("no calls here") == ("no calls here", [])
    assert plan.parse("<tool_call>\n{broken\n</tool_call>")[1] == []


def _langchain_structured_output(base_url: str, model: str) -> None:
    """LangChain's with_structured_output on the real model, by JSON schema and by function calling."""
    from typing import Literal

    from pydantic import BaseModel, Field

    langchain_openai = pytest.importorskip("langchain_openai")

    class City(BaseModel):
        """A city and the country it is in."""

        name: str = Field(max_length=30)
        country: Literal["France", "Germany", "Japan", "Other"]
        population_millions: int = Field(ge=0, le=100)

    chat_model = langchain_openai.ChatOpenAI(
        model=model, base_url=f"{base_url}/v1", api_key="unused", temperature=0, max_tokens=300, max_retries=0
    )
    for method in ("json_schema", "function_calling"):
        city = chat_model.with_structured_output(City, method=method).invoke("Tell me about Paris.")
        assert isinstance(city, City), method


def test_tool_parameters_are_closed_unless_they_say_otherwise():
    from server.openai.tools import _closed

    schema = {
        "type": "object",
        "properties": {"properties": {"type": "object", "properties": {"a": {"type": "integer"}}}},
        "$defs": {"Open": {"type": "object", "properties": {}, "additionalProperties": True}},
    }
    closed = _closed(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["properties"]["additionalProperties"] is False
    assert set(closed["properties"]) == {"properties"}  # a property named "properties" stays a property
    assert closed["$defs"]["Open"]["additionalProperties"] is True


def test_the_kvserve_client_reads_tool_calls(server):
    from clients.client import Client

    with Client(server.base_url) as client:
        completion = client.chat(ASK, model=MODEL, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
        plain = client.chat(ASK, model=MODEL, max_tokens=4)
    assert completion.finish_reason == "tool_calls" and completion.text == ""
    (call,) = completion.tool_calls
    assert call.name == "get_weather" and call.id.startswith("call_")
    assert set(call.parsed_arguments()) == {"city", "unit"}
    assert plain.tool_calls == ()
