"""Config assembly from the serve flags: add_arguments puts FLAGS on a parser (each flag's default from
KVSERVE_<NAME> when that is set, else the configs' own); config_from_args and scale_out_from_args turn the
parsed flags into the nested ServerConfig and the ScaleOut."""

from __future__ import annotations

import argparse
import dataclasses
import os
from types import SimpleNamespace
from typing import Any

from engine.config import EmbedderConfig, EngineConfig, RerankerConfig, SpeculativeConfig
from server.catalogue.entries import ModelEntry, split_named_path
from server.catalogue.sources import (
    BaseConfigs,
    ModelSources,
    entries_from_dir,
    entries_from_file,
    entries_from_values,
)
from server.cli.flags import FLAGS, env_name
from server.cli.kinds import boolean
from server.config import ServerConfig, default_embedder_config, default_engine_config
from server.ray.scale_out import ScaleOut


class _AddValues(argparse.Action):
    """A repeatable flag whose values (tuples) add up; the first use on the command line replaces the
    default (its environment variable's), as a flag wins over its variable."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        current = getattr(namespace, self.dest, None)
        earlier = () if current is None or current is self.default else current
        setattr(namespace, self.dest, (*earlier, *values))


def _speculative_defaults() -> SimpleNamespace:
    """SpeculativeConfig's defaults, but no method: speculation is off unless --speculative-method names one."""
    defaults = {field.name: field.default for field in dataclasses.fields(SpeculativeConfig)}
    return SimpleNamespace(**{**defaults, "method": None})


def flag_defaults() -> dict[str, Any]:
    """flag name -> the default `kvserve serve` uses when neither the flag nor its variable is set."""
    server = ServerConfig()
    configs = {"server": server, "engine": default_engine_config(), "embedder": default_embedder_config()}
    configs["reranker"] = server.reranker  # None: no rerank model unless --rerank-model names one
    configs["speculative"] = _speculative_defaults()
    configs["catalogue"] = ModelSources()
    scale_out = ScaleOut()
    defaults = {}
    for flag in FLAGS:
        if flag.scale_out is not None:
            defaults[flag.name] = getattr(scale_out, flag.scale_out)
            continue
        config_name, field_name = flag.targets[0]
        config = configs[config_name]
        defaults[flag.name] = getattr(config, field_name) if config is not None else None
    return defaults


def _default_text(value: Any) -> str:
    if isinstance(value, tuple):
        return ",".join(value) or "''"
    return "none" if value is None else str(value)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every serve flag; a flag's default comes from KVSERVE_<NAME> when that is set."""
    group = parser.add_argument_group("serve options (each also read from the environment variable shown)")
    defaults = flag_defaults()
    for flag in FLAGS:
        default = defaults[flag.name]
        env = env_name(flag.name)
        if env in os.environ:
            try:
                default = flag.kind(os.environ[env])
            except (ValueError, argparse.ArgumentTypeError) as exc:
                parser.error(f"{env}={os.environ[env]!r}: {exc}")
        group.add_argument(
            "--" + flag.name.replace("_", "-"),
            dest=flag.name,
            type=flag.kind,
            default=default,
            **({"action": _AddValues} if flag.repeatable else {}),
            metavar="{true,false}" if flag.kind is boolean else getattr(flag.kind, "metavar", flag.name.upper()),
            help=f"{flag.help} [env {env}; default {_default_text(defaults[flag.name])}]",
        )
    group.add_argument(
        "--no-playground", dest="playground", action="store_false", help="the same as --playground false"
    )


def _speculative_config(values: dict[str, Any]) -> SpeculativeConfig | None:
    """The engine's SpeculativeConfig, or None without --speculative-method. The other speculative flags are
    checked either way: a bad value, or a --draft-model that nothing would load, is an error, not ignored."""
    if values["method"] is not None:
        return SpeculativeConfig(**values)
    if values["draft_model"]:
        raise ValueError("--draft-model is only used with --speculative-method draft")
    SpeculativeConfig(**{**values, "method": "ngram"})  # the checks alone
    return None


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The nested ServerConfig from parsed flags (a flag `args` lacks takes its default); an empty
    --embedding-model serves no embeddings, an empty --rerank-model (the default) no reranking, no
    --speculative-method (the default) no speculative decoding.

    Raises ValueError (from the configs' own checks) on a value or combination that cannot work.
    """
    defaults = flag_defaults()
    values: dict[str, dict[str, Any]] = {
        **{name: {} for name in ("server", "engine", "embedder", "reranker", "speculative", "catalogue")}
    }
    for flag in FLAGS:
        for config_name, field_name in flag.targets:
            value = getattr(args, flag.name, defaults[flag.name])
            if isinstance(value, tuple) and isinstance(values[config_name].get(field_name), tuple):
                value = values[config_name][field_name] + value  # --api-key and --api-key-file
            values[config_name][field_name] = value
    generation_models = _models(values["engine"].pop("model"))
    if not generation_models:
        raise ValueError("--model: a generation model is required")
    embedding_models = _models(values["embedder"].pop("model"))
    rerank_models = _models(values["reranker"].pop("model"))
    name, path = split_named_path(generation_models[0])
    if name is not None and not values["server"].get("served_model_name"):
        values["server"]["served_model_name"] = (name,)
    engine = EngineConfig(**values["engine"], model=path, speculative=_speculative_config(values["speculative"]))
    embedder = EmbedderConfig(**values["embedder"], model=embedding_models[0]) if embedding_models else None
    reranker = RerankerConfig(**values["reranker"], model=rerank_models[0]) if rerank_models else None
    base = BaseConfigs(engine, embedder, reranker)
    more: list[ModelEntry] = [
        *entries_from_values(base, "generate", generation_models[1:]),
        *entries_from_values(base, "embed", embedding_models[1:]),
        *entries_from_values(base, "rerank", rerank_models[1:]),
    ]
    sources = ModelSources(**values["catalogue"])
    if sources.models_dir:
        more += entries_from_dir(base, sources.models_dir)
    if sources.models_file:
        more += entries_from_file(base, sources.models_file)
    return ServerConfig(engine=engine, embedder=embedder, reranker=reranker, models=tuple(more), **values["server"])


def _models(value: str | tuple[str, ...] | None) -> tuple[str, ...]:
    """A model flag's values: a tuple from the command line, a plain string (or None) from its default."""
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else value


def scale_out_from_args(args: argparse.Namespace) -> ScaleOut:
    """The ScaleOut from parsed flags (a flag `args` lacks takes its default). Raises ValueError."""
    defaults = flag_defaults()
    values = {f.scale_out: getattr(args, f.name, defaults[f.name]) for f in FLAGS if f.scale_out is not None}
    return ScaleOut(**values)
