"""The Messages API's two mappings, without a server: a request as the chat request it stands for
(server/anthropic/chat_request.py) and a reply as Anthropic's content blocks and stream events
(server/anthropic/message_events.py)."""

from __future__ import annotations

import json

import pytest

from engine.errors import InvalidRequestError
from server.anthropic.chat_request import chat_request
from server.anthropic.message_events import MessageEvents
from server.errors import APIError
from server.protocol.anthropic import MessagesRequest, MessagesStreamEvent
from server.protocol.chat import ResponseToolCall, ToolCallFunction

TOOL = {"name": "add", "input_schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}


def request(**fields) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 8, **fields})


def test_a_conversation_with_a_tool_round_trip_becomes_chats_turns():
    body = request(
        system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
        messages=[
            {"role": "user", "content": "add 1"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hm", "signature": ""},
                    {"type": "text", "text": "Calling."},
                    {"type": "tool_use", "id": "t1", "name": "add", "input": {"a": 1}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "2"}]},
                    {"type": "tool_result", "tool_use_id": "t2", "content": "boom", "is_error": True},
                    {"type": "text", "text": "thanks"},
                ],
            },
        ],
        tools=[TOOL],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        stop_sequences=["END"],
        metadata={"user_id": "u1"},
    )
    chat = chat_request(body)
    turns = [(m.role, m.content) for m in chat.messages]
    assert turns == [
        ("system", "Be brief."),
        ("user", "add 1"),
        ("assistant", "Calling."),
        ("tool", "2"),
        ("tool", "Error: boom"),
        ("user", "thanks"),
    ]
    (call,) = chat.messages[2].tool_calls
    assert (call.id, call.function.name, json.loads(call.function.arguments)) == ("t1", "add", {"a": 1})
    assert [m.tool_call_id for m in chat.messages[3:5]] == ["t1", "t2"]
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert chat.tools[0].function.parameters == TOOL["input_schema"]
    assert (chat.stop, chat.user, chat.max_tokens, chat.top_k) == (["END"], "u1", 8, 0)


@pytest.mark.parametrize(
    ("fields", "kwargs", "effort"),
    [
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, {"enable_thinking": True}, None),
        ({"thinking": {"type": "disabled"}}, {"enable_thinking": False}, None),
        ({"thinking": {"type": "adaptive"}}, None, None),
        ({"output_config": {"effort": "max"}}, None, "xhigh"),
    ],
)
def test_thinking_and_effort_reach_the_template(fields, kwargs, effort):
    chat = chat_request(request(messages=[{"role": "user", "content": "hi"}], **fields))
    assert (chat.chat_template_kwargs, chat.reasoning_effort) == (kwargs, effort)


def test_an_output_format_is_a_json_schema_response_format():
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    format_ = {"type": "json_schema", "schema": schema}
    chat = chat_request(request(messages=[{"role": "user", "content": "hi"}], output_config={"format": format_}))
    assert chat.response_format.json_schema.schema_ == schema
    with pytest.raises(InvalidRequestError, match="output_config.format"):
        chat_request(
            request(messages=[{"role": "user", "content": "hi"}], output_config={"format": format_}, tools=[TOOL])
        )


@pytest.mark.parametrize(
    ("message", "match"),
    [
        ({"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}, "image blocks"),
        ({"role": "user", "content": [{"type": "tool_use", "id": "1", "name": "a", "input": {}}]}, "assistant turns"),
        ({"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "1"}]}, "user turns"),
    ],
)
def test_blocks_a_turn_cannot_hold_are_refused(message, match):
    with pytest.raises(InvalidRequestError, match=match):
        chat_request(request(messages=[message]))


def test_tool_choice_tool_names_one_function_and_any_needs_tools():
    chat = chat_request(
        request(messages=[{"role": "user", "content": "hi"}], tools=[TOOL], tool_choice={"type": "tool", "name": "add"})
    )
    assert chat.tool_choice == {"type": "function", "function": {"name": "add"}}
    with pytest.raises(InvalidRequestError, match="any needs tools"):
        chat_request(request(messages=[{"role": "user", "content": "hi"}], tool_choice={"type": "any"}))


def test_the_stream_events_build_the_same_blocks_as_the_whole_answer():
    streamed = MessageEvents("msg_1", "m", input_tokens=5)
    events = streamed.started()
    events += streamed.thinking("th") + streamed.thinking("ink")
    events += streamed.text("Hi")
    events += streamed.call("call_1", "add") + streamed.arguments('{"a":') + streamed.arguments(" 1}")
    events += streamed.finished("stop", None, 9, 3)
    whole = MessageEvents("msg_1", "m", input_tokens=5)
    call = ResponseToolCall(id="call_1", function=ToolCallFunction(name="add", arguments='{"a": 1}'))
    whole.whole("think", "Hi", [call])
    whole.finished("stop", None, 9, 3)
    assert streamed.message() == whole.message()
    message = whole.message().model_dump()
    assert [b["type"] for b in message["content"]] == ["thinking", "text", "tool_use"]
    assert message["content"][2]["input"] == {"a": 1} and message["stop_reason"] == "tool_use"
    assert message["usage"]["output_tokens_details"] == {"thinking_tokens": 3}

    kinds = [(e["type"], e.get("index")) for e in events]
    assert kinds == [
        ("message_start", None),
        ("ping", None),
        ("content_block_start", 0),
        ("content_block_delta", 0),
        ("content_block_delta", 0),
        ("content_block_stop", 0),
        ("content_block_start", 1),
        ("content_block_delta", 1),
        ("content_block_stop", 1),
        ("content_block_start", 2),
        ("content_block_delta", 2),
        ("content_block_delta", 2),
        ("content_block_stop", 2),
        ("message_delta", None),
        ("message_stop", None),
    ]
    for event in events:
        MessagesStreamEvent.model_validate(event)  # every event is one the document describes


@pytest.mark.parametrize(
    ("finish_reason", "stop", "expected"),
    [
        ("length", None, ("max_tokens", None)),
        ("stop", "END", ("stop_sequence", "END")),
        ("stop", 2, ("end_turn", None)),
    ],
)
def test_stop_reasons(finish_reason, stop, expected):
    events = MessageEvents("msg_1", "m", 1)
    (delta, _) = events.finished(finish_reason, stop, 1, None)
    assert (delta["delta"]["stop_reason"], delta["delta"]["stop_sequence"]) == expected
    assert "output_tokens_details" not in delta["usage"]


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (404, "not_found_error"),
        (413, "request_too_large"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (503, "overloaded_error"),
        (504, "timeout_error"),
    ],
)
def test_a_failure_is_an_error_event_in_anthropics_shape(status, kind):
    (event,) = MessageEvents("msg_1", "m", 1).failed(APIError(status, "no"))
    assert event == {"type": "error", "error": {"type": kind, "message": "no"}}
    MessagesStreamEvent.model_validate(event)
    assert APIError(status, "no").body_for("/v1/chat/completions")["error"]["message"] == "no"
