"""The `kvserve` command line (also `python -m server`).

    kvserve serve [flags]       run the HTTP server (flags: server/cli/flags.py)
    kvserve pull [NAME ...]     fetch default models into the cache (all of them without NAME)
    kvserve models              list the named models and whether they are cached
    kvserve chat [flags]        interactive chat with a running server (clients/chat_cli.py)
    kvserve bench [flags]       load generator / benchmark against a running server (clients/bench/)

`serve` imports the server only when chosen, so `pull` and `models` start without torch. `chat` and `bench`
are HTTP client programs: this process becomes `python -m clients.<program>` with the same arguments.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import NoReturn

_LOG_LEVELS = ("debug", "info", "warning", "error", "critical")

_SERVE_HELP = "run the OpenAI-compatible HTTP server"

# Subcommand -> (module run as `python -m MODULE ARGS`, help).
CLIENT_PROGRAMS = {
    "chat": ("clients.chat_cli", "interactive chat with a running kvserve server"),
    "bench": ("clients.bench", "load generator / benchmark against a running server"),
}


def _cmd_pull(args: argparse.Namespace) -> int:
    from engine import models_hub
    from engine.errors import ModelLoadError

    names = args.names or list(models_hub.MODELS)
    status = 0
    for name in names:
        try:
            path = models_hub.pull(name, force=args.force)
        except ModelLoadError as exc:  # includes ModelNotAvailableError: one clear line, no traceback
            print(f"kvserve pull {name}: {exc}", file=sys.stderr)
            status = 1
            continue
        print(f"{name}: {path}")
    return status


def _format_size(num_bytes: int) -> str:
    if num_bytes <= 0:
        return "-"
    size = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def _cmd_models(args: argparse.Namespace) -> int:
    from engine import models_hub

    rows = [("NAME", "ROLE", "PACKAGE", "CACHED", "SIZE", "PATH")]
    for m in models_hub.list_models():
        rows.append(
            (m.name, m.role, m.package, "yes" if m.is_cached else "no", _format_size(m.size_bytes), str(m.path))
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row[:-1], widths)) + "  " + row[-1])
    print(f"cache: {models_hub.kvserve_home()}")
    return 0


def _huge_pages_for_large_tensors() -> None:
    """Large CPU tensors (the weights' blocks, the KV cache) in transparent huge pages, unless the variable is
    already set (0: 4 KiB pages). torch's CPU allocator reads THP_MEM_ALLOC_ENABLE once, at its first allocation,
    so this runs before the server imports torch. A 1-row decode step reads every weight once, over ~150,000
    4 KiB pages of a 1.1B model: whole 1.1B steps with the weights in 2 MiB pages ran 1.011x (Q4_K_M) and 1.015x
    (Q4_0) on 2 Zen 4 cores (two copies of the weights alternating every 2 steps in one process), at the same
    resident memory and load time."""
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


def _add_serve(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("serve", help=_SERVE_HELP)
    _huge_pages_for_large_tensors()
    try:
        from server.cli.args import add_arguments
        from server.cli.runner import run
    except ImportError as exc:  # only while the server is not installed/built: say so, don't crash `kvserve pull`
        reason = str(exc)
        parser.set_defaults(func=lambda _args: _missing("serve", reason))
        return
    add_arguments(parser)
    parser.set_defaults(func=run)


def _missing(command: str, reason: str) -> int:
    print(f"kvserve {command} is not available: {reason}", file=sys.stderr)
    return 2


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description="kvserve: a self-hosted LLM inference server")
    parser.add_argument(
        "--log-level",
        dest="global_log_level",
        choices=_LOG_LEVELS,
        default=None,
        help="logging level for every subcommand (default: $KVSERVE_LOG_LEVEL or info)",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")

    pull = subparsers.add_parser("pull", help="fetch default models into the cache ($KVSERVE_HOME)")
    pull.add_argument("names", nargs="*", metavar="NAME", help="model names (default: all named models)")
    pull.add_argument("--force", action="store_true", help="fetch again even when a verified copy is cached")
    pull.set_defaults(func=_cmd_pull)

    models = subparsers.add_parser("models", help="list named models and whether they are cached")
    models.set_defaults(func=_cmd_models)

    # The server module (and torch with it) is imported only when `serve` is the chosen subcommand.
    chosen = next((a for a in argv if a in ("serve", "pull", "models", *CLIENT_PROGRAMS)), None)
    if chosen == "serve":
        _add_serve(subparsers)
    else:
        subparsers.add_parser("serve", help=_SERVE_HELP, add_help=False)
    for name, (_, help_text) in CLIENT_PROGRAMS.items():
        # No options of their own: everything after the name is handed to the program as it is.
        subparsers.add_parser(name, help=help_text, add_help=False)
    return parser


def _exec_client_program(module: str, args: Sequence[str], log_level: str | None) -> NoReturn:
    """Replace this process with the client program: its output and exit code are the command's."""
    env = dict(os.environ)
    if log_level:
        env["KVSERVE_LOG_LEVEL"] = log_level
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", module, *args], env)


def _configure_logging(args: argparse.Namespace) -> None:
    if args.global_log_level and hasattr(args, "log_level"):
        args.log_level = args.global_log_level  # `kvserve --log-level X serve` wins over serve's own default
    # models prints for a person at a terminal: no INFO chatter there
    quiet_default = "warning" if args.command == "models" else "info"
    level = (
        args.global_log_level or getattr(args, "log_level", None) or os.environ.get("KVSERVE_LOG_LEVEL", quiet_default)
    )
    logging.basicConfig(
        level=str(level).upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def _exit_while_starting(sig: int, frame: object) -> None:
    """SIGTERM before a subcommand runs (the server's imports take seconds): end at once, with 0."""
    sys.stderr.flush()
    os._exit(0)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # In a container this process is pid 1, and pid 1 ignores a signal it has no handler for: without this,
    # `docker stop` during start-up would wait out its grace and SIGKILL. `serve` installs its own handlers.
    default_sigterm = signal.signal(signal.SIGTERM, _exit_while_starting)
    parser = build_parser(argv)
    args, program_args = parser.parse_known_args(argv)
    if args.command != "serve":
        signal.signal(signal.SIGTERM, default_sigterm)
    if args.command in CLIENT_PROGRAMS:
        _exec_client_program(CLIENT_PROGRAMS[args.command][0], program_args, args.global_log_level)
    if program_args:
        parser.error(f"unrecognized arguments: {' '.join(program_args)}")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    _configure_logging(args)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
