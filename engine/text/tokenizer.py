"""Tokenizer and chat template, from the model's own files.

A thin layer over transformers' fast tokenizers: a Hugging Face directory
(tokenizer.json / tokenizer_config.json) or a GGUF file (its vocabulary,
merges and `tokenizer.chat_template`). Chat messages are encoded as text: only the template's own
markers become control tokens (engine/text/chat_text.py).

`kvserve serve --tokenizer DIR` loads another Hugging Face directory's tokenizer in place of the model's
(`Tokenizer.from_directory`), and `--chat-template FILE` replaces the chat template
(`read_chat_template`, then `Tokenizer.set_chat_template`): for a GGUF file that carries no tokenizer,
no template or a wrong one. Everything derived from the template (tool_call_format, the control tokens)
follows the replacement.
"""

from __future__ import annotations

import copy
import inspect
import logging
from pathlib import Path

from engine.errors import InvalidRequestError, ModelLoadError
from engine.hub import gguf_cache
from engine.structured.grammar import GrammarCompiler
from engine.text.chat_text import ControlTokens, Markers, PlainTextEncoder, control_tokens, mark

logger = logging.getLogger(__name__)

# The files that make a directory a Hugging Face tokenizer (any one of them may be enough).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# Tokenizer.chat_template_source of a tokenizer whose files hold no chat template.
NO_TEMPLATE = "none"


def _one_line(exc: BaseException) -> str:
    """An exception's message on one line (transformers' and jinja's span several)."""
    return " ".join(str(exc).split())


def read_chat_template(file: str | Path) -> str:
    """The text of the chat template `file`, compiled first by the jinja environment transformers renders
    templates with (so a template accepted here renders there). ModelLoadError, on one line, when the file
    cannot be read or is not a template jinja parses."""
    import jinja2
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        text = Path(file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"--chat-template {file}: cannot read it: {_one_line(exc)}") from exc
    if not text.strip():
        raise ModelLoadError(f"--chat-template {file}: the file is empty")
    try:
        _compile_jinja_template(text)
    except jinja2.TemplateError as exc:
        line = getattr(exc, "lineno", None)
        where = f" (line {line})" if line else ""
        raise ModelLoadError(f"--chat-template {file}: not a jinja template{where}: {_one_line(exc)}") from exc
    return text


def check_tokenizer_directory(directory: str | Path) -> Path:
    """`directory` if it holds a Hugging Face tokenizer's files; ModelLoadError, on one line, if not."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ModelLoadError(f"--tokenizer {directory}: not a directory")
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise ModelLoadError(f"--tokenizer {directory}: no tokenizer there (neither {' nor '.join(TOKENIZER_FILES)})")
    return directory


def _prefix_every_text_as_sentencepiece(hf_tokenizer) -> None:
    """A SentencePiece GGUF (Llama 2, Mistral and their kin) rebuilt by transformers adds its "▁" prefix with a
    Metaspace that skips a text already starting with a space: " Hello" becomes "▁Hello", where SentencePiece, the
    models' own tokenizers and llama.cpp give "▁▁Hello" (one token more). A normalizer that always prepends the
    prefix, then spells spaces as "▁", encodes as they do (transformers builds Phi-3 files so already). Files
    whose metadata turns the prefix off (Gemma's) have no such Metaspace and are left as they are."""
    from tokenizers import normalizers, pre_tokenizers

    backend = getattr(hf_tokenizer, "_tokenizer", None)
    pre = getattr(backend, "pre_tokenizer", None)
    if backend is None or backend.normalizer is not None or not isinstance(pre, pre_tokenizers.Metaspace):
        return
    if pre.prepend_scheme != "first" or pre.replacement != "\u2581":
        return
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend(prepend="\u2581"), normalizers.Replace(pattern=" ", content="\u2581")]
    )
    backend.pre_tokenizer = None


# The GGUF pre-tokenizer names (`tokenizer.ggml.pre`) whose BPE takes a word the vocabulary holds whole, whatever
# its merges would build (Hugging Face's `ignore_merges`, as the models' own tokenizer.json files set it; llama.cpp
# reads these names so): Llama 3 and the tokenizers made like it.
_WHOLE_WORD_PRE_TOKENIZERS = frozenset(
    {
        "llama3",
        "llama-v3",
        "llama-bpe",
        "falcon3",
        "falcon-h1",
        "pixtral",
        "midm-2.0",
        "lfm2",
        "jina-v5-nano",
        "minicpm5",
        "youtu",
        "glm4",
        "glm5",
        "tekken",
        "granite-embed-multi-97m",
    }
)


def _take_whole_words(hf_tokenizer, path: Path) -> None:
    """transformers rebuilds a GGUF's BPE without `ignore_merges`, so a Llama 3 file split " Việt" (one token of
    its vocabulary, which its merges do not build) into three tokens. Set it where the file's pre-tokenizer says."""
    from engine.hub.gguf_file import GgufFile  # numpy: only where a GGUF is read

    field = GgufFile(path).get_field("tokenizer.ggml.pre")
    if field is None or field.contents() not in _WHOLE_WORD_PRE_TOKENIZERS:
        return
    model = getattr(getattr(hf_tokenizer, "_tokenizer", None), "model", None)
    if model is not None and hasattr(model, "ignore_merges"):
        model.ignore_merges = True


class Tokenizer:
    """chat_template_source: where the chat template came from, in words for the log ("the model",
    "the tokenizer in DIR", "the file FILE"; NO_TEMPLATE when there is none)."""

    def __init__(
        self, hf_tokenizer, extra_eos_token_ids: tuple[int, ...] = (), chat_template_source: str = "the model"
    ) -> None:
        self._tok = hf_tokenizer
        has_template = bool(getattr(hf_tokenizer, "chat_template", None))
        self.chat_template_source = chat_template_source if has_template else NO_TEMPLATE
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
                hf = gguf_cache.load_tokenizer(path)
                _prefix_every_text_as_sentencepiece(hf)
                _take_whole_words(hf, path)
            else:
                hf = AutoTokenizer.from_pretrained(str(path))
        except Exception as exc:  # transformers raises many types; one clear message
            raise ModelLoadError(f"cannot load the tokenizer from {path}: {_one_line(exc)}") from exc
        return cls(hf, extra_eos_token_ids)

    @classmethod
    def from_directory(cls, directory: str | Path, extra_eos_token_ids: tuple[int, ...] = ()) -> Tokenizer:
        """The tokenizer of a Hugging Face directory given in place of the model's own (--tokenizer DIR).
        ModelLoadError, on one line, when there is none or transformers cannot load it."""
        from transformers import AutoTokenizer

        directory = check_tokenizer_directory(directory)
        try:
            hf = AutoTokenizer.from_pretrained(str(directory))
        except Exception as exc:  # transformers raises many types, over several lines
            raise ModelLoadError(f"--tokenizer {directory}: cannot load the tokenizer: {_one_line(exc)}") from exc
        return cls(hf, extra_eos_token_ids, chat_template_source=f"the tokenizer in {directory}")

    def set_chat_template(self, template: str, source: str) -> None:
        """Replace the chat template (its text, as read_chat_template returns it); `source` says where it
        came from. What is derived from the template follows: tool_call_format, the control tokens."""
        self._tok.chat_template = template
        self.chat_template_source = source

    def copy(self) -> Tokenizer:
        """An independent tokenizer (its own Rust backend and state) for another thread to own."""
        return Tokenizer(copy.deepcopy(self._tok), self.eos_token_ids, self.chat_template_source)

    @property
    def id_limit(self) -> int:
        """Every id this tokenizer can produce is in [0, id_limit): its largest id, added tokens included, plus one."""
        return max(self._tok.get_vocab().values(), default=-1) + 1

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

    def render_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list | None = None,
        *,
        template_kwargs: dict | None = None,
    ) -> str:
        """tools: OpenAI tool definitions, for a template that renders them itself. template_kwargs: more
        variables the template reads (Qwen3's enable_thinking)."""
        if not self.has_chat_template:
            raise InvalidRequestError("this model has no chat template; use /v1/completions", param="messages")
        extra = dict(template_kwargs or {})
        if extra:
            # apply_chat_template's own parameters (tokenize, padding, tools, ...) are not template variables.
            reserved = set(inspect.signature(self._tok.apply_chat_template).parameters) | {"messages"}
            taken = sorted(set(extra) & reserved)
            if taken:
                raise InvalidRequestError(
                    f"chat template variables set by the server itself: {', '.join(taken)}",
                    param="chat_template_kwargs",
                )
        try:
            return self._tok.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False, tools=tools, **extra
            )
        except Exception as exc:  # a template error is the caller's input (roles, order)
            raise InvalidRequestError(f"the chat template rejected the messages: {exc}", param="messages") from exc

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list | None = None,
        allow_special_tokens_in_content: bool = False,
        *,
        template_kwargs: dict | None = None,
    ) -> list[int]:
        """The messages through the template, every string in messages, tools and template_kwargs encoded
        as text: a control token's text there stays text, so a message cannot forge a turn
        (engine/text/chat_text.py).

        allow_special_tokens_in_content: encode the rendered text as a whole instead, so a control
        token's text anywhere in it is that token.
        """
        # The template already writes any BOS it wants; none is added.
        if allow_special_tokens_in_content:
            text = self.render_chat(messages, add_generation_prompt, tools, template_kwargs=template_kwargs)
            return self.encode(text, add_special_tokens=False)
        tokens = self._chat_control_tokens()
        markers = Markers.new()
        marked_messages, in_messages = mark(messages, tokens, markers)
        marked_tools, in_tools = mark(tools, tokens, markers)
        marked_kwargs, in_kwargs = mark(template_kwargs, tokens, markers)
        text = self.render_chat(marked_messages, add_generation_prompt, marked_tools, template_kwargs=marked_kwargs)
        if not in_messages + in_tools + in_kwargs:
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
