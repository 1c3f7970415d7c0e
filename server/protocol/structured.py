"""Structured-output request fields: vLLM's `structured_outputs` and `guided_*`, OpenAI's `response_format`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field

from server.protocol.common import StrictRequest, StrictSwitch

JsonSchema = dict[str, Any] | str  # an object, or its JSON text (vLLM accepts both)


class StructuredOutputs(StrictRequest):
    """vLLM's `structured_outputs`: exactly one of json, regex, choice, grammar, json_object."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_schema: JsonSchema | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: StrictSwitch | None = None


class JsonSchemaFormat(StrictRequest):
    """OpenAI's `response_format.json_schema`."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictSwitch | None = None


class ResponseFormat(StrictRequest):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class GuidedFields(StrictRequest):
    """Completions and chat: vLLM's structured-output fields, new spelling and old."""

    structured_outputs: StructuredOutputs | None = None
    guided_json: JsonSchema | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
