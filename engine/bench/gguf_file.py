"""The GGUF file of a model: `python -m engine.bench.gguf_file [NAME]` prints its path (pulled if needed)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from engine.errors import ModelLoadError
from engine.hub.models_hub import DEFAULT_GENERATION_MODEL, resolve_model


def gguf_path(name_or_path: str = DEFAULT_GENERATION_MODEL) -> Path:
    """The .gguf file of a named model, a model directory or a file path."""
    path = Path(resolve_model(name_or_path))
    if not path.is_dir():
        return path
    ggufs = sorted(path.glob("*.gguf"))
    if not ggufs:
        raise FileNotFoundError(f"no .gguf file in {path}")
    return ggufs[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model", nargs="?", default=DEFAULT_GENERATION_MODEL, help="model name or path")
    try:
        print(gguf_path(parser.parse_args(argv).model))
    except (ModelLoadError, FileNotFoundError) as exc:
        print(f"gguf_file: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
