"""Incremental detokenization of one sample: whole UTF-8 text deltas and stop strings.

Decoding one token at a time breaks multi-byte characters and SentencePiece
spaces, so each new token decodes a short window of recent tokens twice (with
and without the new ones) and emits the difference once it no longer ends in a
replacement character (an incomplete UTF-8 sequence).

Stop strings may span tokens. Text that could still be the beginning of a stop
string is held back until it is known not to be one. `StopStringMatcher` finds
them with one Knuth-Morris-Pratt automaton per stop string, advanced once per new
character, so the per-token cost does not grow with the stop strings' length.
"""

from __future__ import annotations

from engine.params import SamplingParams
from engine.text.tokenizer import Tokenizer

# Tokens decoded before the new ones: enough context for SentencePiece's leading-space rule.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """The text of one sample, grown one token at a time. One owner: the output processor."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._tokenizer = tokenizer
        self._params = params
        self._token_ids = list(prompt_token_ids)
        self._prefix_offset = max(len(prompt_token_ids) - _CONTEXT_TOKENS, 0)
        self._read_offset = len(prompt_token_ids)
        self._num_emitted_chars = 0
        self._stop_matcher = StopStringMatcher(params.stop)
        self.output_text = ""

    def add_token(self, token_id: int, num_generated_tokens: int) -> str | None:
        """Append one generated token; returns the stop string if the output now contains one.

        On a stop string the text is cut there (after it with include_stop_str_in_output).
        Stop strings count only once `num_generated_tokens` reaches min_tokens.
        """
        self._token_ids.append(token_id)
        num_before = len(self.output_text)
        self._decode_newest()
        if not self._params.stop or len(self.output_text) == num_before:
            return None
        counts = num_generated_tokens >= self._params.min_tokens
        match = self._stop_matcher.feed(self.output_text[num_before:], counts)
        if match is None:
            return None
        end_in_new_text, stop = match
        end = num_before + end_in_new_text
        self.output_text = self.output_text[: end if self._params.include_stop_str_in_output else end - len(stop)]
        return stop

    def take_new_text(self, is_finished: bool) -> str:
        """The output text not yet emitted, minus a tail that might begin a stop string."""
        end = len(self.output_text)
        if not is_finished and self._params.stop:
            end -= self._stop_matcher.held_back_length()
        if end <= self._num_emitted_chars:
            return ""
        delta = self.output_text[self._num_emitted_chars : end]
        self._num_emitted_chars = end
        return delta

    def _decode_newest(self) -> None:
        skip = self._params.skip_special_tokens
        ids = self._token_ids
        decode = self._tokenizer.decode
        prefix_text = decode(ids[self._prefix_offset : self._read_offset], skip_special_tokens=skip)
        full_text = decode(ids[self._prefix_offset :], skip_special_tokens=skip)
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            self.output_text += full_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(ids)


class _StopAutomaton:
    """One stop string's Knuth-Morris-Pratt matcher over text that arrives in pieces.

    `state` is the length of the longest tail of the text seen so far that is a prefix of the stop
    string; it reaches len(stop) on a match. Falling back on a mismatch uses the border table
    (`_borders[i]`: the longest proper prefix of stop[: i + 1] that is also its suffix), which is
    filled only as far as the state has reached, so a long stop string costs nothing up front and
    every character costs amortised O(1).
    """

    __slots__ = ("stop", "state", "_borders")

    def __init__(self, stop: str) -> None:
        self.stop = stop
        self.state = 0
        self._borders = [0]

    def _border(self, length: int) -> int:
        """The longest proper prefix of stop[:length] that is also its suffix (length >= 1)."""
        borders, stop = self._borders, self.stop
        while len(borders) < length:
            i = len(borders)
            k = borders[i - 1]
            while k > 0 and stop[i] != stop[k]:
                k = borders[k - 1]
            borders.append(k + 1 if stop[i] == stop[k] else k)
        return borders[length - 1]

    def advance(self, char: str) -> bool:
        """Consume one character; True when the text now ends with the stop string."""
        stop, state = self.stop, self.state
        if state == len(stop):  # a match that did not count (min_tokens): keep its longest border
            state = self._border(state)
        while state > 0 and stop[state] != char:
            state = self._border(state)
        if stop[state] == char:
            state += 1
        self.state = state
        return state == len(stop)

    def held_back_length(self) -> int:
        """The longest tail of the text that is a proper prefix of the stop string."""
        return self._border(self.state) if self.state == len(self.stop) else self.state


class StopStringMatcher:
    """Finds stop strings in one sample's text as it grows; one owner: its detokenizer."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._automata = [_StopAutomaton(stop) for stop in stops]

    def feed(self, new_text: str, counts: bool) -> tuple[int, str] | None:
        """Advance over `new_text`. When `counts`, the first stop string (in the order given) with a
        match ending inside `new_text` is returned with the offset in `new_text` where its earliest
        such match ends; matches before `counts` holds (min_tokens) are passed over."""
        for automaton in self._automata:
            for offset, char in enumerate(new_text, start=1):
                if automaton.advance(char) and counts:
                    return offset, automaton.stop
        return None

    def held_back_length(self) -> int:
        """Length of the longest tail of the text so far that is a proper prefix of some stop string."""
        return max((automaton.held_back_length() for automaton in self._automata), default=0)
