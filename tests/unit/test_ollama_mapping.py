"""Ollama's API without a server: options and messages as chat's fields (server/ollama/chat_request.py),
and the answer's lines (server/ollama/replies.py)."""

from __future__ import annotations

import json

import pytest

from engine.errors import InvalidRequestError
from server.ollama.chat_request import chat_messages, chat_request, generate_messages, max_tokens, sampling_fields
from server.ollama.replies import OllamaReply, loaded_line
from server.protocol.chat import ResponseToolCall, ToolCallFunction
from server.protocol.ollama import ChatLine, ChatRequest, GenerateLine, GenerateRequest, Message, Options
from server.routes.ollama_models import _parameter_size


def test_options_become_chats_sampling_fields():
    options = Options(temperature=0.2, top_p=0.9, top_k=40, min_p=0.05, repeat_penalty=1.1, seed=-1, stop=["x"])
    assert sampling_fields(options) == {
        "temperature": 0.2,
        "top_p": 0.9,
        "seed": None,  # negative: a random seed
        "stop": ["x"],
        "top_k": 40,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
    }
    assert sampling_fields(Options(seed=7))["seed"] == 7 and sampling_fields(None) == {}


@pytest.mark.parametrize(
    ("options", "prompt_tokens", "expected"),
    [
        (None, 10, None),
        (Options(num_predict=-1), 10, None),
        (Options(num_predict=-2), 10, None),
        (Options(num_predict=5), 10, 5),
        (Options(num_ctx=16), 10, 6),
        (Options(num_ctx=16, num_predict=3), 10, 3),
        (Options(num_ctx=16, num_predict=30), 10, 6),
    ],
)
def test_num_predict_within_num_ctx(options, prompt_tokens, expected):
    assert max_tokens(options, prompt_tokens, max_model_len=64) == expected


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (Options(num_ctx=65), "more than the model's context"),
        (Options(num_ctx=10), "no room"),
        (Options(num_predict=0), "num_predict"),
    ],
)
def test_impossible_limits_are_refused(options, match):
    with pytest.raises(InvalidRequestError, match=match):
        max_tokens(options, 10, max_model_len=64)


@pytest.mark.parametrize("options", [{"mirostat": 1}, {"typical_p": 0.5}, {"tfs_z": 0.9}, {"unknown": 1}])
def test_samplers_this_server_lacks_are_refused_unless_off(options):
    with pytest.raises(ValueError):
        Options.model_validate(options)
    Options.model_validate({"mirostat": 0, "typical_p": 1.0, "tfs_z": 1, "num_gpu": 99, "use_mmap": True})


def test_think_and_format_reach_chat():
    body = ChatRequest(model="m", messages=[Message(role="user", content="hi")], think=True, format="json")
    chat = chat_request(body, chat_messages(body.messages))
    assert chat.chat_template_kwargs == {"enable_thinking": True} and chat.response_format.type == "json_object"
    body = ChatRequest(model="m", messages=[Message(role="user", content="hi")], think="low", format={"type": "string"})
    chat = chat_request(body, chat_messages(body.messages))
    assert chat.reasoning_effort == "low" and chat.response_format.json_schema.schema_ == {"type": "string"}
    assert chat.stream is True  # Ollama streams unless told not to


def test_tool_turns_answer_the_last_call_of_their_tool():
    messages = chat_messages(
        [
            Message(role="user", content="add"),
            Message(
                role="assistant",
                tool_calls=[
                    {"function": {"name": "add", "arguments": {"a": 1}}},
                    {"id": "mine", "function": {"name": "sub", "arguments": {}}},
                ],
            ),
            Message(role="tool", content="2", tool_name="add"),
            Message(role="tool", content="0", tool_name="sub"),
        ]
    )
    calls = messages[1].tool_calls
    assert [(c.id, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("call_1_0", "add", {"a": 1}),
        ("mine", "sub", {}),
    ]
    assert [(m.role, m.content, m.tool_call_id) for m in messages[2:]] == [
        ("tool", "2", "call_1_0"),
        ("tool", "0", "mine"),
    ]


def test_generate_is_a_system_and_user_turn_and_refuses_what_it_cannot_do():
    turns = generate_messages(GenerateRequest(model="m", prompt="hi", system="be brief"))
    assert [(t.role, t.content) for t in turns] == [("system", "be brief"), ("user", "hi")]
    for field, value in (("suffix", "}"), ("template", "{{ .Prompt }}"), ("images", ["AAAA"])):
        with pytest.raises(InvalidRequestError, match=field):
            generate_messages(GenerateRequest(model="m", prompt="hi", **{field: value}))
    with pytest.raises(InvalidRequestError, match="images"):
        chat_messages([Message(role="user", content="see", images=["AAAA"])])


def test_reply_lines():
    reply = OllamaReply("m", "generate", [1, 2, 3])
    first = reply.piece("", "Hel", [7], None)
    assert first["response"] == "Hel" and first["done"] is False and "context" not in first
    assert reply.piece("", "", [], None) is None
    last = reply.last("length", 2, token_ids=[8])
    GenerateLine.model_validate(last)
    assert last["done_reason"] == "length" and last["context"] == [1, 2, 3, 7, 8] and last["prompt_eval_count"] == 3
    assert last["total_duration"] >= last["prompt_eval_duration"] + last["eval_duration"]

    chat = OllamaReply("m", "chat", [1])
    call = ResponseToolCall(id="c1", function=ToolCallFunction(name="add", arguments='{"a": 1}'))
    line = chat.calls([call])
    ChatLine.model_validate(line)
    assert line["message"]["tool_calls"] == [
        {"id": "c1", "function": {"name": "add", "arguments": {"a": 1}, "index": 0}}
    ]
    whole = chat.last("stop", 3, "Hi", "hmm")
    assert (whole["message"]["content"], whole["message"]["thinking"], whole["done_reason"]) == ("Hi", "hmm", "stop")
    assert loaded_line("m", "chat")["done_reason"] == "load"


@pytest.mark.parametrize(
    ("count", "text"), [(None, ""), (123_456, "123.5K"), (135_000_000, "135M"), (1_100_000_000, "1.1B")]
)
def test_parameter_sizes_read_as_ollamas(count, text):
    assert _parameter_size(count) == text


def test_a_whole_answer_times_its_prompt_to_the_first_token():
    reply = OllamaReply("m", "chat", [1, 2])
    first = (reply._start + 5_000_000) / 1e9  # 5 ms after the request began, on time.monotonic()'s clock
    line = reply.last("stop", 4, "Hi", token_ids=[3, 4, 5, 6], first_token_time=first)
    assert abs(line["prompt_eval_duration"] - 5_000_000) < 1_000
    assert line["eval_duration"] == line["total_duration"] - line["prompt_eval_duration"]
