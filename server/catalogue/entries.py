"""One catalogue entry: a model the server can serve, its names, its task and its own engine settings.

The first entry of each task is that task's default model (the one a request that names no model gets);
it loads at start. The others load when a request first names them.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from engine.config import EmbedderConfig, EngineConfig, RerankerConfig

Task = Literal["generate", "embed", "rerank"]
TASKS: tuple[Task, ...] = ("generate", "embed", "rerank")
ModelConfig = EngineConfig | EmbedderConfig | RerankerConfig

FOREVER = math.inf  # a keep-alive that never expires
LATEST = ":latest"  # Ollama's clients name a model `name:tag`; this tag is the name itself
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+-]*")


@dataclass(frozen=True)
class ModelEntry:
    """names: what clients call it, the first in every answer's `model` field (never empty).
    task: what it serves. config: how it loads (its path is `config.model`).
    keep_alive: seconds it stays loaded once idle (FOREVER: until evicted or unloaded; None: the
        server's --keep-alive). preload: loaded at start rather than on its first request."""

    names: tuple[str, ...]
    task: Task
    config: ModelConfig
    keep_alive: float | None = None
    preload: bool = False

    def __post_init__(self) -> None:
        if not self.names:
            raise ValueError(f"model {self.config.model!r} has no name")
        if self.task not in TASKS:
            raise ValueError(f"model {self.names[0]!r}: role must be one of {', '.join(TASKS)}, got {self.task!r}")
        if self.keep_alive is not None and math.isnan(self.keep_alive):
            raise ValueError(f"model {self.names[0]!r}: keep_alive is not a number")

    @property
    def name(self) -> str:
        return self.names[0]


def split_named_path(text: str) -> tuple[str | None, str]:
    """`NAME=PATH` -> (NAME, PATH); a plain path or model name -> (None, it)."""
    name, sep, path = text.partition("=")
    if sep and path and _NAME.fullmatch(name):
        return name, path
    return None, text


def name_of_path(model: str) -> str:
    """The name a model is served under when none is given: a file's stem, a folder's name, or the
    model name or Hub id itself."""
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        return path.stem
    if path.is_dir() or model.startswith(("/", ".", "~")):
        return path.resolve().name
    return model


def parse_keep_alive(value: str | float | int | None) -> float | None:
    """Ollama's keep_alive: seconds (a number), a duration ("90s", "5m", "1h", "1h30m"), a negative number
    (keep forever) or 0 (unload as soon as idle). None stays None."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"keep_alive must be a duration, got {value!r}")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        text = value.strip().lower()
        try:
            seconds = float(text)
        except ValueError:
            seconds = _duration_seconds(text)
    if math.isnan(seconds):
        raise ValueError("keep_alive is not a number")
    return FOREVER if seconds < 0 else seconds


_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def _duration_seconds(text: str) -> float:
    sign = -1.0 if text.startswith("-") else 1.0
    body = text.lstrip("-")
    parts = _DURATION_PART.findall(body)
    if not body or "".join(number + unit for number, unit in parts) != body:
        raise ValueError(f"keep_alive {text!r} is not a duration (seconds, or like 90s, 5m, 1h30m; -1: forever)")
    return sign * sum(float(number) * _UNIT_SECONDS[unit] for number, unit in parts)


def format_keep_alive(seconds: float) -> str:
    if seconds == FOREVER:
        return "forever"
    return f"{seconds:g}s"
