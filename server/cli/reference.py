"""The generated reference pages. The configuration page's flag table comes from the flags themselves: each
flag's name and environment variable from FLAGS, its default from the configs (as `kvserve serve` takes it), its
meaning from FLAG_DOCS. The endpoint page's tables come from the app's own OpenAPI document (what
`GET /openapi.json` serves): every route with its request body, answers and statuses, and every request
body's fields with their types, bounds and defaults.

    python -m server.cli.reference --write   # put each table between the markers of its page
    python -m server.cli.reference           # print them

A test fails when a committed page differs from the rendering, so the pages cannot drift from the code.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from server.cli.args import flag_defaults
from server.cli.flag_docs import FLAG_DOCS
from server.cli.flags import FLAGS, Flag, env_name
from server.cli.kinds import byte_size

DOCS = Path(__file__).resolve().parents[2] / "docs"
CONFIGURATION_PAGE = DOCS / "serving" / "configuration.md"
ENDPOINTS_PAGE = DOCS / "api" / "reference.md"
BEGIN_MARKER = "<!-- BEGIN FLAGS: generated from server/cli/flags.py by `make reference`; do not edit by hand -->"
END_MARKER = "<!-- END FLAGS -->"
BEGIN_ENDPOINTS = "<!-- BEGIN ENDPOINTS: generated from the app's OpenAPI document by `make reference`; do not edit -->"
END_ENDPOINTS = "<!-- END ENDPOINTS -->"

_BINARY_UNITS = (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


def _unset(value: Any) -> bool:
    return value is None or value == "" or value == ()


def value_text(flag: Flag, value: Any) -> str:
    """A set default as a user would type it: `true`, `600`, `512MiB`, `a,b`."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, tuple):
        return ",".join(str(item) for item in value)
    if flag.kind is byte_size and isinstance(value, int):
        for unit, size in _BINARY_UNITS:
            if value >= size and value % size == 0:
                return f"{value // size}{unit}"
    return str(value)


def default_cell(flag: Flag, value: Any) -> str:
    note = FLAG_DOCS[flag.name].default_note
    if _unset(value):
        return note or "none"
    text = f"`{value_text(flag, value)}`"
    return f"{text} ({note})" if note else text


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_flag_table() -> str:
    """The Markdown table of every serve flag (and `--no-playground`, the one shorthand), in FLAGS' order."""
    defaults = flag_defaults()
    lines = ["| flag | environment | default | meaning |", "| --- | --- | --- | --- |"]
    for flag in FLAGS:
        option = "--" + flag.name.replace("_", "-")
        cells = (f"`{option}`", f"`{env_name(flag.name)}`", default_cell(flag, defaults[flag.name]))
        lines.append("| " + " | ".join((*cells, _cell(FLAG_DOCS[flag.name].meaning))) + " |")
        if flag.name == "playground":
            lines.append("| `--no-playground` | | | the same as `--playground false` |")
    return "\n".join(lines) + "\n"


def openapi_document() -> dict[str, Any]:
    """The OpenAPI document of an app with every route (the playground's included); no model is loaded."""
    from server.app import create_app
    from server.config import ServerConfig

    return create_app(ServerConfig(playground=True)).openapi()


def _schema_name(schema: dict[str, Any]) -> str:
    return schema.get("$ref", "").rsplit("/", 1)[-1]


def _type_text(schema: dict[str, Any]) -> str:
    """A field's JSON type in a few words: `integer 1..128`, `string or array of string`, `StreamOptions`."""
    if "$ref" in schema:
        name = _schema_name(schema)
        return f"[{name}](#{name.lower()})"  # its own table, further down the page
    for union in ("anyOf", "oneOf"):
        if union in schema:
            options = [_type_text(option) for option in schema[union] if option.get("type") != "null"]
            return " or ".join(dict.fromkeys(options)) or "null"
    if "enum" in schema:
        return " / ".join(f"`{value}`" for value in schema["enum"])
    if "const" in schema:
        return f"`{schema['const']}`"
    kind = schema.get("type", "any")
    if kind == "array":
        return f"array of {_type_text(schema.get('items', {}))}"
    low = schema.get("minimum", schema.get("exclusiveMinimum"))
    high = schema.get("maximum", schema.get("exclusiveMaximum"))
    if low is not None or high is not None:
        bounds = "..".join(_number_text(bound) for bound in (low, high))
        return f"{kind} {bounds}"
    return kind


def _number_text(bound: float | None) -> str:
    if bound is None:
        return ""
    return str(int(bound)) if float(bound).is_integer() else f"{bound:g}"


def _referenced(schema: Any) -> set[str]:
    """The names of the schemas `schema` refers to, anywhere inside it."""
    if isinstance(schema, dict):
        found = {_schema_name(schema)} if "$ref" in schema else set()
        return found.union(*(_referenced(value) for value in schema.values()))
    if isinstance(schema, list):
        return set().union(*(_referenced(value) for value in schema))
    return set()


def _default_text(schema: dict[str, Any], required: bool) -> str:
    if required:
        return "required"
    if "default" not in schema or schema["default"] is None:
        return ""
    return f"`{json.dumps(schema['default'])}`"


def render_endpoint_tables(document: dict[str, Any] | None = None) -> str:
    """Every route (method, path, request body, answers, statuses), then each request body's fields."""
    document = document or openapi_document()
    lines = [
        "## Routes",
        "",
        "| method | path | request body | answers | statuses |",
        "| --- | --- | --- | --- | --- |",
    ]
    schemas = document["components"]["schemas"]
    bodies: dict[str, dict[str, Any]] = {}
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            body = operation.get("requestBody", {}).get("content", {}).get("application/json", {})
            body_name = _schema_name(body.get("schema", {}))
            if body_name:
                bodies[body_name] = schemas[body_name]
            answers = ", ".join(f"`{kind}`" for kind in operation["responses"].get("200", {}).get("content", {}))
            statuses = ", ".join(sorted(operation["responses"]))
            body_cell = f"[{body_name}](#{body_name.lower()})" if body_name else ""
            cells = (method.upper(), f"`{path}`", body_cell, answers, statuses)
            lines.append("| " + " | ".join(cells) + " |")
    pending = list(bodies)
    while pending:  # the bodies' own parts (messages, tools, stream options...), each once
        for name in _referenced(schemas[pending.pop()]) - set(bodies):
            bodies[name] = schemas[name]
            pending.append(name)
    lines += ["", "## Request bodies"]
    for name in sorted(bodies):
        schema = bodies[name]
        if "properties" not in schema:  # an enum or a union: its type says it all
            lines += ["", f"### {name}", "", _cell(_type_text(schema))]
            continue
        required = set(schema.get("required", ()))
        lines += ["", f"### {name}", "", "| field | type | default |", "| --- | --- | --- |"]
        for field, field_schema in schema["properties"].items():
            cells = (f"`{field}`", _cell(_type_text(field_schema)), _default_text(field_schema, field in required))
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _replace_between(page_text: str, begin: str, end: str, body: str) -> str:
    head, found, rest = page_text.partition(begin)
    _, found_end, tail = rest.partition(end)
    if not found or not found_end:
        raise ValueError(f"the page lacks the markers {begin!r} ... {end!r}")
    return f"{head}{begin}\n{body}{end}{tail}"


def render_page(page_text: str) -> str:
    """The configuration page's text with the region between its markers replaced by the flag table."""
    return _replace_between(page_text, BEGIN_MARKER, END_MARKER, render_flag_table())


def render_endpoints_page(page_text: str, document: dict[str, Any] | None = None) -> str:
    """The endpoint page's text with the region between its markers replaced by the endpoint tables."""
    return _replace_between(page_text, BEGIN_ENDPOINTS, END_ENDPOINTS, render_endpoint_tables(document))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="update the pages in place")
    args = parser.parse_args(argv)
    if not args.write:
        sys.stdout.write(render_flag_table() + "\n" + render_endpoint_tables())
        return 0
    CONFIGURATION_PAGE.write_text(render_page(CONFIGURATION_PAGE.read_text()))
    ENDPOINTS_PAGE.write_text(render_endpoints_page(ENDPOINTS_PAGE.read_text()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
