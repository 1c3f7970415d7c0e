"""The reasoning split (server/openai/reasoning.py) and the grammar gate behind the thinking
(engine/structured/thinking.py), on plain text and token ids."""

from __future__ import annotations

import pytest

from engine.errors import InvalidRequestError, ModelLoadError
from engine.structured.thinking import ThinkingFirst, ThinkingSpan, grammar_constraint
from server.openai.reasoning import (
    ReasoningPlan,
    ReasoningSplitter,
    ReasoningTokens,
    ThinkTokens,
    check_template_kwargs,
    template_kwargs,
    think_tokens,
)

# (output text, the prompt opened the block) -> (reasoning or None, content or None)
CASES = [
    ("<think>\nI add 2 and 3.\n</think>\n\nFive.", False, ("I add 2 and 3.", "Five.")),
    ("  <think>a</think>b", False, ("a", "b")),
    ("Five, without thinking.", False, (None, "Five, without thinking.")),
    ("  Five <think>is not a thought here</think>", False, (None, "  Five <think>is not a thought here</think>")),
    ("<think>cut off while thinking", False, ("cut off while thinking", None)),
    ("<think>done</think>", False, ("done", None)),
    ("<thi", False, (None, "<thi")),  # a tag that never completes is text
    ("I add 2 and 3.\n</think>\n\nFive.", True, ("I add 2 and 3.", "Five.")),
    ("a </think\u00e9 b", True, ("a </think\u00e9 b", None)),
    ("\n\nstill thinking  ", True, ("still thinking", None)),
    ("a</think>b</think>c", True, ("a", "b</think>c")),  # only the first end tag ends the thought
    ("", False, (None, "")),
]


@pytest.mark.parametrize(("text", "inside", "expected"), CASES)
def test_a_whole_text_splits_into_thought_and_answer(text: str, inside: bool, expected: tuple) -> None:
    assert ReasoningSplitter(inside).split(text) == expected


@pytest.mark.parametrize(("text", "inside", "expected"), CASES)
def test_the_streamed_split_is_the_whole_split_at_every_cut(text: str, inside: bool, expected: tuple) -> None:
    """Cut into two pieces at every position, and into single characters: the pieces join to the whole split."""
    cuts = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    want_reasoning, want_content = (part or "" for part in expected)
    for pieces in cuts:
        splitter = ReasoningSplitter(inside)
        fed = [splitter.feed(piece) for piece in pieces] + [splitter.finish()]
        assert "".join(r for r, _ in fed) == want_reasoning, pieces
        assert "".join(c for _, c in fed) == want_content, pieces
        assert splitter.has_thought == (expected[0] is not None)


TOKENS = ThinkTokens(start_id=100, end_id=101)


@pytest.mark.parametrize(
    ("ids", "inside", "count"),
    [
        ([100, 5, 6, 101, 7, 8], False, 4),  # the tags are thinking tokens too
        ([5, 100, 6, 101], False, 0),  # a start tag that is not first opens nothing
        ([5, 6, 101, 7], True, 3),
        ([5, 6], True, 2),  # cut while thinking: every token
        ([100, 5, 6], False, 3),
    ],
)
def test_reasoning_tokens_count_the_thinking(ids: list[int], inside: bool, count: int) -> None:
    counter = ReasoningTokens(TOKENS, inside)
    for token in ids:  # one at a time, as a stream brings them
        counter.feed([token])
    assert counter.count == count


def test_the_prompt_says_whether_the_answer_thinks() -> None:
    assert TOKENS.span([1, 2, 3]) == ThinkingSpan(100, 101, open_at_start=False)  # the model may open one
    assert TOKENS.span([1, 100, 9]) == ThinkingSpan(100, 101, open_at_start=True)  # the template opened it
    assert TOKENS.span([1, 100, 9, 101, 9]) is None  # closed empty (enable_thinking false): no thinking
    # an earlier turn's closed block, then a new open one
    assert TOKENS.span([100, 101, 5, 100]) == ThinkingSpan(100, 101, open_at_start=True)
    plan = ReasoningPlan(TOKENS, [1, 100, 101])
    assert plan.split("<think>a</think>b") == (None, "<think>a</think>b")  # all answer, as written
    assert plan.count([100, 5, 101]) == 0
    assert plan.feed(0, "<think>a", [100, 5]) == ("", "<think>a")


def test_a_streamed_plan_keeps_each_sample_apart() -> None:
    plan = ReasoningPlan(TOKENS, [1, 2])
    assert plan.feed(0, "<think>x", [100, 5]) == ("x", "")
    assert plan.feed(1, "plain", [7]) == ("", "plain")
    assert plan.feed(0, "</think>y", [101, 6]) == ("", "y")
    assert plan.finish(0) == ("", "") and plan.finish(1) == ("", "")
    assert plan.streamed_reasoning_tokens == 3


def test_think_tokens_need_both_tags_in_the_vocabulary() -> None:
    assert think_tokens("none", {}) is None
    assert think_tokens("qwen3", {"<think>": 7, "</think>": 8}) == ThinkTokens(7, 8)
    with pytest.raises(ModelLoadError, match=r"--reasoning-parser think: .* no </think> token"):
        think_tokens("think", {"<think>": 7})


def test_template_kwargs_merge_and_map_reasoning_effort() -> None:
    switch = "{% if enable_thinking %}...{% endif %}"
    assert template_kwargs({"a": 1, "b": 2}, {"b": 3}, None, switch) == {"a": 1, "b": 3}
    assert template_kwargs({}, None, "none", switch) == {"reasoning_effort": "none", "enable_thinking": False}
    assert template_kwargs({}, None, "high", switch) == {"reasoning_effort": "high", "enable_thinking": True}
    assert template_kwargs({"enable_thinking": False}, None, "high", switch)["enable_thinking"] is True
    # the request's own switch wins; a template with an effort variable of its own gets the effort alone
    assert template_kwargs({}, {"enable_thinking": True}, "none", switch)["enable_thinking"] is True
    assert template_kwargs({}, None, "low", "{{ reasoning_effort }} enable_thinking") == {"reasoning_effort": "low"}
    assert template_kwargs({}, None, "low", None) == {"reasoning_effort": "low"}
    check_template_kwargs({"enable_thinking": False})
    with pytest.raises(InvalidRequestError, match="not a template variable name"):
        check_template_kwargs({"not a name": 1})


class _Matcher:
    """A grammar matcher that records what it consumed."""

    def __init__(self) -> None:
        self.consumed: list[int] = []

    def consume_token(self, token_id: int) -> None:
        self.consumed.append(token_id)

    def is_stopped(self) -> bool:
        return bool(self.consumed)


def test_the_grammar_starts_after_the_thinking() -> None:
    matcher = _Matcher()
    gate = ThinkingFirst(matcher, ThinkingSpan(100, 101, open_at_start=False))
    assert grammar_constraint(gate) == (matcher, (100,))  # first token: the grammar's, or the start tag
    gate.consume_token(100)
    assert grammar_constraint(gate) == (None, ())  # thinking: free
    for token in (5, 6):
        gate.consume_token(token)
        assert not gate.is_stopped()
    gate.consume_token(101)
    assert grammar_constraint(gate) == (matcher, ())
    gate.consume_token(9)
    assert matcher.consumed == [9] and gate.is_stopped()


def test_an_answer_that_does_not_think_is_constrained_from_its_first_token() -> None:
    matcher = _Matcher()
    gate = ThinkingFirst(matcher, ThinkingSpan(100, 101, open_at_start=False))
    gate.consume_token(9)
    assert grammar_constraint(gate) == (matcher, ()) and matcher.consumed == [9]
    opened = ThinkingFirst(_Matcher(), ThinkingSpan(100, 101, open_at_start=True))
    assert grammar_constraint(opened) == (None, ())
    plain = _Matcher()
    assert grammar_constraint(plain) == (plain, ())  # a request without thinking: its matcher, always
