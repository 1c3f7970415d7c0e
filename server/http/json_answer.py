"""JSON answer bodies encoded in pieces, so a large one does not hold the event loop.

`json.dumps` of a body with a few hundred thousand logprob entries runs in C for a second or more
without giving the loop a turn: every other request, `/health` included, waits for it. Here a
value that is small (a bounded count of nested items) is encoded in one call, and a larger one is
split at its dicts and lists into pieces, with the loop given a turn every PIECES_PER_TURN pieces.
The bytes are those of Starlette's JSONResponse (compact separators, non-ASCII kept, NaN refused).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

from fastapi.responses import Response

SMALL_ITEMS = 256  # nested items below which a value is encoded in one call
PIECES_PER_TURN = 64
_encode = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode


def _is_small(value: Any, budget: int = SMALL_ITEMS) -> bool:
    """Whether value holds at most `budget` nested items (walks no further than that)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            budget -= len(item)
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            budget -= len(item)
            stack.extend(item)
        if budget < 0:
            return False
    return True


def iter_json(value: Any) -> Iterator[str]:
    """value's JSON text, in pieces that each encode at most about SMALL_ITEMS items."""
    if _is_small(value):
        yield _encode(value)
    elif isinstance(value, dict):
        yield "{"
        for i, (key, item) in enumerate(value.items()):
            yield ("," if i else "") + _encode(str(key)) + ":"
            yield from iter_json(item)
        yield "}"
    else:
        yield "["
        for i, item in enumerate(value):
            if i:
                yield ","
            yield from iter_json(item)
        yield "]"


async def encode_json(value: Any) -> bytes:
    """value as JSON bytes, the event loop given a turn between pieces of a large one (a small one is
    one piece)."""
    parts: list[str] = []
    for count, piece in enumerate(iter_json(value), 1):
        parts.append(piece)
        if count % PIECES_PER_TURN == 0:
            await asyncio.sleep(0)
    return "".join(parts).encode()


async def json_response(value: Any, status_code: int = 200) -> Response:
    return Response(await encode_json(value), status_code=status_code, media_type="application/json")
