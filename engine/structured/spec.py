"""StructuredOutput: what a request's output must match, as plain data (the engine core's side of it).

Exactly one of the fields is set. It rides in `SamplingParams.structured`; the grammar compiler
(engine/structured/grammar.py) turns it into a token-level matcher for each sequence.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from engine.errors import InvalidRequestError


@dataclass(frozen=True)
class StructuredOutput:
    """json: a JSON schema as JSON text. regex: the whole output matches it. choice: the output is one
    of these strings. grammar: a Lark grammar (llguidance's dialect) or a GBNF one (with `::=`).
    json_object: any JSON object. param: the request field it came from, named in errors."""

    json: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    param: str = "structured_outputs"

    def __post_init__(self) -> None:
        num_set = sum(x is not None for x in (self.json, self.regex, self.choice, self.grammar)) + self.json_object
        if num_set != 1:
            raise InvalidRequestError(
                f"{self.param}: give exactly one of json, regex, choice, grammar or json_object", self.param
            )
        if self.choice is not None and (not self.choice or any(not c for c in self.choice)):
            raise InvalidRequestError(f"{self.param}: choice must be a non-empty list of non-empty strings", self.param)
        if self.json is not None:
            try:
                json.loads(self.json)
            except ValueError as exc:
                message = f"{self.param}: the JSON schema is not valid JSON: {exc}"
                raise InvalidRequestError(message, self.param) from exc
            except RecursionError:
                message = f"{self.param}: the JSON schema nests arrays and objects too deeply to read"
                raise InvalidRequestError(message, self.param) from None

    @property
    def kind(self) -> str:
        if self.json is not None:
            return "json"
        if self.regex is not None:
            return "regex"
        if self.choice is not None:
            return "choice"
        if self.grammar is not None:
            return "grammar"
        return "json_object"
