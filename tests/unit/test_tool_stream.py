"""ToolReplyStream: a constrained tool-call reply, fed in any pieces, gives deltas that join back
into exactly the calls (or the text answer) the whole reply holds."""

from __future__ import annotations

import json
import random

import pytest

from server.openai.tool_stream import GENERIC, GENERIC_CALLS_ONLY, HERMES, ToolReplyStream

CALLS = [("get_weather", {"city": 'Pa"ris\\', "unit": "C", "nested": {"a": [1, {"b": "}]"}]}}), ("get_time", {})]


def _feed(stream: ToolReplyStream, text: str, seed: int) -> list[dict]:
    rng = random.Random(seed)
    deltas, i = [], 0
    while i < len(text):
        step = rng.randint(1, 7)
        deltas += stream.feed(text[i : i + step])
        i += step
    return deltas


def _calls(deltas: list[dict]) -> list[tuple[str, str]]:
    joined: dict[int, list] = {}
    for delta in deltas:
        for call in delta.get("tool_calls", []):
            if call["index"] not in joined:
                assert call["id"].startswith("call_") and call["type"] == "function"
                joined[call["index"]] = [call["function"]["name"], call["function"]["arguments"]]
            else:
                joined[call["index"]][1] += call["function"]["arguments"]
    return [(name, arguments) for name, arguments in joined.values()]


def _compact(value) -> str:
    return json.dumps(value, separators=(",", ":"))


@pytest.mark.parametrize("seed", range(5))
def test_generic_calls_arrive_name_first_then_argument_fragments(seed):
    reply = _compact({"tool_calls": [{"name": n, "arguments": a} for n, a in CALLS]})
    for framing in (GENERIC, GENERIC_CALLS_ONLY):
        stream = ToolReplyStream(framing)
        calls = _calls(_feed(stream, reply, seed))
        assert [(n, json.loads(a)) for n, a in calls] == CALLS
        assert stream.made_calls and not stream.is_answering


@pytest.mark.parametrize("seed", range(5))
def test_hermes_blocks_stream_the_same_way(seed):
    reply = "\n".join(f"<tool_call>\n{_compact({'name': n, 'arguments': a})}\n</tool_call>" for n, a in CALLS)
    calls = _calls(_feed(ToolReplyStream(HERMES), reply, seed))
    assert [(n, json.loads(a)) for n, a in calls] == CALLS


@pytest.mark.parametrize("seed", range(5))
def test_a_text_answer_streams_as_content_with_escapes_decoded(seed):
    answer = 'It is "sunny"\\ in Paris – 21 °C\nsee you ☀'
    stream = ToolReplyStream(GENERIC)
    deltas = _feed(stream, _compact({"response": answer}), seed)
    assert "".join(d["content"] for d in deltas) == answer and stream.is_answering and not stream.made_calls


def test_an_escape_cut_in_two_waits_for_its_second_half():
    stream = ToolReplyStream(GENERIC)
    assert stream.feed('{"response":"caf\\u00') == [{"content": "caf"}]
    assert stream.feed('e9!"}') == [{"content": "é!"}]


def test_a_reply_cut_short_sends_only_what_is_certain():
    stream = ToolReplyStream(GENERIC_CALLS_ONLY)
    deltas = stream.feed('{"tool_calls":[{"name":"get_wea')
    assert deltas == [] and not stream.made_calls
