"""`python -m server.healthcheck`: exit 0 when the kvserve server on this machine answers /health with 200.

The container's HEALTHCHECK runs it. It finds the address the server listens on from the server's own
command line (`kvserve serve --port 18466` or `--port=18466`, the same for `--host`), else from
KVSERVE_PORT / KVSERVE_HOST, else 8000, so a port given on the command line keeps the container healthy.
Standard library only: it runs every few seconds and must start fast.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

DEFAULT_PORT = 8000
TIMEOUT_S = 4.0
# A server bound to every interface is reached on loopback.
_ANY_ADDRESS = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}


@dataclass(frozen=True)
class Address:
    host: str
    port: int

    @property
    def health_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/health"


def is_serve_command(argv: Sequence[str]) -> bool:
    """`... kvserve serve ...` or `python -m server serve` / `python -m server.cli`."""
    for i, arg in enumerate(argv):
        nxt = argv[i + 1] if i + 1 < len(argv) else ""
        if Path(arg).name == "kvserve" and nxt == "serve":
            return True
        if arg == "-m" and (nxt == "server.cli" or (nxt == "server" and "serve" in argv[i + 2 :])):
            return True
    return False


def _flag_value(argv: Sequence[str], flag: str) -> str | None:
    """The last value given for `flag` (argparse keeps the last), as `--flag V` or `--flag=V`."""
    value = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1 :]
    return value


def address_from(argv: Sequence[str], environ: dict[str, str]) -> Address:
    """Where a server started with `argv` in `environ` listens, as reached from this machine."""
    port_text = _flag_value(argv, "--port") or environ.get("KVSERVE_PORT") or str(DEFAULT_PORT)
    host = _flag_value(argv, "--host") or environ.get("KVSERVE_HOST") or ""
    return Address(_ANY_ADDRESS.get(host, host), int(port_text))


def _process_commands(proc: Path = Path("/proc")) -> list[list[str]]:
    """Every process's argv we may read, lowest pid first (the container's server is pid 1)."""
    commands = []
    for entry in sorted((p for p in proc.iterdir() if p.name.isdigit()), key=lambda p: int(p.name)):
        try:
            raw = (entry / "cmdline").read_bytes()
        except OSError:  # gone, or not ours
            continue
        if raw:
            commands.append([part.decode(errors="replace") for part in raw.rstrip(b"\0").split(b"\0")])
    return commands


def find_address(commands: Sequence[Sequence[str]], environ: dict[str, str]) -> Address:
    """The first kvserve server among `commands`; with none, the environment's defaults."""
    for argv in commands:
        if is_serve_command(argv):
            return address_from(argv, environ)
    return address_from([], environ)


def check(address: Address, timeout: float = TIMEOUT_S) -> tuple[bool, str]:
    """(healthy, what was seen)."""
    try:
        with urllib.request.urlopen(address.health_url, timeout=timeout) as response:
            return response.status == 200, f"{address.health_url}: {response.status}"
    except urllib.error.HTTPError as exc:  # 503 while loading or draining
        return False, f"{address.health_url}: {exc.code}"
    except (OSError, ValueError) as exc:
        return False, f"{address.health_url}: {exc}"


def main() -> int:
    address = find_address(_process_commands(), dict(os.environ))
    healthy, seen = check(address)
    print(seen)
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
