"""Where catalogue entries come from besides the default models: more --model / --embedding-model /
--rerank-model values, a directory of GGUF files and model folders (--models-dir), and a TOML file
with per-model settings (--models-file).

A models file holds one `[[models]]` table per model:

    [[models]]
    name = "coder"                 # or names = ["coder", "qwen-coder"]; default: the file's stem
    path = "/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
    role = "generate"              # generate (default), embed or rerank
    keep_alive = "30m"             # idle time before it unloads; -1: never; default: --keep-alive
    preload = true                 # load at start instead of on the first request
    max_model_len = 4096           # any engine setting of its role, by its config name
    quantization = "int8"
    kv_cache_memory = "256MiB"
    speculative_method = "ngram"   # speculative_* keys: the speculative settings

A model given without settings takes the server's flags for its role (quantization, KV cache size, ...);
its own tokenizer, chat template and draft model are never inherited from the default model.
"""

from __future__ import annotations

import dataclasses
import json
import re
import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from engine.config import EmbedderConfig, EngineConfig, RerankerConfig, SpeculativeConfig
from server.catalogue.entries import ModelConfig, ModelEntry, Task, name_of_path, parse_keep_alive, split_named_path

# Settings a models file gives under another name than its config field.
_ALIASES = {"kv_cache_memory": "kv_cache_memory_bytes"}
_ENTRY_KEYS = frozenset({"name", "names", "path", "role", "keep_alive", "preload"})
_SPECULATIVE_PREFIX = "speculative_"
# Hugging Face model types of the encoders the embedding and rerank roles load.
_ENCODER_TYPES = frozenset({"bert", "roberta", "xlm-roberta", "distilbert", "nomic_bert", "modernbert", "new"})
_SPLIT_PART = re.compile(r"-(\d{5})-of-\d{5}\.gguf$")


@dataclasses.dataclass(frozen=True)
class ModelSources:
    """Where more models are read from (the "catalogue" flags): a directory, a models file."""

    models_dir: str | None = None
    models_file: str | None = None


@dataclasses.dataclass(frozen=True)
class BaseConfigs:
    """The settings a model without its own takes: the default models' configs, the model path aside."""

    engine: EngineConfig
    embedder: EmbedderConfig | None
    reranker: RerankerConfig | None

    def for_path(self, task: Task, path: str) -> ModelConfig:
        if task == "generate":
            speculative = self.engine.speculative
            if speculative is not None and speculative.method == "draft":
                speculative = None  # the draft model shares the default model's tokenizer, not this one's
            return dataclasses.replace(
                self.engine, model=path, tokenizer=None, chat_template=None, speculative=speculative
            )
        if task == "embed":
            base = self.embedder or EmbedderConfig(model=path, dtype=self.engine.dtype, device=self.engine.device)
            return dataclasses.replace(base, model=path)
        base = self.reranker or RerankerConfig(model=path, dtype=self.engine.dtype, device=self.engine.device)
        return dataclasses.replace(base, model=path)


def entries_from_values(base: BaseConfigs, task: Task, values: Iterable[str]) -> list[ModelEntry]:
    """More models of `task` from flag values (`PATH`, a model name, or `NAME=PATH`)."""
    entries = []
    for value in values:
        name, path = split_named_path(value)
        entries.append(ModelEntry((name or name_of_path(path),), task, base.for_path(task, path)))
    return entries


def entries_from_dir(base: BaseConfigs, directory: str) -> list[ModelEntry]:
    """Every GGUF file (the first part of a split one) and every model folder in `directory`, by name."""
    root = Path(directory).expanduser()
    if not root.is_dir():
        raise ValueError(f"--models-dir {directory!r} is not a directory")
    entries = []
    for path in sorted(root.iterdir()):
        if path.is_file() and path.suffix == ".gguf" and not path.name.startswith("mmproj"):
            part = _SPLIT_PART.search(path.name)
            if part is not None and part.group(1) != "00001":
                continue
            name = _SPLIT_PART.sub("", path.name) if part is not None else path.stem
            entries.append(ModelEntry((name,), "generate", base.for_path("generate", str(path))))
        elif path.is_dir() and (path / "config.json").is_file():
            task = _folder_task(path / "config.json")
            entries.append(ModelEntry((path.name,), task, base.for_path(task, str(path))))
    if not entries:
        raise ValueError(f"--models-dir {directory!r} holds no .gguf file and no model folder (with a config.json)")
    return entries


def _folder_task(config_file: Path) -> Task:
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{config_file}: not a readable config.json ({exc})") from None
    architectures = config.get("architectures") or []
    if any(str(a).endswith("ForSequenceClassification") for a in architectures):
        return "rerank"
    return "embed" if config.get("model_type") in _ENCODER_TYPES else "generate"


def entries_from_file(base: BaseConfigs, file: str) -> list[ModelEntry]:
    """The `[[models]]` tables of a TOML models file; raises ValueError naming the file and the entry."""
    try:
        document = tomllib.loads(Path(file).expanduser().read_text())
    except OSError as exc:
        raise ValueError(f"--models-file {file!r}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"--models-file {file!r} is not valid TOML: {exc}") from None
    unknown = set(document) - {"models"}
    if unknown:
        raise ValueError(f"--models-file {file!r}: unknown top-level keys {sorted(unknown)} (expected [[models]])")
    tables = document.get("models", [])
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise ValueError(f"--models-file {file!r}: `models` must be an array of tables ([[models]])")
    entries = []
    for number, table in enumerate(tables, start=1):
        try:
            entries.append(_entry_of_table(base, table))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"--models-file {file!r}, model {number}: {exc}") from None
    return entries


def _entry_of_table(base: BaseConfigs, table: dict[str, Any]) -> ModelEntry:
    path = table.get("path")
    if not isinstance(path, str) or not path.strip():
        raise ValueError("`path` (the model's file, folder or name) is required")
    task = table.get("role", "generate")
    if task not in ("generate", "embed", "rerank"):
        raise ValueError(f"role must be generate, embed or rerank, got {task!r}")
    names = table.get("names") or ([table["name"]] if "name" in table else [name_of_path(path)])
    if isinstance(names, str) or not all(isinstance(n, str) and n.strip() for n in names):
        raise ValueError("`names` must be a list of non-empty strings (`name`: one string)")
    config = base.for_path(task, path)
    settings = {k: v for k, v in table.items() if k not in _ENTRY_KEYS}
    config = _with_settings(config, settings)
    preload = table.get("preload", False)
    if not isinstance(preload, bool):
        raise ValueError(f"preload must be true or false, got {preload!r}")
    return ModelEntry(tuple(names), task, config, parse_keep_alive(table.get("keep_alive")), preload)


def _with_settings(config: ModelConfig, settings: dict[str, Any]) -> ModelConfig:
    from server.config import parse_bytes  # here: server.config holds the entries

    fields = {f.name for f in dataclasses.fields(config)} - {"model", "speculative"}
    changes: dict[str, Any] = {}
    speculative: dict[str, Any] = {}
    for key, value in settings.items():
        if key.startswith(_SPECULATIVE_PREFIX) and isinstance(config, EngineConfig):
            speculative[key.removeprefix(_SPECULATIVE_PREFIX)] = value
            continue
        field = _ALIASES.get(key, key)
        if field not in fields:
            allowed = sorted({*fields, *_ALIASES} - set(_ALIASES.values()))
            extra = " and speculative_* keys" if isinstance(config, EngineConfig) else ""
            raise ValueError(f"unknown setting {key!r}; this role takes {', '.join(allowed)}{extra}")
        changes[field] = parse_bytes(value) if field == "kv_cache_memory_bytes" else value
    if speculative:
        current = config.speculative
        defaults = dataclasses.asdict(current) if current is not None else {}
        changes["speculative"] = SpeculativeConfig(**{**defaults, **speculative})
    return dataclasses.replace(config, **changes)
