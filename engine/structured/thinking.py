"""Structured output after a reasoning model's thinking: the grammar constrains the answer, not the thought.

A reasoning model writes its thinking between a start and an end token (`<think>` and `</think>` in Qwen3's
and DeepSeek-R1's vocabularies) and its answer after them. `ThinkingSpan` is the plain data a request carries
(in `SamplingParams.thinking`); `ThinkingFirst` wraps a sequence's grammar matcher so that the tokens inside
the thinking are free and the grammar starts with the first token after the end token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_INSIDE = "inside"  # thinking: every token is free, the end token closes it
_MAY_OPEN = "may_open"  # the first output token: the start token opens thinking, any other begins the answer
_ANSWER = "answer"  # the grammar constrains every token


@dataclass(frozen=True)
class ThinkingSpan:
    """start_token_id / end_token_id: the tokens that open and close the thinking. open_at_start: the prompt
    ends inside an open thinking block (the chat template opened it); otherwise the output may open one
    with its first token."""

    start_token_id: int
    end_token_id: int
    open_at_start: bool = False


class ThinkingFirst:
    """A grammar matcher (llguidance's) that applies only once the thinking is over. The scheduler feeds it
    each sampled token (`consume_token`), the mask reads `active` and `also_allowed`."""

    def __init__(self, matcher: Any, span: ThinkingSpan) -> None:
        self.matcher = matcher
        self.span = span
        self._state = _INSIDE if span.open_at_start else _MAY_OPEN

    @property
    def active(self) -> Any | None:
        """The matcher when it constrains the next token; None while thinking (no mask)."""
        return None if self._state == _INSIDE else self.matcher

    @property
    def also_allowed(self) -> tuple[int, ...]:
        """Tokens allowed next besides the grammar's: the start token, where the output may open thinking."""
        return (self.span.start_token_id,) if self._state == _MAY_OPEN else ()

    def consume_token(self, token_id: int) -> None:
        if self._state == _INSIDE:
            if token_id == self.span.end_token_id:
                self._state = _ANSWER
            return
        if self._state == _MAY_OPEN:
            if token_id == self.span.start_token_id:
                self._state = _INSIDE
                return
            self._state = _ANSWER
        self.matcher.consume_token(token_id)

    def is_stopped(self) -> bool:
        """The grammar has ended (never while thinking: its answer is still to come)."""
        return self._state == _ANSWER and self.matcher.is_stopped()


def grammar_constraint(matcher: Any) -> tuple[Any | None, tuple[int, ...]]:
    """(the llguidance matcher that constrains the next token or None, tokens allowed besides its own)."""
    if isinstance(matcher, ThinkingFirst):
        return matcher.active, matcher.also_allowed
    return matcher, ()
