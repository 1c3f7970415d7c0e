"""server/healthcheck.py: which address the container's HEALTHCHECK probes, and that it sees real processes."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from server import healthcheck
from server.healthcheck import Address, address_from, find_address, is_serve_command

SERVE = ["/opt/kvserve/.venv/bin/python", "/opt/kvserve/.venv/bin/kvserve", "serve"]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (SERVE, True),
        (["kvserve", "serve", "--port", "9"], True),
        (["python", "-m", "server", "serve"], True),
        (["python", "-m", "server", "--log-level", "debug", "serve"], True),
        (["python", "-m", "server.cli", "--port", "9"], True),
        (["kvserve", "chat", "--port", "9"], False),
        (["python", "-m", "server", "pull"], False),
        (["python", "-m", "server.healthcheck"], False),
        (["sleep", "serve"], False),
    ],
)
def test_is_serve_command(argv: list[str], expected: bool) -> None:
    assert is_serve_command(argv) is expected


@pytest.mark.parametrize(
    ("argv", "environ", "expected"),
    [
        (SERVE, {}, Address("127.0.0.1", 8000)),
        (SERVE, {"KVSERVE_PORT": "9001"}, Address("127.0.0.1", 9001)),
        ([*SERVE, "--port", "18466"], {"KVSERVE_PORT": "9001"}, Address("127.0.0.1", 18466)),
        ([*SERVE, "--port=18466"], {}, Address("127.0.0.1", 18466)),
        ([*SERVE, "--port", "1", "--port", "2"], {}, Address("127.0.0.1", 2)),  # argparse keeps the last
        ([*SERVE, "--host", "::"], {}, Address("::1", 8000)),
        ([*SERVE, "--host", "10.1.2.3"], {"KVSERVE_HOST": "0.0.0.0"}, Address("10.1.2.3", 8000)),
        (SERVE, {"KVSERVE_HOST": "0.0.0.0"}, Address("127.0.0.1", 8000)),
    ],
)
def test_address_from_the_command_line_then_the_environment(
    argv: list[str], environ: dict[str, str], expected: Address
) -> None:
    assert address_from(argv, environ) == expected


def test_health_url_brackets_ipv6() -> None:
    assert Address("::1", 8000).health_url == "http://[::1]:8000/health"
    assert Address("127.0.0.1", 8000).health_url == "http://127.0.0.1:8000/health"


def test_find_address_takes_the_first_server_and_falls_back_to_the_environment() -> None:
    commands = [["/sbin/tini", "--"], [*SERVE, "--port", "7001"], [*SERVE, "--port", "7002"]]
    assert find_address(commands, {}) == Address("127.0.0.1", 7001)
    assert find_address([["bash"]], {"KVSERVE_PORT": "7003"}) == Address("127.0.0.1", 7003)


def test_process_commands_sees_a_running_server_command_line() -> None:
    marker = "--port=48123"
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "kvserve", "serve", marker])
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            matching = [argv for argv in healthcheck._process_commands() if marker in argv]
            if matching:
                break
            time.sleep(0.05)
        assert matching and is_serve_command(matching[0])
        assert address_from(matching[0], {}).port == 48123
    finally:
        proc.kill()
        proc.wait()
