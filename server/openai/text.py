"""RequestText: the server's tokenizer work on request text, on the text worker, with its own tokenizer.

Routes hand it whole jobs (encode the prompts, render the chat, decode the echo) with the
job's size in characters or tokens, which orders it among the waiting jobs. The event loop
never runs one: `/health` and every stream keep their pace while a 2 MB prompt is encoded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from engine import TextWorker, Tokenizer
from server.protocol.chat import ChatMessage

T = TypeVar("T")


@dataclass(frozen=True)
class RequestText:
    worker: TextWorker
    tokenizer: Tokenizer  # the generation tokenizer's own copy: only the worker's thread uses it

    async def run(self, size: int, fn: Callable[..., T], *args: Any) -> T:
        """fn(tokenizer, *args) on the text worker's thread."""
        return await self.worker.run(size, fn, self.tokenizer, *args)


def has_text(prompt: Any) -> bool:
    """Whether a completion prompt (a string, token ids, or a list of either) holds any text."""
    return isinstance(prompt, str) or any(isinstance(item, str) for item in prompt)


def text_size(value: Any) -> int:
    """Characters in a prompt, a list of prompts or token-id lists (one per id), or chat messages."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, int):
        return 1
    if isinstance(value, ChatMessage):
        return len(value.text())
    if isinstance(value, list | tuple):
        return sum(text_size(item) for item in value)
    return 0
