"""`kvserve chat`: a terminal chat with a running kvserve server.

Reads one user message per line from stdin, streams the assistant's reply as it is
generated, and keeps the conversation (the whole history is sent each turn).
Commands: /exit (or /quit, or end of input), /reset (forget the conversation).
Works with piped stdin, e.g. `printf 'Hi\\n/exit\\n' | kvserve chat`.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import TextIO

from clients.client import Client, KVServeAPIError, KVServeConnectionError, Message
from clients.logging_setup import configure_logging

HELP_TEXT = "commands: /exit  /reset  /help"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    env = os.environ.get
    parser.add_argument(
        "--base-url",
        default=env("KVSERVE_BASE_URL", "http://127.0.0.1:8000"),
        help="server address (env KVSERVE_BASE_URL)",
    )
    parser.add_argument("--api-key", default=env("KVSERVE_API_KEY"), help="bearer token (env KVSERVE_API_KEY)")
    parser.add_argument("--model", default=None, help="model to chat with (default: the server's generation model)")
    parser.add_argument("--system", default=None, help="system message that starts the conversation")
    parser.add_argument("--max-tokens", type=int, default=512, help="reply length limit in tokens")
    parser.add_argument("--temperature", type=float, default=None, help="sampling temperature (server default)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for a reply")


class ChatSession:
    """The conversation: history plus one streamed turn at a time."""

    def __init__(self, client: Client, model: str | None, system: str | None, **params: object) -> None:
        self.client = client
        self.model = model
        self.system = system
        self.params = {k: v for k, v in params.items() if v is not None}
        self.history: list[Message] = []
        self.reset()

    def reset(self) -> None:
        self.history = [{"role": "system", "content": self.system}] if self.system else []

    def send(self, text: str, out: TextIO) -> str:
        """Stream the reply to `text` into `out`; the turn joins the history only if it completes."""
        messages = [*self.history, {"role": "user", "content": text}]
        stream = self.client.stream_chat(messages, model=self.model, **self.params)
        for delta in stream:
            out.write(delta)
            out.flush()
        out.write("\n")
        out.flush()
        self.history = [*messages, {"role": "assistant", "content": stream.text}]
        return stream.text


def _read_line(stdin: TextIO, stdout: TextIO, is_interactive: bool) -> str:
    """One line of input ('' at end of input); a terminal gets a prompt and line editing."""
    if is_interactive and stdin is sys.stdin and stdout is sys.stdout:
        import readline  # noqa: F401  (imported for its side effect: arrow keys and history in input())

        try:
            return input("you> ") + "\n"
        except EOFError:
            return ""
    if is_interactive:
        stdout.write("you> ")
        stdout.flush()
    return stdin.readline()


def run(args: argparse.Namespace, stdin: TextIO | None = None, stdout: TextIO | None = None) -> int:
    stdin = stdin or sys.stdin
    stdout = stdout or sys.stdout
    is_interactive = stdin.isatty()
    with Client(args.base_url, args.api_key, timeout=args.timeout, model=args.model) as client:
        session = ChatSession(client, args.model, args.system, max_tokens=args.max_tokens, temperature=args.temperature)
        if is_interactive:
            stdout.write(f"kvserve chat at {client.base_url} ({HELP_TEXT})\n")
        while True:
            line = _read_line(stdin, stdout, is_interactive)
            if not line:
                break  # end of input
            text = line.strip()
            if not text:
                continue
            if text in ("/exit", "/quit"):
                break
            if text == "/reset":
                session.reset()
                stdout.write("(conversation reset)\n")
                continue
            if text == "/help":
                stdout.write(HELP_TEXT + "\n")
                continue
            try:
                session.send(text, stdout)
            except KVServeAPIError as exc:
                print(f"error: {exc}", file=sys.stderr)
            except KVServeConnectionError as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    # A person reads this at a terminal: no INFO chatter (one httpx line per request) unless asked for.
    configure_logging(os.environ.get("KVSERVE_LOG_LEVEL", "warning").upper(), quiet_httpx=False)
    parser = argparse.ArgumentParser(
        prog="kvserve chat", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
