"""A stop is clean: SIGTERM drains, then cuts what is left with a proper ending, then exits 0.

Each test runs `kvserve serve` in a subprocess (tests/support/slow_serve.py: engine steps or the
model load slowed down, so a request's length in time does not depend on the machine).
"""

from __future__ import annotations

import contextlib
import re
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.support.server_harness import ServerProcess, parse_sse
from tests.support.slow_serve import APP_DELAY_MARKER
from tests.support.tiny_models import make_tiny_llama

pytestmark = pytest.mark.slow

SLOW_SERVE = ("-m", "tests.support.slow_serve")
STREAM = {"prompt": "Hello", "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@contextlib.contextmanager
def _server(
    model_dir, tmp_path, *, grace: float, ready=True, step_delay=0.0, load_delay=0.0, app_delay=0.0
) -> Iterator[ServerProcess]:
    """The server in a subprocess (slowed as asked), ready to serve unless `ready` is false; killed after."""
    args = ["--model", str(model_dir), "--embedding-model", "none", "--max-model-len", "256"]
    args += ["--kv-cache-memory", "16MiB", "--shutdown-timeout", str(grace), "--log-level", "info"]
    env = {
        "SLOW_SERVE_STEP_DELAY": str(step_delay),
        "SLOW_SERVE_LOAD_DELAY": str(load_delay),
        "SLOW_SERVE_APP_DELAY": str(app_delay),
    }
    proc = ServerProcess(args, tmp_path / "server.log", env=env, program=SLOW_SERVE)
    try:
        if ready:
            proc.wait_ready(timeout=180)
        yield proc
    finally:
        proc.kill()


def _wait_for_health(proc: ServerProcess, status: int, timeout: float = 180.0) -> httpx.Response:
    """The first /health answer with `status` (connection refused: not an answer yet)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.process.poll() is None, f"server exited early:\n{proc.log()}"
        try:
            response = httpx.get(f"{proc.base_url}/health", timeout=2.0)
        except httpx.TransportError:
            response = None
        if response is not None and response.status_code == status:
            return response
        time.sleep(0.02)
    raise TimeoutError(f"/health never answered {status}")


def _num_running(proc: ServerProcess) -> float:
    text = httpx.get(f"{proc.base_url}/metrics", timeout=5).text
    match = re.search(r"^kvserve:num_requests_running\{[^}]*\} (\S+)$", text, re.MULTILINE)
    assert match, text
    return float(match.group(1))


def _assert_clean_log(proc: ServerProcess) -> None:
    log = proc.log()
    assert "Traceback" not in log, log
    assert " ERROR " not in log, log


def _assert_shutting_down(response: httpx.Response) -> None:
    assert response.status_code == 503, response.text
    assert response.headers["retry-after"] == "1"
    assert response.json()["error"]["code"] == "shutting_down"
    assert response.json()["error"]["type"] == "service_unavailable"


def test_draining_refuses_new_requests_while_the_stream_in_flight_finishes(model_dir, tmp_path):
    with _server(model_dir, tmp_path, grace=60, step_delay=0.01) as proc:  # 200 tokens: 2 s at the very least
        url = f"{proc.base_url}/v1/completions"
        with httpx.stream("POST", url, json={**STREAM, "max_tokens": 200}, timeout=60) as response:
            chunks = response.iter_text()
            raw = next(chunks)
            proc.terminate()
            assert _wait_for_health(proc, 503, timeout=5).json() == {"status": "draining"}
            _assert_shutting_down(httpx.post(url, json={"prompt": "Hi", "max_tokens": 2}, timeout=10))
            _assert_shutting_down(httpx.get(f"{proc.base_url}/v1/models", timeout=10))
            assert proc.process.poll() is None
            raw += "".join(chunks)
        stream_ended = time.monotonic()
        events = parse_sse(raw)
        assert events[-3]["choices"][0]["finish_reason"] == "length"
        assert events[-2]["usage"]["completion_tokens"] == 200
        assert proc.wait(timeout=30) == 0
        # It exits once nothing is in flight, not at the end of the 60 s grace.
        assert time.monotonic() - stream_ended < 5
        _assert_clean_log(proc)


def test_requests_outliving_the_grace_end_with_503_shutting_down(model_dir, tmp_path):
    grace = 1.0
    with _server(model_dir, tmp_path, grace=grace, step_delay=0.02) as proc:  # 240 tokens: 4.8 s at the very least
        url = f"{proc.base_url}/v1/completions"
        answered: dict = {}

        def post_json() -> None:
            body = {"prompt": "Hi", "max_tokens": 240, "ignore_eos": True}
            answered["response"] = httpx.post(url, json=body, timeout=60)
            answered["at"] = time.monotonic()

        thread = threading.Thread(target=post_json)
        thread.start()
        deadline = time.monotonic() + 30
        while _num_running(proc) < 1:  # the JSON request is running before the stop begins
            assert time.monotonic() < deadline
            time.sleep(0.02)
        with httpx.stream("POST", url, json={**STREAM, "max_tokens": 240}, timeout=60) as response:
            chunks = response.iter_text()
            raw = next(chunks)
            proc.terminate()
            stopped = time.monotonic()
            raw += "".join(chunks)
        stream_ended = time.monotonic() - stopped
        events = parse_sse(raw)
        assert events[-2]["error"]["code"] == "shutting_down" and events[-2]["error"]["type"] == "service_unavailable"
        assert all(e["choices"][0]["finish_reason"] is None for e in events[:-2] if e.get("choices"))
        assert grace - 0.1 <= stream_ended < grace + 3
        thread.join(timeout=30)
        _assert_shutting_down(answered["response"])
        assert answered["at"] - stopped >= grace - 0.1  # held through the grace, then cut: not refused at the door
        assert proc.wait(timeout=30) == 0
        assert time.monotonic() - stopped < grace + 5
        _assert_clean_log(proc)


def test_a_second_signal_cuts_the_drain_short(model_dir, tmp_path):
    with _server(model_dir, tmp_path, grace=30, step_delay=0.02) as proc:  # 240 tokens: 4.8 s at the very least
        url = f"{proc.base_url}/v1/completions"
        with httpx.stream("POST", url, json={**STREAM, "max_tokens": 240}, timeout=60) as response:
            chunks = response.iter_text()
            raw = next(chunks)
            proc.terminate(signal.SIGTERM)
            _wait_for_health(proc, 503, timeout=5)  # draining
            proc.terminate(signal.SIGINT)
            second = time.monotonic()
            raw += "".join(chunks)
        assert time.monotonic() - second < 2.5
        events = parse_sse(raw)
        assert events[-2]["error"]["code"] == "shutting_down"
        assert proc.wait(timeout=30) == 0
        assert time.monotonic() - second < 5
        _assert_clean_log(proc)


def test_a_stop_while_the_models_load_exits_at_once(model_dir, tmp_path):
    with _server(model_dir, tmp_path, grace=30, load_delay=600, ready=False) as proc:  # a load nothing can interrupt
        assert _wait_for_health(proc, 503).json() == {"status": "loading"}
        proc.terminate()
        stopped = time.monotonic()
        assert proc.wait(timeout=30) == 0
        assert time.monotonic() - stopped < 3
        _assert_clean_log(proc)


def test_a_stop_before_the_server_runs_exits_at_once(model_dir, tmp_path):
    with _server(model_dir, tmp_path, grace=30, app_delay=600, ready=False) as proc:
        deadline = time.monotonic() + 120
        while APP_DELAY_MARKER not in proc.log():
            assert proc.process.poll() is None and time.monotonic() < deadline, proc.log()
            time.sleep(0.05)
        proc.terminate()
        stopped = time.monotonic()
        assert proc.wait(timeout=30) == 0
        assert time.monotonic() - stopped < 3
        _assert_clean_log(proc)


def _catches_sigterm(pid: int) -> bool:
    status = open(f"/proc/{pid}/status").read()
    caught = int(re.search(r"^SigCgt:\s*([0-9a-f]+)$", status, re.MULTILINE).group(1), 16)
    return bool(caught & (1 << (signal.SIGTERM - 1)))


def test_a_stop_during_the_start_up_imports_exits_at_once(model_dir, tmp_path):
    """As pid 1 in a container a process ignores a signal it has no handler for: `kvserve` must have one from
    its first line, not only once the server's seconds of imports are done."""
    args = ["--model", str(model_dir), "--embedding-model", "none", "--max-model-len", "256"]
    proc = ServerProcess(args, tmp_path / "server.log", program=("-m", "server", "serve"))  # the `kvserve` command
    try:
        deadline = time.monotonic() + 30
        while not _catches_sigterm(proc.process.pid):
            assert proc.process.poll() is None and time.monotonic() < deadline, proc.log()
            time.sleep(0.005)
        # The handler is there before torch is (the imports take seconds): the stop below lands during them.
        assert "libtorch" not in open(f"/proc/{proc.process.pid}/maps").read()
        proc.terminate()
        stopped = time.monotonic()
        assert proc.wait(timeout=30) == 0
        assert time.monotonic() - stopped < 3
        _assert_clean_log(proc)
    finally:
        proc.kill()


def test_the_kvserve_command_handles_sigterm_before_it_imports_the_server(monkeypatch):
    import server.__main__ as kvserve_main

    seen = {}

    def parser_that_records_the_handler(argv):
        seen["handler"] = signal.getsignal(signal.SIGTERM)
        raise SystemExit(0)

    previous = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(kvserve_main, "build_parser", parser_that_records_the_handler)
    try:
        with pytest.raises(SystemExit):
            kvserve_main.main(["serve"])
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert seen["handler"] is kvserve_main._exit_while_starting
