"""`kvserve serve` connection limits, over raw sockets against a real server process: an oversized request
head (--max-request-head-bytes), too many open connections (--limit-concurrency), an idle keep-alive
connection (--timeout-keep-alive), a request head that never completes (--timeout-request-head). After
each the server keeps serving."""

from __future__ import annotations

import argparse
import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.support.server_harness import ServerProcess
from tests.support.tiny_models import make_tiny_llama

KEEP_ALIVE_S = 1.0
LIMIT = 4
HEAD_LIMIT = 4096
# Longer than KEEP_ALIVE_S, so an idle kept-alive connection still meets the keep-alive timeout first.
HEAD_TIMEOUT_S = 2.0
# How long a test waits for the server to close a connection: generous, for a loaded machine.
CLOSE_WAIT_S = 30.0


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[ServerProcess]:
    model_dir = make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    proc = ServerProcess(
        [
            "--model",
            str(model_dir),
            "--served-model-name",
            "tiny-llama",
            "--embedding-model",
            "none",
            "--max-model-len",
            "256",
            "--kv-cache-memory",
            "16MiB",
            "--limit-concurrency",
            str(LIMIT),
            "--max-request-head-bytes",
            "4KiB",
            "--timeout-request-head",
            str(HEAD_TIMEOUT_S),
            "--log-level",
            "warning",
        ],
        tmp_path_factory.mktemp("logs") / "server.log",
        env={"KVSERVE_TIMEOUT_KEEP_ALIVE": str(KEEP_ALIVE_S)},  # the variable, as a deployment would set it
    )
    try:
        proc.wait_ready(timeout=180)
        yield proc
    finally:
        proc.kill()


def _connect(server: ServerProcess) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.settimeout(10)
    return sock


def _read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _read_response(sock: socket.socket) -> bytes:
    """One complete response whose body is sized by Content-Length."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
    )
    while len(body) < length:
        body += sock.recv(65536)
    return head


def _still_serves(server: ServerProcess) -> None:
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
    body = {"model": "tiny-llama", "prompt": "Hi", "max_tokens": 3, "ignore_eos": True}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3


def _assert_cut_by_the_head_timeout(server: ServerProcess, answer: bytes, waited_s: float) -> None:
    assert _is_408_or_nothing(answer), answer[:200]
    assert waited_s >= HEAD_TIMEOUT_S * 0.5, waited_s  # the head timeout closed it, not something sooner
    _still_serves(server)


def test_a_request_head_over_the_limit_gets_400_and_its_connection_closed(server: ServerProcess) -> None:
    sock = _connect(server)
    try:
        # A head that never ends: one header growing past the limit, its blank line never sent.
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * (2 * HEAD_LIMIT))
        answer = _read_until_closed(sock)
    finally:
        sock.close()
    assert answer.startswith(b"HTTP/1.1 400"), answer[:200]
    _still_serves(server)


def test_a_head_under_the_limit_is_served(server: ServerProcess) -> None:
    response = httpx.get(f"{server.base_url}/health", headers={"X-Pad": "a" * (HEAD_LIMIT // 2)}, timeout=10)
    assert response.status_code == 200


def test_requests_past_the_connection_limit_get_503(server: ServerProcess) -> None:
    # uvicorn counts the asking connection too: with LIMIT - 1 others open, a request gets 503.
    held = [_connect(server) for _ in range(LIMIT - 1)]
    try:
        time.sleep(0.3)  # the server has accepted them
        extra = _connect(server)
        try:
            extra.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert _read_response(extra).startswith(b"HTTP/1.1 503"), "a request past the limit must get 503"
        finally:
            extra.close()
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 10
    while httpx.get(f"{server.base_url}/health", timeout=10).status_code == 503:  # the held ones close
        assert time.monotonic() < deadline, "still 503 after the held connections closed"
        time.sleep(0.1)
    _still_serves(server)


def test_an_idle_keep_alive_connection_is_closed_after_the_timeout(server: ServerProcess) -> None:
    sock = _connect(server)
    try:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _read_response(sock).startswith(b"HTTP/1.1 200")
        idle_from = time.monotonic()
        assert _read_until_closed(sock) == b"", "an idle connection gets nothing more"
        idle_s = time.monotonic() - idle_from
    finally:
        sock.close()
    assert KEEP_ALIVE_S * 0.5 <= idle_s <= KEEP_ALIVE_S + 3, idle_s
    _still_serves(server)


def _closed_by_server(sock: socket.socket) -> tuple[bytes, float]:
    """What the server sends until it closes the connection, and the seconds that took."""
    sock.settimeout(CLOSE_WAIT_S)
    start = time.monotonic()
    try:
        answer = _read_until_closed(sock)
    except TimeoutError:
        pytest.fail(f"the server kept the connection open for {CLOSE_WAIT_S} s")
    return answer, time.monotonic() - start


def _is_408_or_nothing(answer: bytes) -> bool:
    return answer == b"" or answer.startswith(b"HTTP/1.1 408")


def test_a_request_head_that_never_completes_is_closed(server: ServerProcess) -> None:
    sock = _connect(server)
    try:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Half: ")  # and never the rest
        answer, waited_s = _closed_by_server(sock)
    finally:
        sock.close()
    _assert_cut_by_the_head_timeout(server, answer, waited_s)


def test_a_connection_that_sends_nothing_is_closed(server: ServerProcess) -> None:
    sock = _connect(server)
    try:
        answer, waited_s = _closed_by_server(sock)
    finally:
        sock.close()
    _assert_cut_by_the_head_timeout(server, answer, waited_s)


def test_a_slow_body_after_a_timely_head_is_served(server: ServerProcess) -> None:
    body = json.dumps({"model": "tiny-llama", "prompt": "Hi", "max_tokens": 3, "ignore_eos": True}).encode()
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n"
    )
    sock = _connect(server)
    try:
        sock.sendall(head + body[:5])
        time.sleep(HEAD_TIMEOUT_S + 1.0)  # past the head timeout: the head is in, so it must not apply
        sock.sendall(body[5:])
        sock.settimeout(CLOSE_WAIT_S)
        assert _read_response(sock).startswith(b"HTTP/1.1 200")
    finally:
        sock.close()


def test_a_kept_alive_connection_that_begins_a_head_and_stalls_is_closed(server: ServerProcess) -> None:
    sock = _connect(server)
    try:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _read_response(sock).startswith(b"HTTP/1.1 200")
        # At once, before the keep-alive timeout: its first byte stops that timer, not this one.
        sock.sendall(b"GET /health HTTP/1.1\r\nHo")
        answer, waited_s = _closed_by_server(sock)
    finally:
        sock.close()
    _assert_cut_by_the_head_timeout(server, answer, waited_s)


def test_the_request_head_timeout_must_be_positive() -> None:
    from server.config import ServerConfig

    assert ServerConfig().timeout_request_head == 10.0
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="timeout_request_head"):
            ServerConfig(timeout_request_head=bad)


def test_the_flags_default_to_limits_that_fit_the_rest_of_the_server() -> None:
    from server import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    defaults = cli.config_from_args(parser.parse_args([]))
    assert (defaults.timeout_keep_alive, defaults.limit_concurrency) == (5.0, 1024)
    assert defaults.max_request_head_bytes == 64 * 1024
    config = cli.config_from_args(
        parser.parse_args(["--limit-concurrency", "none", "--max-request-head-bytes", "8KiB"])
    )
    assert (config.limit_concurrency, config.max_request_head_bytes) == (None, 8192)
    with pytest.raises(ValueError, match="limit_concurrency"):
        cli.config_from_args(parser.parse_args(["--limit-concurrency", "1"]))
    with pytest.raises(ValueError, match="timeout_keep_alive"):
        cli.config_from_args(parser.parse_args(["--timeout-keep-alive", "0"]))
    assert defaults.timeout_request_head == 10.0
    assert cli.config_from_args(parser.parse_args(["--timeout-request-head", "2.5"])).timeout_request_head == 2.5
    with pytest.raises(ValueError, match="timeout_request_head"):
        cli.config_from_args(parser.parse_args(["--timeout-request-head", "0"]))
