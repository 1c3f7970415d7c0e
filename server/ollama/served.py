"""Model names as Ollama's clients send them: `name:tag`, where `:latest` is the name itself."""

from __future__ import annotations

from typing import Any

from server.openai.served_models import embedding_model_names, generation_model_names

LATEST = ":latest"


def served_name(state: Any, name: str) -> str:
    """`name`, or `name` without its `:latest` tag where that is what this server serves."""
    if name.endswith(LATEST):
        bare = name.removesuffix(LATEST)
        if bare in generation_model_names(state) or bare in embedding_model_names(state):
            return bare
    return name
