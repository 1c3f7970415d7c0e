"""`kvserve serve`: flags (each also read from KVSERVE_<NAME>) and the uvicorn run.

server/__main__.py calls add_arguments(parser) and run(args); `python -m server.cli` works too.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any

from server.config import LOG_LEVELS, POOLING_CHOICES, ServerConfig, parse_bytes

ENV_PREFIX = "KVSERVE_"
_DEFAULTS = ServerConfig.__dataclass_fields__


def _optional(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    """'none' / '' -> None, else kind(text)."""

    def parse(text: str) -> Any:
        return None if text.strip().lower() in ("", "none", "null") else kind(text)

    parse.__name__ = kind.__name__
    return parse


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {text!r}")


def _size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


# (field, parser of the text form, help). Every ServerConfig field is a flag.
_FLAGS: list[tuple[str, Callable[[str], Any], str]] = [
    ("model", str, "generation model: a default-model name, a local HF directory or .gguf file, or a Hub id"),
    ("embedding_model", _optional(str), "embedding model (same forms as --model); 'none' serves no embeddings"),
    ("served_model_name", _optional(str), "the name clients use for the generation model (default: --model)"),
    ("host", str, "address to listen on"),
    ("port", int, "TCP port to listen on"),
    ("dtype", str, "weights and activations dtype: float32, bfloat16 or float16 (CUDA only)"),
    (
        "quantization",
        str,
        "none, int8 (weight-only int8 linear layers, CPU float32) or auto (int8 for a .gguf on CPU, else none)",
    ),
    ("device", str, "torch device: cpu, cuda, cuda:1, ..."),
    ("max_model_len", _optional(int), "longest prompt plus output, in tokens (default: the model's context)"),
    ("kv_cache_memory", _size, "memory for the paged KV cache: bytes or with a unit (512MiB, 2GB)"),
    ("block_size", int, "tokens per KV-cache block (a power of two)"),
    ("max_num_seqs", int, "most sequences in one running batch"),
    ("max_num_batched_tokens", int, "token budget of one engine step (chunked prefill above it)"),
    ("sliding_window", _optional(int), "force a sliding attention window of this many tokens on any model"),
    ("num_sink_tokens", int, "with a sliding window: the first N tokens stay visible forever"),
    ("enable_prefix_caching", _bool, "reuse KV blocks of shared prompt prefixes (true/false)"),
    ("max_queued_requests", int, "most requests waiting to run; past it requests get 429 with Retry-After"),
    ("api_key", _optional(str), "require 'Authorization: Bearer KEY' on every route but /health and /metrics"),
    ("allowed_origins", str, "comma-separated CORS origins ('*' for any; empty: CORS off)"),
    ("request_timeout", _optional(float), "seconds a generation request may run before it is aborted (none: no limit)"),
    ("max_request_bytes", _size, "largest request body accepted (413 above it): bytes or with a unit"),
    ("shutdown_timeout", float, "on SIGTERM, seconds running requests get to finish"),
    ("max_client_batch_size", int, "most prompts in one /v1/completions request"),
    ("embedding_max_batch_tokens", int, "token budget of one embedding forward pass"),
    ("pooling", _optional(str), f"embedding pooling, one of {', '.join(POOLING_CHOICES)} (default: the model's own)"),
    ("log_level", str, f"logging level: {', '.join(LOG_LEVELS)}"),
    ("num_threads", _optional(int), "torch CPU threads (default: torch's choice)"),
]


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def _default_text(value: Any) -> str:
    if isinstance(value, tuple):
        return ",".join(value) or "''"
    return "none" if value is None else str(value)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every serve flag; a flag's default comes from KVSERVE_<NAME> when that is set."""
    assert {f for f, _, _ in _FLAGS} == set(_DEFAULTS), "every ServerConfig field needs a flag"
    group = parser.add_argument_group("serve options (each also read from the environment variable shown)")
    for field_name, kind, help_text in _FLAGS:
        default = _DEFAULTS[field_name].default
        env = env_name(field_name)
        if env in os.environ:
            try:
                default = kind(os.environ[env])
            except (ValueError, argparse.ArgumentTypeError) as exc:
                parser.error(f"{env}={os.environ[env]!r}: {exc}")
        flag = "--" + field_name.replace("_", "-")
        group.add_argument(
            flag,
            dest=field_name,
            type=kind,
            default=default,
            metavar="{true,false}" if kind is _bool else field_name.upper(),
            help=f"{help_text} [env {env}; default {_default_text(_DEFAULTS[field_name].default)}]",
        )


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServerConfig) if hasattr(args, f.name)}
    return ServerConfig(**values)


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    logging.getLogger().setLevel(level.upper())


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT (graceful: running requests get --shutdown-timeout), then return 0.

    Returns 1 if a model fails to load, 2 on a bad flag combination.
    """
    import uvicorn

    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"kvserve serve: {exc}", file=sys.stderr)
        return 2
    _setup_logging(config.log_level)
    from server.app import create_app

    exit_code = 0
    server: uvicorn.Server | None = None

    def on_fatal(exc: BaseException) -> None:
        nonlocal exit_code
        exit_code = 1
        if server is not None:
            server.should_exit = True

    app = create_app(config, on_fatal=on_fatal)
    uvicorn_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        access_log=False,  # the middleware writes one line per request with tokens and latency
        timeout_graceful_shutdown=config.shutdown_timeout,
        lifespan="on",
        # Not "auto": with uvloop installed, a client that hung up right after sending a
        # non-streamed request was sometimes never reported as gone, so its generation ran to
        # the end (tests/server/test_server_robustness.py failed ~40% of runs); asyncio's loop never missed it.
        loop="asyncio",
    )
    server = uvicorn.Server(uvicorn_config)
    # uvicorn re-raises the signal that stopped it once it is done; no-op handlers make
    # that re-raise harmless, so a graceful SIGTERM ends with exit status 0.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not server.started and exit_code == 0:
        return 1  # could not bind, or start-up failed
    return exit_code


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvserve serve", description="Run the kvserve HTTP server.")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
