"""Strict input at the edge: booleans that are JSON booleans, bodies parsed strictly as JSON (duplicate
keys, nesting, long numbers, invalid UTF-8, lone surrogates), short error messages, unique tool names,
schemas that refer to themselves, and /attention's cheap bounds.

One in-process app (Starlette's TestClient runs its lifespan) on a tiny random llama for the module.
"""

from __future__ import annotations

import time
import types
import typing
from collections.abc import Iterator
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import pytest
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.testclient import TestClient

from engine.structured.spec import StructuredOutput
from server.app import create_app
from server.http.json_body import MAX_JSON_DEPTH
from server.openai.tools import _hermes_grammar
from server.playground.protocol import MAX_ATTENTION_PROMPT_CHARS
from server.protocol.chat import Tool
from server.state import state_of
from tests.support.server_harness import make_server_config
from tests.support.tiny_models import make_tiny_llama

MESSAGES = [{"role": "user", "content": "Hi"}]
LONE_SURROGATE = "\\ud800"  # as JSON text: the escape of half a surrogate pair
# A valid recursive schema: a linked list of integers, its node defined once under $defs.
LINKED_LIST = {
    "type": "object",
    "properties": {"head": {"$ref": "#/$defs/node"}},
    "required": ["head"],
    "$defs": {
        "node": {
            "type": "object",
            "properties": {
                "value": {"type": "integer"},
                "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]},
            },
            "required": ["value"],
        }
    },
}
REF_CYCLE = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    model_dir = make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    return create_app(make_server_config(model_dir, max_model_len=512))


@pytest.fixture(scope="module")
def client(app) -> Iterator[TestClient]:
    with TestClient(app) as client:
        deadline = time.monotonic() + 60
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "the tiny model did not load"
            time.sleep(0.02)
        yield client


def post_raw(client: TestClient, path: str, content: bytes | str) -> Any:
    return client.post(path, content=content, headers={"content-type": "application/json"})


def error_of(response: Any, status: int = 400) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    if body.get("type") == "error":  # the Messages routes answer in Anthropic's shape
        assert set(body) == {"type", "error"} and set(body["error"]) == {"type", "message"}
        return body["error"]
    if set(body) == {"error"} and isinstance(body["error"], str):  # the /api routes answer in Ollama's
        return {"message": body["error"]}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def json_routes(app) -> list[APIRoute]:
    """Every route that takes a JSON body, those of included routers too."""
    found, routes = [], list(app.routes)
    while routes:
        route = routes.pop(0)
        included = getattr(route, "original_router", None)  # FastAPI keeps an included router as one entry
        if included is not None:
            routes.extend(included.routes)
        elif isinstance(route, APIRoute) and route.body_field is not None:
            found.append(route)
    assert len(found) >= 10, [route.path for route in found]
    return found


# ---- booleans: every one a JSON boolean ----


def _boolean_fields(model: type[BaseModel], path: tuple, tags: dict) -> Iterator[tuple[tuple, dict]]:
    """(path, tags) per boolean field reachable from `model`: its path of keys and list indices, and the
    `type` literal each object on the way needs to be told apart from its union's other members."""
    type_field = model.model_fields.get("type")
    if type_field is not None and get_origin(type_field.annotation) is Literal:
        tags = {**tags, path: get_args(type_field.annotation)[0]}
    for name, field in model.model_fields.items():
        yield from _boolean_leaves(field.annotation, (*path, field.alias or name), tags)


def _boolean_leaves(annotation: Any, path: tuple, tags: dict) -> Iterator[tuple[tuple, dict]]:
    origin = get_origin(annotation)
    if annotation is bool:
        yield path, tags
    elif isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield from _boolean_fields(annotation, path, tags)
    elif origin is Annotated:
        yield from _boolean_leaves(get_args(annotation)[0], path, tags)
    elif origin in (Union, types.UnionType):
        for member in get_args(annotation):
            yield from _boolean_leaves(member, path, tags)
    elif origin is list:
        yield from _boolean_leaves(get_args(annotation)[0], (*path, 0), tags)
    elif origin is dict:
        yield from _boolean_leaves(get_args(annotation)[1], (*path, "key"), tags)


def _body_setting(path: tuple, tags: dict, value: Any) -> Any:
    """The smallest body that puts `value` at `path` (each object with its `type` tag)."""

    def at(depth: int) -> Any:
        if depth == len(path):
            return value
        child = at(depth + 1)
        if isinstance(path[depth], int):
            return [child]
        node = {path[depth]: child}
        if path[:depth] in tags:
            node.setdefault("type", tags[path[:depth]])
        return node

    return at(0)


def _names_boolean_error(message: str, path: tuple) -> bool:
    """Whether `message` has a "<field>: Input should be a valid boolean" part for the field at `path`
    (a discriminated union adds its tag to the field's name: text.format.json_schema.strict)."""
    wanted = [str(part) for part in path]
    for part in message.split("; "):
        field, _, reason = part.partition(": ")
        field = field.removesuffix(".bool")  # a boolean member of a plain union (Ollama's think: bool or a level)
        names = iter(field.split("."))
        if reason == "Input should be a valid boolean" and field.endswith(wanted[-1]):
            if all(name in names for name in wanted):  # in order, tags between them allowed
                return True
    return False


def test_every_boolean_field_of_every_route_takes_only_json_booleans(app, client):
    """Found from the request models themselves: a new boolean field that is not strict fails here."""
    checked, failures = 0, []
    for route in json_routes(app):
        model = typing.cast(type[BaseModel], route.body_field.field_info.annotation)
        for path, tags in _boolean_fields(model, (), {}):
            name = ".".join(str(part) for part in path)
            for value in (1, "yes", "true"):
                response = client.post(route.path, json=_body_setting(path, tags, value))
                message = error_of(response)["message"] if response.status_code == 400 else ""
                if not _names_boolean_error(message, path):
                    failures.append(f"{route.path} {name}={value!r}: {response.status_code} {response.text[:200]}")
                checked += 1
    assert not failures, "\n".join(failures)
    assert checked >= 3 * 30  # every route's switches, stream_options' and the tools' included


def test_null_stays_accepted_where_a_switch_is_optional(client):
    body = {"input": "Hi", "max_output_tokens": 1, "store": None, "parallel_tool_calls": None}
    assert client.post("/v1/responses", json=body).status_code == 200


# ---- the body as JSON ----


def test_duplicate_keys_are_refused_on_every_json_route_at_any_depth(app, client):
    for route in json_routes(app):
        error = error_of(post_raw(client, route.path, '{"model": "a", "model": "b"}'))
        assert error["message"] == 'duplicate key "model" in the JSON body', route.path
        if route.path.startswith("/api/"):
            continue  # Ollama's error is its message alone
        assert error["type"] == "invalid_request_error", route.path
        assert error.get("code") == ("invalid_request" if not route.path.startswith("/v1/messages") else None)
    nested = '{"prompt": "Hi", "stream_options": {"include_usage": false, "include_usage": true}}'
    assert 'duplicate key "include_usage"' in error_of(post_raw(client, "/v1/completions", nested))["message"]
    deep = '{"messages": [{"role": "user", "content": "Hi", "role": "system"}]}'
    assert 'duplicate key "role"' in error_of(post_raw(client, "/v1/chat/completions", deep))["message"]


def test_nesting_past_the_limit_is_refused_with_its_reason(client):
    for content in ("[" * 100_000, "[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1)):
        error = error_of(post_raw(client, "/v1/completions", content))
        assert f"more than {MAX_JSON_DEPTH} levels deep" in error["message"]
    at_the_limit = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH  # parsed; then not an object
    assert "levels deep" not in error_of(post_raw(client, "/v1/completions", at_the_limit))["message"]


def test_numbers_utf8_and_syntax_errors_say_what_is_wrong(client):
    long_number = error_of(post_raw(client, "/v1/completions", '{"prompt": [' + "1" * 5000 + "]}"))
    assert "number in the JSON body is too long" in long_number["message"]
    not_utf8 = error_of(post_raw(client, "/v1/completions", b'{"prompt": "\xff"}'))
    assert not_utf8["message"] == "request body is not valid UTF-8 at byte 12"
    broken = error_of(post_raw(client, "/v1/completions", '{"prompt": "Hi" "max_tokens": 1}'))
    assert broken["message"].startswith("request body is not valid JSON: Expecting ',' delimiter (line 1, column")


@pytest.mark.parametrize(
    ("path", "template", "param"),
    [
        ("/v1/completions", '{"prompt": "%s", "max_tokens": 1}', "prompt"),
        ("/v1/completions", '{"prompt": ["ok", "%s"], "max_tokens": 1}', "prompt.1"),
        ("/v1/completions", '{"prompt": "Hi", "stop": "%s", "max_tokens": 1}', "stop"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "%s"}]}', "messages.0.content"),
        ("/tokenize", '{"prompt": "%s"}', "prompt"),
        ("/v1/responses", '{"input": "%s"}', "input"),
        ("/v1/responses", '{"input": [{"role": "user", "content": "a%sb"}]}', "input.0.content"),
    ],
)
def test_a_lone_surrogate_is_refused_naming_its_field(client, path, template, param):
    error = error_of(post_raw(client, path, template % LONE_SURROGATE))
    assert error["param"] == param
    assert error["message"] == f"{param}: the text is not valid Unicode (a lone surrogate)"


def test_an_escaped_surrogate_pair_is_text(client):
    response = post_raw(client, "/tokenize", '{"prompt": "\\ud83d\\ude00"}')  # U+1F600, as json.dumps escapes it
    assert response.status_code == 200 and response.json()["count"] > 0


def test_echoed_input_is_cut_short(client):
    error = error_of(client.post("/v1/completions", json={"model": "m" * 200_000, "prompt": "Hi"}), 404)
    assert error["code"] == "model_not_found" and len(error["message"]) < 200
    assert "m" * 64 + "..." in error["message"]
    unknown = error_of(client.post("/v1/completions", json={"prompt": "Hi", "x" * 10_000: 1}))
    assert len(unknown["message"]) < 100 and len(unknown["param"]) < 100


# ---- tools and schemas ----


def _tool(name: str, parameters: dict | None = None) -> dict:
    return {"type": "function", "function": {"name": name, **({"parameters": parameters} if parameters else {})}}


def test_duplicate_tool_names_are_refused(client):
    chat = {"messages": MESSAGES, "tools": [_tool("f"), _tool("g"), _tool("f")], "tool_choice": "none"}
    error = error_of(client.post("/v1/chat/completions", json=chat))
    assert error["param"] == "tools" and error["message"] == 'tools: two tools are named "f"'
    tools = [{"type": "function", "name": "lookup"}, {"type": "function", "name": "lookup"}]
    error = error_of(client.post("/v1/responses", json={"input": "Hi", "tools": tools}))
    assert error["param"] == "tools" and '"lookup"' in error["message"]


def test_a_ref_cycle_is_a_one_line_400(client):
    response_format = {"type": "json_schema", "json_schema": {"name": "cycle", "schema": REF_CYCLE}}
    body = {"messages": MESSAGES, "response_format": response_format}
    error = error_of(client.post("/v1/chat/completions", json=body))
    assert error["param"] == "response_format"
    assert error["message"].startswith("response_format: invalid json: $ref cycle #/$defs/a -> #/$defs/b -> #/$defs/a")
    assert "\n" not in error["message"] and len(error["message"]) < 300
    body = {"messages": MESSAGES, "tools": [_tool("f", REF_CYCLE)], "tool_choice": "required"}
    error = error_of(client.post("/v1/chat/completions", json=body))
    assert error["param"] == "tools" and "$ref cycle" in error["message"] and "<state>" not in error["message"]


def test_a_recursive_tool_schema_works_as_in_response_format(client):
    response_format = {"type": "json_schema", "json_schema": {"name": "list", "schema": LINKED_LIST}}
    body = {"messages": MESSAGES, "max_tokens": 2, "response_format": response_format}
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    for choice in ("required", {"type": "function", "function": {"name": "push"}}):
        body = {"messages": MESSAGES, "max_tokens": 2, "tools": [_tool("push", LINKED_LIST)], "tool_choice": choice}
        response = client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text


def test_a_recursive_tool_schema_compiles_in_the_hermes_grammar_too(app, client):
    """Templates with their own tool format constrain calls by a Lark grammar embedding the schemas."""
    tools = [Tool.model_validate(_tool("push", LINKED_LIST)), Tool.model_validate(_tool("pop"))]
    grammar = state_of(app).engine.grammar
    spec = StructuredOutput(grammar=_hermes_grammar(tools, max_calls=None), param="tools")
    grammar.compile(spec)
    call = '<tool_call>\n{"name":"push","arguments":{"head":{"value":1,"next":{"value":2}}}}\n</tool_call>'
    matcher, ids = grammar.matcher(spec), state_of(app).engine.tokenizer.encode(call, add_special_tokens=False)
    assert matcher.try_consume_tokens(ids) == len(ids) and not matcher.is_error()


# ---- /attention ----


def test_attention_refuses_a_long_prompt_before_tokenizing_it(client, monkeypatch):
    from server.playground import attention

    def never(*args: Any) -> None:
        raise AssertionError("the prompt was tokenized")

    monkeypatch.setattr(attention, "_encode", never)
    error = error_of(client.post("/attention", json={"prompt": "a" * 1_900_000}))
    assert error["param"] == "prompt" and error["code"] == "context_length_exceeded"
    assert f"over {MAX_ATTENTION_PROMPT_CHARS} characters" in error["message"]


@pytest.mark.parametrize("param", ["sliding_window", "num_sink_tokens"])
def test_attention_bounds_its_window_and_sinks_by_the_context_length(client, param):
    error = error_of(client.post("/attention", json={"prompt": "Hello", "sliding_window": 4, param: 2**63}))
    assert error["param"] == param and "512" in error["message"]
    within = client.post("/attention", json={"prompt": "Hello", "sliding_window": 4, param: 512})
    assert within.status_code == 200, within.text
