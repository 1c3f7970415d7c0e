"""Reasoning models: their thinking apart from their answer.

With `--reasoning-parser think` (also named `qwen3` and `deepseek_r1`, the families that write it), a
model's output `<think>...</think>answer` becomes `reasoning_content` (the thought) and `content` (the
answer). The template may open the block itself (DeepSeek-R1's, Qwen3.5's: the prompt ends inside it, so
only `</think>` appears in the output), or close it empty (Qwen3's with `enable_thinking: false`: no
thinking at all); `ThinkingStart` reads which from the prompt's tokens.

`ReasoningSplitter` splits text as it streams in (a tag cut across two deltas is held back until it is
whole); `ReasoningTokens` counts the thinking's tokens for `usage.completion_tokens_details`. Structured
output and tool calls apply to the answer only (engine/structured/thinking.py frees the thinking's tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine import CompletionOutput, ThinkingSpan
from engine.errors import InvalidRequestError, ModelLoadError

START_TAG = "<think>"
END_TAG = "</think>"
# reasoning_effort -> the template's `enable_thinking` switch, for a template that has one and no effort
# variable of its own.
_THINKS = {"none": False, "minimal": False, "low": True, "medium": True, "high": True, "xhigh": True}


@dataclass(frozen=True)
class ThinkTokens:
    """The ids of a reasoning model's `<think>` and `</think>` tokens."""

    start_id: int
    end_id: int

    def span(self, prompt_ids: list[int]) -> ThinkingSpan | None:
        """How an answer to this prompt thinks: None when the prompt closed the block already (no
        thinking: the grammar applies from the first token)."""
        start = _last_index(prompt_ids, self.start_id)
        end = _last_index(prompt_ids, self.end_id)
        if end > start:
            return None
        return ThinkingSpan(self.start_id, self.end_id, open_at_start=start >= 0)


def _last_index(ids: list[int], token_id: int) -> int:
    for position in range(len(ids) - 1, -1, -1):
        if ids[position] == token_id:
            return position
    return -1


def think_tokens(parser: str | None, vocabulary: dict[str, int]) -> ThinkTokens | None:
    """The parser's tokens in this model's vocabulary (None: no parser); a model without both as single
    tokens cannot be parsed reliably, so it is refused at start."""
    if parser in (None, "none"):
        return None
    missing = [tag for tag in (START_TAG, END_TAG) if tag not in vocabulary]
    if missing:
        raise ModelLoadError(
            f"--reasoning-parser {parser}: this model's vocabulary has no {' or '.join(missing)} token, so it does "
            "not write thinking blocks the parser reads (start without --reasoning-parser)"
        )
    return ThinkTokens(vocabulary[START_TAG], vocabulary[END_TAG])


def template_kwargs(
    defaults: dict[str, Any], requested: dict[str, Any] | None, reasoning_effort: str | None, template: str | None
) -> dict[str, Any]:
    """The chat template's extra variables: the server's defaults, then reasoning_effort as the template reads
    it (its own variable, else its `enable_thinking` switch), then the request's own kwargs over both."""
    kwargs = dict(defaults)
    if reasoning_effort is not None:
        kwargs["reasoning_effort"] = reasoning_effort
        if template is not None and "enable_thinking" in template and "reasoning_effort" not in template:
            kwargs["enable_thinking"] = _THINKS[reasoning_effort]
    kwargs.update(requested or {})
    return kwargs


def check_template_kwargs(kwargs: dict[str, Any] | None) -> None:
    """Template variables are names (a template reads them as such)."""
    for name in kwargs or {}:
        if not name.isidentifier():
            raise InvalidRequestError(
                f"chat_template_kwargs: {name[:64]!r} is not a template variable name", "chat_template_kwargs"
            )


class ReasoningSplitter:
    """One sample's text, split into (reasoning, content) as it arrives.

    inside: the prompt opened the thinking block. Otherwise the output opens one only as its first
    text (after blanks); text that starts any other way is all content. The blanks around the thought and
    between `</think>` and the answer are dropped; an answer without thinking is passed through as it is.
    """

    def __init__(self, inside: bool) -> None:
        self._state = "inside" if inside else "start"
        self._held = ""  # text that may be the start of a tag, or blanks whose fate is not known yet
        self._thought_started = False
        self.has_thought = inside

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of this piece; either may be empty."""
        reasoning: list[str] = []
        content: list[str] = []
        text = self._held + text
        self._held = ""
        while text:
            if self._state == "start":
                stripped = text.lstrip()
                if stripped.startswith(START_TAG):
                    self._state, self.has_thought = "inside", True
                    text = stripped[len(START_TAG) :]
                elif START_TAG.startswith(stripped):  # blanks, or a prefix of the tag: wait for more
                    self._held = text
                    text = ""
                else:
                    self._state = "answer"
            elif self._state == "inside":
                if not self._thought_started:
                    text = text.lstrip()
                    if not text:
                        break
                    self._thought_started = True
                end = text.find(END_TAG)
                if end >= 0:
                    reasoning.append(text[:end].rstrip())
                    self._state = "after"
                    text = text[end + len(END_TAG) :]
                    continue
                keep = _partial_suffix(text, END_TAG)
                body, tail = text[: len(text) - keep], text[len(text) - keep :]
                trimmed = body.rstrip()
                reasoning.append(trimmed)
                self._held = body[len(trimmed) :] + tail  # trailing blanks: the thought's, unless it goes on
                text = ""
            elif self._state == "after":
                text = text.lstrip()
                if text:
                    self._state = "answer"
            else:
                content.append(text)
                text = ""
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What is still held at the end: an unfinished tag's text is text after all."""
        held, self._held = self._held, ""
        if self._state == "start":
            return "", held
        if self._state == "inside":
            return held.rstrip(), ""
        return "", ""

    def split(self, text: str) -> tuple[str | None, str | None]:
        """A whole text's (reasoning or None, content or None), as chat's message carries them."""
        reasoning, content = self.feed(text)
        more_reasoning, more_content = self.finish()
        reasoning, content = reasoning + more_reasoning, content + more_content
        return (reasoning if self.has_thought else None), (content if content or not self.has_thought else None)


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag`."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


class ReasoningTokens:
    """Counts one sample's thinking tokens (tags included) as its token ids arrive."""

    def __init__(self, tokens: ThinkTokens, inside: bool) -> None:
        self._tokens = tokens
        self._state = "inside" if inside else "start"
        self.count = 0

    def feed(self, token_ids: list[int]) -> None:
        for token_id in token_ids:
            if self._state == "start":
                self._state = "inside" if token_id == self._tokens.start_id else "answer"
            if self._state == "inside":
                self.count += 1
                if token_id == self._tokens.end_id:
                    self._state = "answer"


class ReasoningPlan:
    """One request's reasoning split, whole (`split`, `count`) or streamed per sample (`feed`, `finish`)."""

    def __init__(self, tokens: ThinkTokens, prompt_ids: list[int]) -> None:
        self.tokens = tokens
        # None: the prompt closed the thinking block (e.g. enable_thinking false), so the output is all answer
        self.span = tokens.span(prompt_ids)
        self._splitters: dict[int, ReasoningSplitter] = {}
        self._counters: dict[int, ReasoningTokens] = {}

    def _inside(self) -> bool:
        return self.span is not None and self.span.open_at_start

    def split(self, text: str) -> tuple[str | None, str | None]:
        if self.span is None:
            return None, text
        return ReasoningSplitter(self._inside()).split(text)

    def count(self, token_ids: list[int]) -> int:
        if self.span is None:
            return 0
        counter = ReasoningTokens(self.tokens, self._inside())
        counter.feed(token_ids)
        return counter.count

    def feed(self, index: int, text: str, token_ids: list[int]) -> tuple[str, str]:
        """Sample `index`'s next (reasoning, content) pieces."""
        if self.span is None:
            return "", text
        if index not in self._splitters:
            self._splitters[index] = ReasoningSplitter(self._inside())
            self._counters[index] = ReasoningTokens(self.tokens, self._inside())
        self._counters[index].feed(token_ids)
        return self._splitters[index].feed(text)

    def finish(self, index: int) -> tuple[str, str]:
        splitter = self._splitters.get(index)
        return splitter.finish() if splitter is not None else ("", "")

    def split_delta(self, delta: CompletionOutput) -> tuple[str, str]:
        """A streamed delta's (thinking, answer) pieces; a sample's last one brings what the split still held."""
        thought, text = self.feed(delta.index, delta.text, delta.token_ids)
        if delta.finish_reason is not None:
            more_thought, more_text = self.finish(delta.index)
            thought, text = thought + more_thought, text + more_text
        return thought, text

    @property
    def streamed_reasoning_tokens(self) -> int:
        return sum(counter.count for counter in self._counters.values())
