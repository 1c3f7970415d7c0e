"""Model names as Ollama's clients send them: `name:tag`, where `:latest` is the name itself."""

from __future__ import annotations

from typing import Any

from engine.errors import InvalidRequestError
from server.catalogue.entries import LATEST, parse_keep_alive
from server.openai.served_models import embedding_model_names, generation_model_names


def served_name(state: Any, name: str) -> str:
    """`name`, or `name` without its `:latest` tag where that is what this server serves."""
    if name.endswith(LATEST):
        bare = name.removesuffix(LATEST)
        if bare in generation_model_names(state) or bare in embedding_model_names(state):
            return bare
    return name


def request_keep_alive(value: float | int | str | None) -> float | None:
    """A request's keep_alive in seconds (negative: forever, 0: unload once idle); None when it sets none."""
    try:
        return parse_keep_alive(value)
    except ValueError as exc:
        raise InvalidRequestError(f"keep_alive: {exc}", "keep_alive") from None
