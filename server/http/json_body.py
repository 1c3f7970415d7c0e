"""Request bodies parsed once, and strictly, as JSON: `StrictJSONRoute` is the route class of every
router whose routes take a JSON body (tests/server/test_strict_input.py checks each such route).

Python's json module takes more than a request should carry, and says little when it fails:

- a repeated key keeps its last value, so a proxy that checked the first is bypassed: a 400 naming it;
- nesting is bounded only by the recursion limit: more than MAX_JSON_DEPTH levels is a 400;
- an integer of more than `sys.get_int_max_str_digits()` digits raises a bare ValueError: a 400 saying so;
- a body that is not valid UTF-8 (or the UTF-16/32 its first bytes announce) is a 400 with the byte offset;
- an escaped lone surrogate ("\\ud800") becomes a str no tokenizer or encoder can take: a 400 naming the field.

FastAPI reads a JSON body with `await request.json()` and passes HTTP errors raised there through as
they are; `RequestBodyError` is one (server/errors.py answers it in the one error shape). The checks
cost a walk of the parsed body only when a cheap count on the raw bytes says one could fail.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response

from server.errors import RequestBodyError, clip

# Deepest nesting of arrays and objects a body may have (a JSON schema nests two levels per object).
MAX_JSON_DEPTH = 128
# What could make a lone surrogate: an escape of a code point in U+D800..U+DFFF (a pair is two of them).
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_SURROGATE = re.compile("[\ud800-\udfff]")
_CONTAINERS = (dict, list)


def parse_json_body(body: bytes) -> Any:
    """The JSON value of `body`; RequestBodyError (400) when it is not one a route should take."""
    text = _decode(body)
    try:
        value = json.loads(text, object_pairs_hook=_unique_keys)
    except RecursionError:
        raise RequestBodyError(_too_deep()) from None
    except json.JSONDecodeError as exc:
        message = f"request body is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})"
        raise RequestBodyError(message) from None
    except ValueError:  # the one other error json raises: an integer longer than the int conversion limit
        limit = sys.get_int_max_str_digits()
        raise RequestBodyError(f"a number in the JSON body is too long (more than {limit} digits)") from None
    if body.count(b"[") + body.count(b"{") > MAX_JSON_DEPTH:
        _check_depth(value)
    if _SURROGATE_ESCAPE.search(text):
        _check_text(value)
    return value


class StrictJSONRequest(Request):
    """A Request whose json() is `parse_json_body` (parsed once, then kept)."""

    async def json(self) -> Any:
        if not hasattr(self, "_strict_json"):
            self._strict_json = parse_json_body(await self.body())
        return self._strict_json


class StrictJSONRoute(APIRoute):
    """An APIRoute whose handler reads its JSON body with `parse_json_body`."""

    any_content_type = False  # True: the body is JSON whatever Content-Type says

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        any_content_type = self.any_content_type

        async def strict_json_handler(request: Request) -> Response:
            scope = request.scope
            if any_content_type:
                headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
                scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
            return await handler(StrictJSONRequest(scope, request.receive))

        return strict_json_handler


class AnyContentTypeJSONRoute(StrictJSONRoute):
    """Ollama's routes: its clients and its documented `curl -d` send JSON with any Content-Type, or none."""

    any_content_type = True


def _decode(body: bytes) -> str:
    encoding = json.detect_encoding(body)  # UTF-8 (with or without a BOM) unless the first bytes say UTF-16/32
    try:
        return body.decode(encoding)
    except UnicodeDecodeError as exc:
        name = "UTF-8" if encoding.startswith("utf-8") else encoding.upper()
        raise RequestBodyError(f"request body is not valid {name} at byte {exc.start}") from None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    value = dict(pairs)
    if len(value) < len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                shown = _shown(key)
                raise RequestBodyError(f'duplicate key "{shown}" in the JSON body', param=shown)
            seen.add(key)
    return value


def _too_deep() -> str:
    return f"the JSON body nests arrays and objects more than {MAX_JSON_DEPTH} levels deep"


def _check_depth(value: Any) -> None:
    """RequestBodyError if `value` nests more than MAX_JSON_DEPTH containers: one level at a time (no
    recursion), about as fast per container as json.loads made it."""
    level = [value]
    for _ in range(MAX_JSON_DEPTH):
        below: list[Any] = []
        for node in level:
            below += [child for child in (node.values() if type(node) is dict else node) if type(child) in _CONTAINERS]
        if not below:
            return
        level = below
    raise RequestBodyError(_too_deep())


def _check_text(value: Any) -> None:
    """RequestBodyError naming the first string (or key) holding a lone surrogate, by its path."""
    stack: list[tuple[Any, tuple[str, ...]]] = [(value, ())]
    while stack:
        node, path = stack.pop()
        if isinstance(node, str):
            if _SURROGATE.search(node):
                raise _lone_surrogate(path)
        elif isinstance(node, dict):
            for key, child in node.items():
                if _SURROGATE.search(key):
                    raise _lone_surrogate(path, key=True)
                stack.append((child, (*path, clip(key))))
        elif isinstance(node, list):
            stack.extend((child, (*path, str(index))) for index, child in enumerate(node))


def _lone_surrogate(path: tuple[str, ...], key: bool = False) -> RequestBodyError:
    param = ".".join(path) or None
    if key:
        where = f"a key in {param}" if param else "a key of the JSON body"
    else:
        where = param or "the JSON body"
    return RequestBodyError(f"{where}: the text is not valid Unicode (a lone surrogate)", param=param)


def _shown(key: str) -> str:
    """A key as an error message may echo it: clipped, a lone surrogate written as its escape."""
    return clip(key).encode("utf-8", "backslashreplace").decode("utf-8")
