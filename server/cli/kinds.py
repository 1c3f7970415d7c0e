"""How a `kvserve serve` flag's text (on the command line or in KVSERVE_<NAME>) becomes its value: each is a
Flag.kind (server/cli/flags.py). A kind raises argparse.ArgumentTypeError on text it refuses; its `metavar`,
when it has one, is what `--help` shows for the flag's value."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from typing import Any

from server.catalogue.entries import parse_keep_alive
from server.config import parse_bytes, parse_memory_budget
from server.http.access import parse_keys, read_key_file


def optional(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    """'none' / '' -> None, else kind(text)."""

    def parse(text: str) -> Any:
        return None if text.strip().lower() in ("", "none", "null") else kind(text)

    parse.__name__ = kind.__name__
    if hasattr(kind, "metavar"):
        parse.metavar = kind.metavar  # type: ignore[attr-defined]
    return parse


def path_text(metavar: str) -> Callable[[str], str]:
    """A local path, made absolute (a Ray replica may start elsewhere); what loads it checks it. `--help`
    shows `metavar` (DIR, FILE) for it."""

    def parse(text: str) -> str:
        return os.path.abspath(os.path.expanduser(text))

    parse.__name__ = "path"
    parse.metavar = metavar  # type: ignore[attr-defined]
    return parse


def boolean(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {text!r}")


def one_of(*choices: str) -> Callable[[str], str]:
    """A kind that accepts one of `choices` (any case); `--help` shows them as the flag's metavar."""

    def parse(text: str) -> str:
        value = text.strip().lower()
        if value not in choices:
            raise argparse.ArgumentTypeError(f"must be one of {', '.join(choices)}; got {text!r}")
        return value

    parse.__name__ = "choice"
    parse.metavar = "{" + ",".join(choices) + "}"  # type: ignore[attr-defined]
    return parse


def json_object(text: str) -> dict[str, Any]:
    """A JSON object ('' or none: an empty one)."""
    if text.strip().lower() in ("", "none"):
        return {}
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text[:64]!r}")
    return value


json_object.metavar = "JSON"  # type: ignore[attr-defined]


def byte_size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def key_list(text: str) -> tuple[str, ...]:
    return parse_keys(text)


key_list.metavar = "KEY"  # type: ignore[attr-defined]


def name_list(text: str) -> tuple[str, ...]:
    """Names, comma-separated (blanks around each dropped, repeats once)."""
    return parse_keys(text)


name_list.metavar = "NAME"  # type: ignore[attr-defined]


def key_file(text: str) -> tuple[str, ...]:
    """--api-key-file PATH: the keys in the file; '' or none: no file."""
    if text.strip().lower() in ("", "none"):
        return ()
    try:
        return read_key_file(text)
    except (OSError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


key_file.metavar = "PATH"  # type: ignore[attr-defined]


def model_list(text: str) -> tuple[str, ...]:
    """One model (a path, a default-model name, a Hub id, or NAME=PATH) per use of a repeatable model flag;
    'none' or nothing: no model."""
    text = text.strip()
    return () if text.lower() in ("", "none") else (text,)


model_list.metavar = "MODEL"  # type: ignore[attr-defined]


def duration(text: str) -> float:
    """Seconds, or a duration (90s, 5m, 1h30m); a negative one: forever."""
    try:
        seconds = parse_keep_alive(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    assert seconds is not None
    return seconds


duration.metavar = "DURATION"  # type: ignore[attr-defined]


def memory_budget(text: str) -> int | float | None:
    """Bytes (16GiB, 8000000000) or a fraction of memory (0.8); 'none': no budget."""
    if text.strip().lower() in ("", "none"):
        return None
    try:
        return parse_memory_budget(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


memory_budget.metavar = "BYTES|FRACTION"  # type: ignore[attr-defined]
