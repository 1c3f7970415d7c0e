"""`kvserve chat` driven through piped stdin against the live test server of test_client.py."""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from clients import chat_cli
from tests.clients.test_client import GEN_MODEL, LiveServer

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    live = LiveServer().start()
    yield live
    live.stop()


@pytest.fixture(autouse=True)
def _clean(server: LiveServer) -> None:
    server.reset()


def _args(server: LiveServer, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    chat_cli.add_arguments(parser)
    return parser.parse_args(["--base-url", server.base_url, *extra])


class RecordingOut(io.StringIO):
    """Remembers each write, to show the reply arrives in pieces (streamed), not at once."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def write(self, s: str) -> int:
        self.writes.append(s)
        return super().write(s)


def test_chat_keeps_history_resets_and_exits(server: LiveServer) -> None:
    stdin = io.StringIO("hello\n\nhow are you\n/reset\nagain\n/exit\nnever sent\n")
    out = RecordingOut()
    assert chat_cli.run(_args(server), stdin=stdin, stdout=out) == 0
    lines = out.getvalue().splitlines()
    assert lines == [
        "You said: hello (turn 1, replies 0, system no)",
        "You said: how are you (turn 2, replies 1, system no)",  # the first turn was sent back as history
        "(conversation reset)",
        "You said: again (turn 1, replies 0, system no)",
    ]
    assert server.hits("/v1/chat/completions") == 3
    # streamed: the first reply came as several writes, the role-only chunk added nothing
    first_reply_writes = out.writes[: out.writes.index("\n")]
    assert len(first_reply_writes) == len(lines[0].split(" "))
    # the history sent on turn 2 holds the assistant's first reply verbatim
    turn2 = [b for p, b in server.app.state.bodies if p == "/v1/chat/completions"][1]
    assert turn2["messages"][1] == {"role": "assistant", "content": lines[0]}
    assert turn2["model"] == GEN_MODEL and turn2["stream"] is True


def test_chat_system_message_and_params(server: LiveServer) -> None:
    out = io.StringIO()
    args = _args(server, "--system", "be kind", "--max-tokens", "7", "--temperature", "0.5")
    chat_cli.run(args, stdin=io.StringIO("hi\n"), stdout=out)  # end of input ends the chat
    assert out.getvalue() == "You said: hi (turn 1, replies 0, system yes)\n"
    body = server.app.state.bodies[-1][1]
    assert body["messages"][0] == {"role": "system", "content": "be kind"}
    assert body["max_tokens"] == 7 and body["temperature"] == 0.5


def test_chat_reports_server_errors_and_goes_on(server: LiveServer, capsys: pytest.CaptureFixture) -> None:
    server.force("/v1/chat/completions", (400, {}, "prompt is too long: 9000 tokens > 8192"))
    out = io.StringIO()
    assert chat_cli.run(_args(server, "--model", GEN_MODEL), stdin=io.StringIO("first\nsecond\n"), stdout=out) == 0
    assert "prompt is too long: 9000 tokens > 8192" in capsys.readouterr().err
    # the failed turn is not part of the history
    assert out.getvalue() == "You said: second (turn 1, replies 0, system no)\n"


def test_kvserve_chat_command_with_piped_stdin(server: LiveServer) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "server", "chat", "--base-url", server.base_url],
        check=False,
        input="ping\npong\n/exit\n",
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "You said: ping (turn 1, replies 0, system no)",
        "You said: pong (turn 2, replies 1, system no)",
    ]
