"""`kvserve serve` connection limits, over raw sockets against a real server process: an oversized request
head (--max-request-head-bytes, however it is split into reads), too many requests in progress
(--limit-concurrency) while idle connections hold none, too many connections from one client
(--max-connections-per-client), an idle keep-alive connection (--timeout-keep-alive), a request head that
never completes (--timeout-request-head), a body that does not arrive in time (--timeout-request-body).
After each the server keeps serving. The pure parts of server/http/h11_protocol.py are tested alone at the end."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from server.http.h11_protocol import HeadMeter, LogThrottle, PeerConnections
from server.http.request_cap import cap_requests_in_progress
from tests.support.server_harness import ServerProcess, parse_sse
from tests.support.tiny_models import make_tiny_llama

pytestmark = pytest.mark.slow

KEEP_ALIVE_S = 1.0
LIMIT = 4
HEAD_LIMIT = 4096
# Longer than KEEP_ALIVE_S, so an idle kept-alive connection still meets the keep-alive timeout first.
HEAD_TIMEOUT_S = 2.0
# Longer than HEAD_TIMEOUT_S plus a margin, so a body sent after the head timeout still arrives in time.
BODY_TIMEOUT_S = 4.0
# Above the most sockets any one test holds besides the ones it counts.
PER_CLIENT = 24
# Every engine step sleeps this long (tests/support/slow_serve.py), so a stream's length in time is known.
STEP_DELAY_S = 0.05
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
            "--timeout-request-body",
            str(BODY_TIMEOUT_S),
            "--max-connections-per-client",
            str(PER_CLIENT),
            "--log-level",
            "warning",
        ],
        tmp_path_factory.mktemp("logs") / "server.log",
        # KVSERVE_TIMEOUT_KEEP_ALIVE: the variable, as a deployment would set it.
        env={"KVSERVE_TIMEOUT_KEEP_ALIVE": str(KEEP_ALIVE_S), "SLOW_SERVE_STEP_DELAY": str(STEP_DELAY_S)},
        program=("-m", "tests.support.slow_serve"),
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


def _content_length(head: bytes) -> int:
    return next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))


def _read_response(sock: socket.socket) -> bytes:
    """One complete response whose body is sized by Content-Length."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = _content_length(head)
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


def _head_of(length: int, path: bytes = b"/health") -> bytes:
    """A complete GET head of exactly `length` bytes, blank line included."""
    start = b"GET " + path + b" HTTP/1.1\r\nHost: x\r\nX-Pad: "
    head = start + b"a" * (length - len(start) - 4) + b"\r\n\r\n"
    assert len(head) == length
    return head


@pytest.mark.parametrize("length", [int(HEAD_LIMIT * 1.1), 2 * HEAD_LIMIT, HEAD_LIMIT + 1])
def test_a_complete_head_over_the_limit_sent_at_once_gets_400(server: ServerProcess, length: int) -> None:
    sock = _connect(server)
    try:
        sock.sendall(_head_of(length))  # one write: the server may read it whole, in one piece
        answer = _read_until_closed(sock)
    finally:
        sock.close()
    assert answer.startswith(b"HTTP/1.1 400"), answer[:200]


def test_a_head_of_exactly_the_limit_is_served(server: ServerProcess) -> None:
    sock = _connect(server)
    try:
        sock.sendall(_head_of(HEAD_LIMIT))
        assert _read_response(sock).startswith(b"HTTP/1.1 200")
    finally:
        sock.close()


def test_a_pipelined_head_over_the_limit_gets_400_after_the_answer_to_the_one_before(
    server: ServerProcess,
) -> None:
    sock = _connect(server)
    try:
        # Both heads in one write: the second is buffered while the first is answered.
        sock.sendall(_head_of(HEAD_LIMIT // 2) + _head_of(HEAD_LIMIT + 1))
        answer = _read_until_closed(sock)
    finally:
        sock.close()
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    first_head, _, rest = answer.partition(b"\r\n\r\n")
    assert rest[_content_length(first_head) :].startswith(b"HTTP/1.1 400"), rest[:200]


def test_a_kept_alive_head_over_the_limit_gets_400(server: ServerProcess) -> None:
    sock = _connect(server)
    try:
        sock.sendall(_head_of(HEAD_LIMIT))
        assert _read_response(sock).startswith(b"HTTP/1.1 200")
        sock.sendall(_head_of(HEAD_LIMIT + 100))
        assert _read_until_closed(sock).startswith(b"HTTP/1.1 400")
    finally:
        sock.close()


def _completion_head(body_length: int) -> bytes:
    return (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(body_length).encode() + b"\r\n\r\n"
    )


def _status(server: ServerProcess, path: str) -> int:
    return httpx.get(f"{server.base_url}{path}", timeout=10).status_code


def test_requests_past_the_limit_of_requests_in_progress_get_503_but_health_does_not(
    server: ServerProcess,
) -> None:
    # LIMIT requests in progress: each head is in, its body never finishes.
    held = [_connect(server) for _ in range(LIMIT)]
    try:
        for sock in held:
            sock.sendall(_completion_head(100) + b"{")
        deadline = time.monotonic() + 3
        while _status(server, "/v1/models") != 503:  # until the server has taken all LIMIT heads
            assert time.monotonic() < deadline, "LIMIT requests in progress must make the next one 503"
            time.sleep(0.05)
        extra = _connect(server)
        try:
            extra.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
            assert _read_response(extra).startswith(b"HTTP/1.1 503")  # uvicorn's plain-text 503
        finally:
            extra.close()
        assert _status(server, "/health") == 200, "/health is never refused by the cap"
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 10
    while _status(server, "/v1/models") == 503:  # the held requests end with their connections
        assert time.monotonic() < deadline, "still 503 after the held requests ended"
        time.sleep(0.1)
    _still_serves(server)


def test_idle_connections_past_the_limit_hold_no_request_slot(server: ServerProcess) -> None:
    idle = [_connect(server) for _ in range(LIMIT + 8)]
    try:
        time.sleep(0.3)  # the server has accepted them
        for _ in range(3):  # within HEAD_TIMEOUT_S, while they are all open
            assert _status(server, "/health") == 200
            assert _status(server, "/v1/models") == 200
    finally:
        for sock in idle:
            sock.close()


def _closed_at_once(sock: socket.socket) -> bool:
    """Whether the server closes `sock` well before the head timeout would."""
    sock.settimeout(HEAD_TIMEOUT_S * 0.5)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_connections_past_the_per_client_cap_are_closed_at_once_and_logged_once(server: ServerProcess) -> None:
    time.sleep(0.3)  # the connections of earlier tests are gone on the server's side too
    held = [_connect(server) for _ in range(PER_CLIENT)]
    try:
        time.sleep(0.3)
        refused = [_connect(server) for _ in range(3)]
        try:
            assert all(_closed_at_once(sock) for sock in refused)
        finally:
            for sock in refused:
                sock.close()
        held[-1].sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")  # the ones under the cap serve
        assert _read_response(held[-1]).startswith(b"HTTP/1.1 200")
    finally:
        for sock in held:
            sock.close()
    log_lines = [line for line in server.log().splitlines() if "--max-connections-per-client" in line]
    assert len(log_lines) == 1, log_lines  # one line for the three, not one per connection
    assert f"127.0.0.1 holds {PER_CLIENT} connections" in log_lines[0]
    time.sleep(0.3)
    _still_serves(server)


def test_a_body_trickled_past_its_deadline_gets_408_and_its_connection_closed(server: ServerProcess) -> None:
    sock = _connect(server)
    sock.settimeout(0.25)
    answer = b""
    try:
        sock.sendall(_completion_head(1000))
        head_sent = time.monotonic()
        while time.monotonic() - head_sent < BODY_TIMEOUT_S + CLOSE_WAIT_S:
            try:
                sock.sendall(b" ")  # a byte every quarter second: 1,000 would take 250 s
            except (BrokenPipeError, ConnectionResetError):
                break
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                continue
            except ConnectionResetError:
                break
            if not chunk:
                break
            answer += chunk
        waited_s = time.monotonic() - head_sent
    finally:
        sock.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert BODY_TIMEOUT_S * 0.9 <= waited_s <= BODY_TIMEOUT_S + 5, waited_s
    _still_serves(server)


def test_a_stream_longer_than_the_body_deadline_is_not_cut(server: ServerProcess) -> None:
    tokens = math.ceil(BODY_TIMEOUT_S / STEP_DELAY_S) + 5  # each token takes at least one step
    body = {"model": "tiny-llama", "prompt": "Hi", "max_tokens": tokens, "ignore_eos": True, "stream": True}
    start = time.monotonic()
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
    took_s = time.monotonic() - start
    assert response.status_code == 200, response.text
    events = parse_sse(response.text)
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "length", events[-2]  # ran to max_tokens, not cut
    assert took_s > BODY_TIMEOUT_S, took_s


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
        # Past the head timeout (the head is in, so it must not apply), within the body deadline.
        time.sleep(HEAD_TIMEOUT_S + 0.5)
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
    # Idle connections no longer count, so 1 means one request at a time.
    assert cli.config_from_args(parser.parse_args(["--limit-concurrency", "1"])).limit_concurrency == 1
    with pytest.raises(ValueError, match="limit_concurrency"):
        cli.config_from_args(parser.parse_args(["--limit-concurrency", "0"]))
    with pytest.raises(ValueError, match="timeout_keep_alive"):
        cli.config_from_args(parser.parse_args(["--timeout-keep-alive", "0"]))
    assert defaults.timeout_request_head == 10.0
    assert cli.config_from_args(parser.parse_args(["--timeout-request-head", "2.5"])).timeout_request_head == 2.5
    with pytest.raises(ValueError, match="timeout_request_head"):
        cli.config_from_args(parser.parse_args(["--timeout-request-head", "0"]))
    assert (defaults.timeout_request_body, defaults.max_connections_per_client) == (60.0, 512)
    config = cli.config_from_args(
        parser.parse_args(["--timeout-request-body", "7.5", "--max-connections-per-client", "none"])
    )
    assert (config.timeout_request_body, config.max_connections_per_client) == (7.5, None)
    for flags, field in (
        (["--timeout-request-body", "0"], "timeout_request_body"),
        (["--timeout-request-body", "nan"], "timeout_request_body"),
        (["--max-connections-per-client", "0"], "max_connections_per_client"),
    ):
        with pytest.raises(ValueError, match=field):
            cli.config_from_args(parser.parse_args(flags))


# ---- the pure parts of server/http/h11_protocol.py ----


def _head_length(chunks: list[bytes], limit: int = 1024) -> tuple[int | None, bool]:
    meter = HeadMeter(limit)
    for chunk in chunks:
        meter.feed(chunk)
    return meter.length, meter.over_limit


def test_the_head_meter_finds_the_end_of_a_head_however_it_is_split() -> None:
    head = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
    stream = head + b"GET /next HTTP/1.1\r\n"  # a pipelined head behind it is not counted
    for cut in range(len(stream) + 1):
        assert _head_length([stream[:cut], stream[cut:]]) == (len(head), False), cut
    assert _head_length([bytes([byte]) for byte in stream]) == (len(head), False)
    assert _head_length([b"GET / HTTP/1.1\nHost: x\n\nrest"]) == (len(b"GET / HTTP/1.1\nHost: x\n\n"), False)


def test_the_head_meter_is_exact_at_the_limit_and_knows_early() -> None:
    def head_of(length: int) -> bytes:
        start = b"GET / HTTP/1.1\r\nX-Pad: "
        return start + b"a" * (length - len(start) - 4) + b"\r\n\r\n"

    assert _head_length([head_of(1024)]) == (1024, False)
    assert _head_length([head_of(1025)]) == (1025, True)
    assert _head_length([head_of(1024)[:1023]]) == (None, False)  # may still end in time
    assert _head_length([head_of(2048)[:1024]]) == (None, True)  # 1,024 bytes and no end: over already
    meter = HeadMeter(1024)
    meter.start(head_of(4096) + head_of(100))  # a new cycle's buffered bytes count from their start
    assert (meter.length, meter.over_limit) == (4096, True)
    meter.start(head_of(100) + head_of(4096))
    assert (meter.length, meter.over_limit) == (100, False)


def test_the_log_throttle_writes_one_line_per_key_and_interval_with_the_count() -> None:
    now = [0.0]
    throttle = LogThrottle(10.0, clock=lambda: now[0])
    assert throttle.tick("a") == 1
    assert [throttle.tick("a") for _ in range(3)] == [None, None, None]
    assert throttle.tick("b") == 1  # each key on its own
    now[0] = 10.0
    assert throttle.tick("a") == 4  # the three held back and this one


def test_peer_connections_are_capped_per_address() -> None:
    peers = PeerConnections(2)
    assert [peers.admit("10.0.0.1") for _ in range(3)] == [True, True, False]
    assert peers.admit("10.0.0.2") and peers.open_from("10.0.0.1") == 2
    peers.release("10.0.0.1")
    assert peers.admit("10.0.0.1")
    assert all(PeerConnections(None).admit("10.0.0.1") for _ in range(1000))


def test_the_request_cap_counts_requests_in_progress_and_never_refuses_health() -> None:
    async def scenario() -> list[int]:
        release = asyncio.Event()

        async def app(scope, receive, send) -> None:
            if scope["path"] == "/slow":
                await release.wait()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b""})

        capped = cap_requests_in_progress(app, 2)

        async def status(path: str) -> int:
            sent: list[dict] = []

            async def send(message: dict) -> None:
                sent.append(message)

            async def receive() -> dict:
                return {"type": "http.request", "body": b"", "more_body": False}

            await capped({"type": "http", "path": path, "method": "GET", "headers": []}, receive, send)
            return sent[0]["status"]

        slow = [asyncio.create_task(status("/slow")) for _ in range(2)]
        await asyncio.sleep(0)
        during = [await status("/v1/models"), await status("/health")]
        release.set()
        return [*during, *await asyncio.gather(*slow), await status("/v1/models")]

    assert asyncio.run(scenario()) == [503, 200, 200, 200, 200]

    async def bare(scope, receive, send) -> None: ...

    assert cap_requests_in_progress(bare, None) is bare  # no cap: the app itself
