"""Tokenizer and chat template, from the model's own files.

A thin layer over transformers' fast tokenizers: a Hugging Face directory
(tokenizer.json / tokenizer_config.json) or a GGUF file (its vocabulary,
merges and `tokenizer.chat_template`). Chat messages are encoded as text: only the template's own
markers become control tokens (engine/text/chat_text.py).
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

from engine.errors import InvalidRequestError, ModelLoadError
from engine.structured.grammar import GrammarCompiler
from engine.text.chat_text import ControlTokens, Markers, PlainTextEncoder, control_tokens, mark

logger = logging.getLogger(__name__)


class Tokenizer:
    def __init__(self, hf_tokenizer, extra_eos_token_ids: tuple[int, ...] = ()) -> None:
        self._tok = hf_tokenizer
        eos_ids = {i for i in extra_eos_token_ids if i is not None}
        if hf_tokenizer.eos_token_id is not None:
            eos_ids.add(hf_tokenizer.eos_token_id)
        self.eos_token_ids: tuple[int, ...] = tuple(sorted(eos_ids))
        self.bos_token_id: int | None = hf_tokenizer.bos_token_id
        self.all_special_ids: frozenset[int] = frozenset(hf_tokenizer.all_special_ids)
        # A tokenizer.json may switch padding/truncation on; transformers would then switch it off on
        # the first encode, mutating the Rust tokenizer while another thread decodes ("Already borrowed").
        backend = getattr(hf_tokenizer, "_tokenizer", None)
        if backend is not None:
            backend.no_padding()
            backend.no_truncation()
        self._control_tokens: tuple[str | None, ControlTokens] | None = None  # (for the template, its tokens)
        self._plain_text: PlainTextEncoder | None = None  # made for the first chat that needs it

    @classmethod
    def from_path(cls, path: str | Path, extra_eos_token_ids: tuple[int, ...] = ()) -> Tokenizer:
        from transformers import AutoTokenizer

        path = Path(path)
        try:
            if path.suffix == ".gguf":
                hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            else:
                hf = AutoTokenizer.from_pretrained(str(path))
        except Exception as exc:  # transformers raises many types; one clear message
            raise ModelLoadError(f"cannot load the tokenizer from {path}: {exc}") from exc
        return cls(hf, extra_eos_token_ids)

    def copy(self) -> Tokenizer:
        """An independent tokenizer (its own Rust backend and state) for another thread to own."""
        return Tokenizer(copy.deepcopy(self._tok), self.eos_token_ids)

    def vocabulary(self) -> dict[str, int]:
        """Every token's text and id, added tokens included."""
        return dict(self._tok.get_vocab())

    def grammar_compiler(self, vocab_size: int) -> GrammarCompiler:
        """Compiles structured-output grammars over this tokenizer's tokens, for logits `vocab_size` wide."""
        return GrammarCompiler(self._tok, vocab_size, self.eos_token_ids)

    def special_tokens(self) -> dict[str, str | None]:
        """The tokenizer's bos/eos/pad/unk token texts (None where it has none)."""
        return {name: getattr(self._tok, name, None) for name in ("bos_token", "eos_token", "pad_token", "unk_token")}

    @property
    def chat_template(self) -> str | None:
        template = getattr(self._tok, "chat_template", None)
        return template if isinstance(template, str) else None

    @property
    def class_name(self) -> str:
        return type(self._tok).__name__

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            return list(self._tok.encode(text, add_special_tokens=add_special_tokens))
        except (TypeError, UnicodeEncodeError) as exc:  # e.g. a lone surrogate: not valid text
            raise InvalidRequestError(f"the text cannot be tokenized: {exc}", param="prompt") from exc

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str:
        """The token's own text (decoded bytes), as OpenAI's logprobs show it."""
        return self._tok.decode([token_id], skip_special_tokens=False)

    @property
    def tool_call_format(self) -> str | None:
        """ "hermes" when the chat template renders tool definitions and writes calls as `<tool_call>`
        blocks (Qwen2.5, Hermes and their kin); None when it has no tool support of its own."""
        template = getattr(self._tok, "chat_template", None)
        if isinstance(template, str) and "tools" in template and "<tool_call>" in template:
            return "hermes"
        return None

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None) -> str:
        """tools: OpenAI tool definitions, for a template that renders them itself."""
        if not self.has_chat_template:
            raise InvalidRequestError("this model has no chat template; use /v1/completions", param="messages")
        try:
            return self._tok.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False, tools=tools
            )
        except Exception as exc:  # a template error is the caller's input (roles, order)
            raise InvalidRequestError(f"the chat template rejected the messages: {exc}", param="messages") from exc

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list | None = None,
        allow_special_tokens_in_content: bool = False,
    ) -> list[int]:
        """The messages through the template, every string in messages and tools encoded as text: a
        control token's text there stays text, so a message cannot forge a turn (engine/text/chat_text.py).

        allow_special_tokens_in_content: encode the rendered text as a whole instead, so a control
        token's text anywhere in it is that token.
        """
        # The template already writes any BOS it wants; none is added.
        if allow_special_tokens_in_content:
            return self.encode(self.render_chat(messages, add_generation_prompt, tools), add_special_tokens=False)
        tokens = self._chat_control_tokens()
        markers = Markers.new()
        marked_messages, in_messages = mark(messages, tokens, markers)
        marked_tools, in_tools = mark(tools, tokens, markers)
        text = self.render_chat(marked_messages, add_generation_prompt, marked_tools)
        if not in_messages + in_tools:
            return self.encode(text, add_special_tokens=False)  # nothing to keep apart: as encoded always
        if self._plain_text is None:
            backend = getattr(self._tok, "_tokenizer", None)
            if backend is None:
                raise InvalidRequestError(
                    "the messages hold a control token's text, which this model's tokenizer cannot encode as text",
                    param="messages",
                )
            self._plain_text = PlainTextEncoder(backend, tokens)
        return self._plain_text.encode(text, markers)

    def _chat_control_tokens(self) -> ControlTokens:
        template = self.chat_template
        if self._control_tokens is None or self._control_tokens[0] != template:
            self._control_tokens = (template, control_tokens(self._tok, template))
            self._plain_text = None  # made for the old template's tokens
        return self._control_tokens[1]
