"""Incremental detokenization of one sample: whole UTF-8 text deltas and stop strings.

Decoding one token at a time breaks multi-byte characters and SentencePiece
spaces, so each new token decodes a short window of recent tokens twice (with
and without the new ones) and emits the difference once it no longer ends in a
replacement character (an incomplete UTF-8 sequence).

Stop strings may span tokens. Text that could still be the beginning of a stop
string is held back until it is known not to be one.
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
        self.output_text = ""

    def add_token(self, token_id: int, num_generated_tokens: int) -> str | None:
        """Append one generated token; returns the stop string if the output now contains one.

        On a stop string the text is cut there (after it with include_stop_str_in_output).
        Stop strings count only once `num_generated_tokens` reaches min_tokens.
        """
        self._token_ids.append(token_id)
        num_before = len(self.output_text)
        self._decode_newest()
        if self._params.stop and num_generated_tokens >= self._params.min_tokens:
            return self._find_stop_string(len(self.output_text) - num_before)
        return None

    def take_new_text(self, is_finished: bool) -> str:
        """The output text not yet emitted, minus a tail that might begin a stop string."""
        end = len(self.output_text)
        if not is_finished and self._params.stop:
            end -= _stop_prefix_length(self.output_text, self._params.stop)
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

    def _find_stop_string(self, num_new_chars: int) -> str | None:
        text = self.output_text
        for stop in self._params.stop:
            # Only a match that overlaps the new characters is new.
            start = max(0, len(text) - num_new_chars - len(stop) + 1)
            position = text.find(stop, start)
            if position != -1:
                end = position + len(stop) if self._params.include_stop_str_in_output else position
                self.output_text = text[:end]
                return stop
        return None


def _stop_prefix_length(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some stop string."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest
