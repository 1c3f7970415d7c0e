"""A request's structured-output fields -> the engine's StructuredOutput (or None), validated at the edge.

One request may use one spelling: `response_format` (chat), `structured_outputs` or one `guided_*`
field; two are a 400 naming both. The spec keeps the field's name, so an error found when it is
compiled (server/routes, on the text worker) names the field the client sent.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from engine import StructuredOutput, wait_until
from engine.errors import InvalidRequestError
from server.protocol.structured import GuidedFields, ResponseFormat

COMPILE_TIMEOUT_S = 10.0  # the compile goes on in the text worker; the request gets its 400 now

if TYPE_CHECKING:
    from engine import AsyncEngine
    from server.openai.text import RequestText


def structured_output(body: GuidedFields, response_format: ResponseFormat | None = None) -> StructuredOutput | None:
    specs: list[StructuredOutput] = []
    if response_format is not None and response_format.type != "text":
        specs.append(_from_response_format(response_format))
    if body.structured_outputs is not None:
        given = body.structured_outputs
        specs.append(
            StructuredOutput(
                json=_schema_text(given.json_schema, "structured_outputs.json"),
                regex=given.regex,
                choice=tuple(given.choice) if given.choice is not None else None,
                grammar=given.grammar,
                json_object=bool(given.json_object),
                param="structured_outputs",
            )
        )
    if body.guided_json is not None:
        specs.append(StructuredOutput(json=_schema_text(body.guided_json, "guided_json"), param="guided_json"))
    if body.guided_regex is not None:
        specs.append(StructuredOutput(regex=body.guided_regex, param="guided_regex"))
    if body.guided_choice is not None:
        specs.append(StructuredOutput(choice=tuple(body.guided_choice), param="guided_choice"))
    if body.guided_grammar is not None:
        specs.append(StructuredOutput(grammar=body.guided_grammar, param="guided_grammar"))
    if len(specs) > 1:
        names = ", ".join(spec.param for spec in specs)
        raise InvalidRequestError(f"set only one structured-output field, not {names}", specs[1].param)
    return specs[0] if specs else None


async def compile_structured(text: RequestText, engine: AsyncEngine, spec: StructuredOutput | None) -> None:
    """Compile `spec` on the text worker, off the event loop and the torch thread (a large schema can
    take a while); the engine then finds it in the compiler's cache. 400 naming the field if it fails."""
    if spec is None:
        return
    grammar = engine.grammar
    if grammar is None:
        raise InvalidRequestError("this model cannot enforce structured output (no tokenizer)", spec.param)
    size = len(spec.json or spec.regex or spec.grammar or "") + sum(len(c) for c in spec.choice or ())
    try:
        await wait_until(text.worker.run(size, grammar.compile, spec), time.monotonic() + COMPILE_TIMEOUT_S)
    except TimeoutError:
        message = f"{spec.param}: compiling this {spec.kind} took over {COMPILE_TIMEOUT_S:.0f} s; simplify it"
        raise InvalidRequestError(message, spec.param) from None


def _from_response_format(response_format: ResponseFormat) -> StructuredOutput:
    if response_format.type == "json_object":
        return StructuredOutput(json_object=True, param="response_format")
    given = response_format.json_schema
    if given is None or given.schema_ is None:
        raise InvalidRequestError(
            "response_format: type json_schema needs json_schema.schema", "response_format.json_schema"
        )
    return StructuredOutput(json=json.dumps(given.schema_), param="response_format")


def _schema_text(schema: dict[str, Any] | str | None, param: str) -> str | None:
    if schema is None or isinstance(schema, str):
        return schema
    return json.dumps(schema)
