"""Start a real kvserve server (uvicorn on a free port) for tests: in a thread or in a subprocess."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from clients.sse import iter_sse_events

if TYPE_CHECKING:
    from typing import Self

REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_health(base_url: str, timeout: float = 60.0, process: subprocess.Popen | None = None) -> list[int]:
    """Poll /health until 200; returns every status seen (connection refused is not a status)."""
    seen: list[int] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"server exited early with status {process.returncode}")
        try:
            status = httpx.get(f"{base_url}/health", timeout=2.0).status_code
        except httpx.TransportError:
            time.sleep(0.02)
            continue
        if not seen or seen[-1] != status:
            seen.append(status)
        if status == 200:
            return seen
        time.sleep(0.02)
    raise TimeoutError(f"{base_url}/health not 200 within {timeout}s (saw {seen})")


class ServerThread:
    """uvicorn serving `app` in a background thread of this process (its own event loop)."""

    def __init__(self, app, shutdown_timeout: float = 5.0) -> None:
        import uvicorn

        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            access_log=False,
            lifespan="on",
            loop="asyncio",  # as `kvserve serve` runs it (server/cli/runner.py says why)
            timeout_graceful_shutdown=shutdown_timeout,
        )
        self.server = uvicorn.Server(config)
        self.app = app
        self._thread = threading.Thread(target=self.server.run, name=f"uvicorn-{self.port}", daemon=True)

    def start(self, wait_ready: bool = True, timeout: float = 120.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError("uvicorn thread exited during start-up")
            if time.monotonic() > deadline:
                raise TimeoutError("uvicorn did not start")
            time.sleep(0.01)
        if wait_ready:
            wait_for_health(self.base_url, timeout)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ServerProcess:
    """`python -m server.cli ARGS` in a subprocess, on a free port; stderr goes to a log file.

    program: what python runs instead of `-m server.cli` (a script that patches something first).
    """

    def __init__(
        self,
        args: list[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        program: tuple[str, ...] = ("-m", "server.cli"),
    ) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        full_env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), **(env or {})}
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in wait()/kill()
        self.process = subprocess.Popen(
            [sys.executable, *program, "--host", "127.0.0.1", "--port", str(self.port), *args],
            cwd=REPO_ROOT,
            env=full_env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def wait_ready(self, timeout: float = 120.0) -> list[int]:
        return wait_for_health(self.base_url, timeout, self.process)

    def terminate(self, sig: int = signal.SIGTERM) -> None:
        self.process.send_signal(sig)

    def wait(self, timeout: float = 60.0) -> int:
        try:
            return self.process.wait(timeout)
        finally:
            self._log.close()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        self._log.close()


def parse_named_sse(body: str) -> list[dict]:
    """The events of a stream that names each one (Responses, Messages), with strict framing:
    `event: <type>` then `data: <json>` of that type, a blank line after each, and no [DONE]."""
    import json

    assert body.endswith("\n\n"), body[-80:]
    events = []
    for block in body[:-2].split("\n\n"):
        lines = block.split("\n")
        assert len(lines) == 2 and lines[0].startswith("event: ") and lines[1].startswith("data: "), block
        event = json.loads(lines[1].removeprefix("data: "))
        assert event["type"] == lines[0].removeprefix("event: "), block
        events.append(event)
    return events


def parse_sse(body: str) -> list[dict | str]:
    """Split an SSE body into its `data:` payloads (dicts, or the final "[DONE]"); asserts strict framing."""
    import json

    assert body.endswith("\n\n"), f"SSE body must end with a blank line: {body[-80:]!r}"
    for event in body[:-2].split("\n\n"):
        assert event.startswith("data: ") and "\n" not in event, f"bad SSE event {event!r}"
    payloads: list[dict | str] = [
        data if data == "[DONE]" else json.loads(data) for data in iter_sse_events(body.split("\n"))
    ]
    assert payloads and payloads[-1] == "[DONE]", "the last SSE event must be [DONE]"
    assert "[DONE]" not in payloads[:-1], "[DONE] must come last, once"
    return payloads


def make_server_config(model_dir, *, embedding_model=None, **overrides):
    """A ServerConfig for a tiny test model: small limits, no embeddings unless `embedding_model` names one.

    overrides: EngineConfig fields (max_num_seqs=1) go to the generation engine, the rest to ServerConfig;
    api_key="k" stands for api_keys=("k",).
    """
    import dataclasses

    from engine.config import EmbedderConfig, EngineConfig
    from server.config import ServerConfig

    if "api_key" in overrides:
        overrides["api_keys"] = (*overrides.pop("api_key").split(","), *overrides.get("api_keys", ()))
    engine_fields = {f.name for f in dataclasses.fields(EngineConfig)}
    engine_values = {
        "model": str(model_dir),
        "max_model_len": 256,
        "kv_cache_memory_bytes": 16 << 20,
        "max_num_seqs": 16,
    }
    engine_values.update({k: v for k, v in overrides.items() if k in engine_fields})
    server_values = {"served_model_name": "tiny-llama", "log_level": "warning"}
    server_values.update({k: v for k, v in overrides.items() if k not in engine_fields})
    embedder = EmbedderConfig(model=embedding_model) if embedding_model else None
    return ServerConfig(engine=EngineConfig(**engine_values), embedder=embedder, **server_values)


def send_and_hang_up(base_url: str, path: str, body: dict, linger: float) -> None:
    """POST `body` to `path` on a raw socket, read nothing, hang up `linger` seconds later."""
    host, port = base_url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    ).encode()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(head + payload)
        time.sleep(linger)


@contextlib.contextmanager
def smollm2_server(
    max_model_len: int, kv_cache: str, kv_cache_dtype: str = "auto", prefix_caching: bool = True
) -> Iterator[ServerThread]:
    """The real default generation model (int8, as `kvserve serve` loads it, no embedder) served in a
    thread; skips the test when the model is not in the local cache. kv_cache_dtype: --kv-cache-dtype;
    prefix_caching: --enable-prefix-caching."""
    import pytest

    from engine.config import EngineConfig
    from engine.hub import models_hub
    from server.app import create_app
    from server.config import ServerConfig, parse_bytes

    if not models_hub.is_cached(models_hub.DEFAULT_GENERATION_MODEL):
        pytest.skip(f"{models_hub.DEFAULT_GENERATION_MODEL} is not in the local cache (kvserve pull)")
    engine = EngineConfig(
        model=models_hub.DEFAULT_GENERATION_MODEL,
        quantization="auto",
        max_model_len=max_model_len,
        kv_cache_memory_bytes=parse_bytes(kv_cache),
        kv_cache_dtype=kv_cache_dtype,
        enable_prefix_caching=prefix_caching,
    )
    srv = ServerThread(create_app(ServerConfig(engine=engine, embedder=None, log_level="warning")))
    try:
        srv.start(timeout=300)  # ~15 s alone; slower on a busy machine
        yield srv
    finally:
        srv.stop()
