"""Incremental detokenization: whole UTF-8 text deltas and stop strings.

Decoding one token at a time breaks multi-byte characters and SentencePiece
spaces, so each step decodes a short window of recent tokens twice (with and
without the new ones) and emits the difference once it no longer ends in a
replacement character (an incomplete UTF-8 sequence).

Stop strings may span tokens. Text that could still be the beginning of a stop
string is held back until it is known not to be one.
"""

from __future__ import annotations

from engine.core.sequence import Sequence
from engine.text.tokenizer import Tokenizer


def append_token_text(tokenizer: Tokenizer, seq: Sequence) -> None:
    """Decode the sequence's newest token(s) into seq.output_text."""
    skip = seq.params.skip_special_tokens
    ids = seq.token_ids
    prefix_text = tokenizer.decode(ids[seq.prefix_offset : seq.read_offset], skip_special_tokens=skip)
    full_text = tokenizer.decode(ids[seq.prefix_offset :], skip_special_tokens=skip)
    if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
        seq.output_text += full_text[len(prefix_text) :]
        seq.prefix_offset = seq.read_offset
        seq.read_offset = len(ids)


def find_stop_string(seq: Sequence, num_new_chars: int) -> str | None:
    """If a stop string now occurs in the output, cut the text there and return it."""
    text = seq.output_text
    for stop in seq.params.stop:
        # Only a match that overlaps the new characters is new.
        start = max(0, len(text) - num_new_chars - len(stop) + 1)
        position = text.find(stop, start)
        if position != -1:
            end = position + len(stop) if seq.params.include_stop_str_in_output else position
            seq.output_text = text[:end]
            return stop
    return None


def take_new_text(seq: Sequence) -> str:
    """The output text not yet emitted, minus a tail that might begin a stop string."""
    end = len(seq.output_text)
    if not seq.is_finished and seq.params.stop:
        end -= _stop_prefix_length(seq.output_text, seq.params.stop)
    if end <= seq.num_emitted_chars:
        return ""
    delta = seq.output_text[seq.num_emitted_chars : end]
    seq.num_emitted_chars = end
    return delta


def _stop_prefix_length(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some stop string."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest
