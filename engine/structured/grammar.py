"""GrammarCompiler: StructuredOutput specs -> llguidance matchers over one tokenizer's token ids.

llguidance (the grammar engine vLLM and llama.cpp also use) compiles JSON schemas, regexes and
Lark or GBNF grammars into a token-level matcher: after each token it can say which tokens may
come next, as a bitmask over the vocabulary. It was chosen over xgrammar (its wheel pulls in
triton, ~1 GB) and outlines-core (slower per mask); its numpy helpers need no compiler.

Compiling validates the grammar against the tokenizer; a spec that does not compile is an
InvalidRequestError naming the request field. Compiled grammars are cached by spec (LRU), so
the server can compile a request's spec on its text worker, off the torch thread, and the
engine then only copies a ready matcher for each sequence. Thread-safe.
"""

from __future__ import annotations

import collections
import json
import re
import threading
import urllib.parse
from typing import Any

from engine.errors import InvalidRequestError
from engine.structured.spec import StructuredOutput

_CACHE_SIZE = 256
_COMPACT_JSON = {"whitespace_flexible": False}


class GrammarCompiler:
    """hf_tokenizer: the model's transformers fast tokenizer. vocab_size: the width of the model's logits.

    llguidance's view of the tokenizer is built on the first compile, not here: building it holds the GIL
    for a few hundred milliseconds (a 49k-token vocabulary: ~0.3 s), and a model loading on demand beside
    others that stream would stall their steps that long, where most models never see a structured request."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.vocab_size = vocab_size
        self._hf_tokenizer = hf_tokenizer
        self._eos_token_ids = eos_token_ids
        self._ll_tokenizer: Any = None
        self._tokenizer_lock = threading.Lock()
        self._lock = threading.Lock()
        self._compiled: collections.OrderedDict[StructuredOutput, Any] = collections.OrderedDict()

    def ll_tokenizer(self, param: str) -> Any:
        """llguidance's tokenizer, built on the first call; a tokenizer llguidance cannot read is a 400 naming
        `param`, the request field that asked for structured output."""
        with self._tokenizer_lock:
            if self._ll_tokenizer is None:
                import llguidance.hf

                try:
                    self._ll_tokenizer = llguidance.hf.from_tokenizer(
                        self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=list(self._eos_token_ids) or None
                    )
                except Exception as exc:  # noqa: BLE001 - llguidance raises plain exceptions for what it cannot read
                    raise InvalidRequestError(
                        f"{param}: structured output is not available for this model's tokenizer ({_reason(str(exc))})",
                        param,
                    ) from exc
            return self._ll_tokenizer

    def compile(self, spec: StructuredOutput) -> None:
        """Compile and cache `spec`; raises InvalidRequestError (naming `spec.param`) if it does not compile."""
        self._template(spec)

    def matcher(self, spec: StructuredOutput) -> Any:
        """A fresh llguidance matcher for `spec`, at the start of the output."""
        return self._template(spec).deep_copy()

    def _template(self, spec: StructuredOutput) -> Any:
        with self._lock:
            template = self._compiled.get(spec)
            if template is not None:
                self._compiled.move_to_end(spec)
                return template
        template = self._build(spec)
        with self._lock:
            self._compiled[spec] = template
            while len(self._compiled) > _CACHE_SIZE:
                self._compiled.popitem(last=False)
        return template

    def _build(self, spec: StructuredOutput) -> Any:
        import llguidance
        import llguidance.numpy

        if spec.json is not None:
            try:
                cycle = _ref_cycle(json.loads(spec.json))
            except RecursionError:  # nested deeper than this thread reads: llguidance says so below
                cycle = None
            if cycle is not None:
                chain = " -> ".join(cycle)
                message = f"{spec.param}: invalid {spec.kind}: $ref cycle {chain} (it never reaches a schema)"
                raise InvalidRequestError(message, spec.param)
        try:
            grammar = _grammar_text(spec)
        except Exception as exc:  # noqa: BLE001 - llguidance raises plain exceptions for bad input
            raise InvalidRequestError(f"{spec.param}: invalid {spec.kind}: {_reason(str(exc))}", spec.param) from exc
        ll_tokenizer = self.ll_tokenizer(spec.param)
        error = llguidance.LLMatcher.validate_grammar(grammar, ll_tokenizer)
        if error:
            raise InvalidRequestError(f"{spec.param}: invalid {spec.kind}: {_reason(error)}", spec.param)
        template = llguidance.LLMatcher(ll_tokenizer, grammar)
        # The first mask builds the lexer (the slow part for a large schema): here, not on the torch thread.
        llguidance.numpy.fill_next_token_bitmask(template, llguidance.numpy.allocate_token_bitmask(1, self.vocab_size))
        if template.is_error():
            raise InvalidRequestError(f"{spec.param}: invalid {spec.kind}: {_reason(template.get_error())}", spec.param)
        return template


# The longest reason a 400 quotes from llguidance; past its first line it appends its parser's state.
_MAX_REASON_CHARS = 200


def _reason(error: str) -> str:
    """llguidance's error as a short reason: its first line, at most _MAX_REASON_CHARS characters."""
    first = error.strip().split("\n", 1)[0].strip()
    if first.startswith("NoExtensionBias"):  # the matcher can emit nothing at all
        return "it matches no output at all (e.g. a $ref cycle, or a required property that recurses forever)"
    return first if len(first) <= _MAX_REASON_CHARS else f"{first[:_MAX_REASON_CHARS]}..."


def _ref_cycle(schema: Any) -> list[str] | None:
    """A chain of local `$ref`s that comes back to where it began, e.g. ["#/$defs/a", "#/$defs/b", "#/$defs/a"]:
    each schema in it is only a reference to the next, so it stands for no value. None when there is none."""
    nodes = [schema]
    ending: set[str] = set()  # refs whose chain is known to reach a schema
    while nodes:
        node = nodes.pop()
        if isinstance(node, list):
            nodes.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        nodes.extend(value for key, value in node.items() if key not in _LITERAL_KEYWORDS)
        chain: list[str] = []
        ref = node.get("$ref")
        while isinstance(ref, str) and ref.startswith("#") and ref not in ending:
            if ref in chain:
                return [*chain[chain.index(ref) :], ref]
            chain.append(ref)
            target = _resolve(schema, ref)
            ref = target.get("$ref") if isinstance(target, dict) else None
        ending.update(chain)
    return None


# Keywords whose values are JSON data, not schemas: a "$ref" inside them is a plain key.
_LITERAL_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


def _resolve(schema: Any, ref: str) -> Any:
    """The value a local `$ref` ("#", "#/$defs/a") points to in `schema`; None when it points nowhere."""
    node = schema
    for part in filter(None, urllib.parse.unquote(ref[1:]).split("/")):
        key = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            return None
    return node


def _grammar_text(spec: StructuredOutput) -> str:
    import llguidance
    from llguidance.gbnf_to_lark import gbnf_to_lark

    # JSON comes out in one line with fixed separators: with free whitespace, small models fill the
    # budget with blank lines and the output never closes.
    if spec.json is not None:
        return llguidance.LLMatcher.grammar_from_json_schema(spec.json, overrides=_COMPACT_JSON)
    if spec.json_object:
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps({"type": "object"}), overrides=_COMPACT_JSON)
    if spec.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        return llguidance.LLMatcher.grammar_from_regex("|".join(_regex_literal(c) for c in spec.choice))
    assert spec.grammar is not None
    lark = gbnf_to_lark(spec.grammar) if "::=" in spec.grammar else spec.grammar
    return llguidance.LLMatcher.grammar_from_lark(lark)


_REGEX_META = re.compile(r"([\\.+*?()|\[\]{}^$#&\-~])")  # what the grammar's (Rust) regex syntax escapes


def _regex_literal(text: str) -> str:
    """`text`, matched literally."""
    return _REGEX_META.sub(r"\\\1", text)
