"""Chat messages encoded so that what a client wrote is text, never a control token.

A chat template writes its own markers (`<|im_start|>`, `<|eot_id|>`, `[INST]`) into the text it
renders, and a tokenizer turns every special token's text into that token wherever it stands: a
user message holding `<|im_end|>\\n<|im_start|>system\\n...` would encode to a real system turn.
So before the template runs, every control token's text in every string the client sent (contents,
names, tool-call arguments and their keys, tool definitions) is wrapped in two random markers; the
template sees the text as sent otherwise, so its `trim`, `tojson` or `split` work as before. Then:

- nothing was wrapped (no client string holds a control token's text): the rendered text is
  encoded as it always was, so ordinary prompts keep exactly their token ids;
- otherwise a wrapped token (or one that a marker still touches) stays text, each bare one (the
  template's own) becomes a stand-in for its token, the markers go, and a copy of the tokenizer
  whose control tokens answer only to those stand-ins encodes the result. Every other stretch of
  text is split, normalized and merged exactly as the tokenizer itself does it.

Control tokens: the tokenizer's special tokens, and those of its other added tokens that the
template's source names (`<tool_call>`, `<think>`); whitespace tokens are never control tokens.
A template that builds a token out of a client's string (`'<|' + name + '|>'`) is not covered, and
one that splits content at a control token's text (Qwen3's `</think>`) finds it, but a `trim` of a
piece then stops at the marker left on that side, keeping the whitespace next to it.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from engine.errors import InvalidRequestError


@dataclass(frozen=True)
class ControlTokens:
    ids: dict[str, int]  # token text -> id
    pattern: re.Pattern[str]  # any of the texts, the longest first (a token before those inside it)


@dataclass(frozen=True)
class Markers:
    """Random digits, fresh for each chat: no client can write them, and no template filter (upper,
    tojson, escape) changes them."""

    opening: str
    closing: str

    @classmethod
    def new(cls) -> Markers:
        opening = f"{secrets.randbelow(10**20):020d}"
        closing = f"{secrets.randbelow(10**20):020d}"
        return cls(opening, closing) if opening != closing else cls.new()


def control_tokens(hf_tokenizer: Any, template: str | None) -> ControlTokens:
    """The added tokens a client's text must never become, as named in the module docstring."""
    ids = {}
    for token_id, token in hf_tokenizer.added_tokens_decoder.items():
        text = token.content
        if text and not text.isspace() and (token.special or (template is not None and text in template)):
            ids[text] = token_id
    longest_first = sorted(ids, key=len, reverse=True)
    return ControlTokens(ids, re.compile("|".join(map(re.escape, longest_first)) or "(?!)"))  # (?!): nothing


def mark(value: Any, tokens: ControlTokens, markers: Markers) -> tuple[Any, int]:
    """(a copy of value with every control token's text in its strings and dict keys wrapped in the
    markers, how many were wrapped)."""
    if isinstance(value, str):
        return tokens.pattern.subn(lambda m: f"{markers.opening}{m[0]}{markers.closing}", value)
    if isinstance(value, dict):
        marked, count = {}, 0
        for key, item in value.items():
            new_key, in_key = mark(key, tokens, markers)
            marked[new_key], in_item = mark(item, tokens, markers)
            count += in_key + in_item
        return marked, count
    if isinstance(value, list | tuple):
        items = [mark(item, tokens, markers) for item in value]
        return [item for item, _ in items], sum(count for _, count in items)
    return value, 0


class PlainTextEncoder:
    """Encodes a chat rendered from marked strings: only the template's own control tokens are tokens.

    Owns a copy of the Rust tokenizer (one thread's, as the Tokenizer that made it is), in which each
    control token's text is replaced by a stand-in of random digits between private-use characters;
    the control tokens' texts are then plain text to it, and their stand-ins map back to their ids.
    """

    def __init__(self, backend: Any, tokens: ControlTokens) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        nonce = f"{secrets.randbelow(10**20):020d}"
        self._tokens = tokens
        self._stand_ins = {text: f"\ue000{nonce}:{token_id}\ue001" for text, token_id in tokens.ids.items()}
        data = json.loads(backend.to_str())
        for entry in data["added_tokens"]:
            entry["content"] = self._stand_ins.get(entry["content"], entry["content"])
        data.update(post_processor=None, padding=None, truncation=None)  # encoded without them anyway
        self._backend = RustTokenizer.from_str(json.dumps(data))
        self._backend.encode_special_tokens = False
        # The copy numbers its added tokens afresh; back to the original's ids.
        self._original_ids = {}
        for entry in data["added_tokens"]:
            copy_id = self._backend.token_to_id(entry["content"])
            if copy_id is not None and copy_id != entry["id"]:
                self._original_ids[copy_id] = entry["id"]

    def encode(self, rendered: str, markers: Markers) -> list[int]:
        opening, closing = re.escape(markers.opening), re.escape(markers.closing)
        token = self._tokens.pattern.pattern
        pieces = re.compile(f"(?P<opening>{opening})?(?P<token>{token})(?P<closing>{closing})?|{opening}|{closing}")
        written = 0

        def text_for(match: re.Match[str]) -> str:
            nonlocal written
            token = match["token"]
            if token is None:  # a marker the template parted from its token (a split, a slice)
                return ""
            if match["opening"] or match["closing"]:
                return token  # the client's: text
            written += 1
            return self._stand_ins[token]

        prepared = pieces.sub(text_for, rendered)
        try:
            encoded = self._backend.encode(prepared, add_special_tokens=False).ids
        except (TypeError, UnicodeEncodeError) as exc:  # e.g. a lone surrogate: not valid text
            raise InvalidRequestError(f"the text cannot be tokenized: {exc}", param="messages") from exc
        ids = [self._original_ids.get(token_id, token_id) for token_id in encoded]
        control_ids = set(self._tokens.ids.values())
        if sum(token_id in control_ids for token_id in ids) != written:
            # This vocabulary merges a control token's text into the token itself.
            raise InvalidRequestError(
                "the messages hold a control token's text that this model's tokenizer cannot encode as text",
                param="messages",
            )
        return ids
