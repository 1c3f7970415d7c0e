"""What transformers reads from a GGUF file's metadata, kept on disk so the next load of the file reads it back.

transformers turns a GGUF file's metadata into a model config and a tokenizer by parsing every key of the
file, the tokenizer's vocabulary and merges among them (SmolLM2-135M: about 2.6 s for the config and 3.4 s
for the tokenizer, on one core, each a parse of its own; engine/hub/gguf_reader_view.py feeds both from the
engine's own quick pass over the file, which leaves most of that to transformers' conversion of what it
reads). Both results depend on nothing but the file and
the transformers version, so after the first load they are written to a folder of the cache, named by the
file's resolved path, size and modification time and the transformers version: a file changed in place, or
another transformers, is read afresh. The config is the dict transformers' mapping gives; the tokenizer is
saved as transformers saves any tokenizer, and loads back in about 0.1 s.

A cache that cannot be written (a read-only home) is skipped with one debug line: loads then stay as slow
as without it, nothing fails. $KVSERVE_GGUF_CACHE=0 turns it off.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from engine.hub.models_hub import kvserve_home

logger = logging.getLogger(__name__)

FORMAT = 1  # bump when what is stored changes
CONFIG_FILE = "config.json"
TOKENIZER_DIR = "tokenizer"
SOURCE_FILE = "source.json"  # the file's path, size and modification time, for prune()
DISABLE_ENV = "KVSERVE_GGUF_CACHE"


def cache_root() -> Path:
    return kvserve_home() / "gguf-metadata"


def entry_dir(path: Path) -> Path | None:
    """The cache folder for this version of the file (None: the cache is off or the file unreadable)."""
    if os.environ.get(DISABLE_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    source = _source(path)
    if source is None:
        return None
    import transformers

    key = f"{FORMAT}|{json.dumps(source)}|{transformers.__version__}"
    digest = hashlib.blake2b(key.encode(), digest_size=12).hexdigest()
    return cache_root() / f"{Path(source['path']).stem}-{digest}"


def _source(path: Path) -> dict[str, Any] | None:
    """What names a version of the file: its resolved path, size and modification time (None: unreadable)."""
    try:
        resolved = path.resolve()
        stat = resolved.stat()
    except OSError:
        return None
    return {"path": str(resolved), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def load_config(path: Path) -> dict[str, Any]:
    """transformers' config dict for the GGUF file (load_gguf_checkpoint's "config"), from the cache if there."""
    folder = entry_dir(path)
    cached = folder / CONFIG_FILE if folder is not None else None
    if cached is not None and cached.is_file():
        try:
            return json.loads(cached.read_text())
        except (OSError, ValueError) as exc:
            logger.debug("GGUF metadata cache %s unreadable (%s): reading the file", cached, exc)
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from engine.hub.gguf_reader_view import reading_with_quick_pass  # numpy: only where a GGUF is read

    with reading_with_quick_pass():
        config = dict(load_gguf_checkpoint(str(path), return_tensors=False)["config"])
    try:
        text = json.dumps(config)
    except (TypeError, ValueError):  # a value JSON cannot hold: not cached, used as it is
        return config
    if folder is not None:
        _store(folder, lambda staging: (staging / CONFIG_FILE).write_text(text), CONFIG_FILE, path)
    return json.loads(text)  # as a later load reads it back (lists, not tuples), so both loads agree


def load_tokenizer(path: Path) -> Any:
    """transformers' tokenizer for the GGUF file, from the cache if there."""
    from transformers import AutoTokenizer

    folder = entry_dir(path)
    cached = folder / TOKENIZER_DIR if folder is not None else None
    if cached is not None and cached.is_dir():
        try:
            return AutoTokenizer.from_pretrained(str(cached))
        except Exception as exc:  # a damaged entry: transformers raises many types
            logger.debug("GGUF metadata cache %s unreadable (%s): reading the file", cached, exc)
    from engine.hub.gguf_reader_view import reading_with_quick_pass  # numpy: only where a GGUF is read

    with reading_with_quick_pass():
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if folder is not None:
        _store(folder, lambda staging: tokenizer.save_pretrained(str(staging / TOKENIZER_DIR)), TOKENIZER_DIR, path)
    return tokenizer


def _store(folder: Path, write: Any, name: str, path: Path) -> None:
    """Write `name` into `folder` whole or not at all: written in a staging folder beside it, then renamed in.
    Entries of files that are gone or changed are removed first (a new entry is made only by a first load)."""
    try:
        prune()
        folder.mkdir(parents=True, exist_ok=True)
        (folder / SOURCE_FILE).write_text(json.dumps(_source(path)))
        staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=folder))
        try:
            write(staging)
            os.replace(staging / name, folder / name)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    except Exception as exc:  # a read-only cache, a full disk, another process that stored it first, ...
        logger.debug("GGUF metadata cache not written to %s: %s", folder, exc)


def prune() -> int:
    """Remove the entries whose file is gone or has changed since; returns how many."""
    removed = 0
    for folder in cache_root().glob("*") if cache_root().is_dir() else ():
        try:
            recorded = json.loads((folder / SOURCE_FILE).read_text())
        except (OSError, ValueError):
            recorded = None
        if recorded is None or _source(Path(recorded["path"])) != recorded:
            shutil.rmtree(folder, ignore_errors=True)
            removed += 1
    return removed
