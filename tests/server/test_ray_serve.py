"""Scale-out on Ray Serve: `kvserve serve --replicas 2` with tiny models, the application builder, the router.

Most tests share one server (module scope): two KVServe replicas of a tiny random model on a local Ray
instance, each holding at most 2 running and 2 waiting requests. They run in file order, the replica
kill and the stop last (the stop ends the server). The router and builder tests need Ray but no server.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from engine.hub.models_hub import kvserve_home
from tests.support.server_harness import ServerProcess, parse_sse
from tests.support.tiny_models import make_tiny_llama

pytestmark = [pytest.mark.ray, pytest.mark.slow]

MAX_NUM_SEQS = 2
MAX_QUEUED = 2
SERVE_ARGS = [
    *("--embedding-model", "none", "--max-model-len", "512", "--kv-cache-memory", "16MiB"),
    *("--max-num-seqs", str(MAX_NUM_SEQS), "--max-queued-requests", str(MAX_QUEUED)),
    *("--shutdown-timeout", "0.5", "--replicas", "2", "--log-level", "info"),
]
REPLICA_HEADER = "x-kvserve-replica"
REPLICA_TITLE = re.compile(r"^ray::ServeReplica:kvserve:KVServe(?!Ingress)")
# Longer than three prefix chunks (server/ray/router.py), well inside the tiny model's 512-token context.
SENTENCE = "You answer questions about the paged KV cache, continuous batching and the quick brown fox. "
SYSTEM_PROMPT = (SENTENCE * 5)[:420]


@pytest.fixture(scope="module")
def ray_home(tmp_path_factory) -> Path:
    """The served process's HOME: the private instance must keep nothing there (test_ray_keeps_nothing_in_home)."""
    return tmp_path_factory.mktemp("home")


@pytest.fixture(scope="module")
def served(tmp_path_factory, ray_home):
    pytest.importorskip("ray.serve")
    psutil = pytest.importorskip("psutil")
    model = make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    env = {"HOME": str(ray_home), "KVSERVE_HOME": str(kvserve_home())}  # the native kernels already built there
    proc = ServerProcess(["--model", str(model), *SERVE_ARGS], tmp_path_factory.mktemp("ray") / "server.log", env=env)
    try:
        proc.wait_ready(timeout=240)
        yield proc
    finally:
        ray_processes = []
        if proc.process.poll() is None:
            ray_processes = psutil.Process(proc.process.pid).children(recursive=True)
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except Exception:
                proc.kill()
        for leftover in ray_processes:  # a stop that went wrong must not leave Ray running
            if leftover.is_running():
                leftover.kill()
        proc.kill()


def _complete(served: ServerProcess, prompt: str, **fields) -> httpx.Response:
    return httpx.post(f"{served.base_url}/v1/completions", json={"prompt": prompt, **fields}, timeout=60)


def _stream_events(served: ServerProcess, prompt: str, max_tokens: int, on_first=None) -> tuple[str, list]:
    """(the answering replica, the stream's SSE payloads); on_first() runs when the first event is in."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{served.base_url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        raw = ""
        for text in response.iter_text():
            if not raw and on_first is not None:
                on_first()
            raw += text
        return response.headers[REPLICA_HEADER], parse_sse(raw)


def test_both_replicas_answer(served):
    seen = set()
    for i in range(40):
        response = _complete(served, f"prompt {i}: {i * 7919} distinct words", max_tokens=2)
        assert response.status_code == 200, response.text
        seen.add(response.headers[REPLICA_HEADER])
        if len(seen) == 2:
            break
    assert len(seen) == 2


def test_ray_keeps_nothing_in_home(served, ray_home):
    """Ray's token would otherwise go to ~/.ray/auth_token, which a read-only root (a container's) cannot hold."""
    assert _complete(served, "Hello", max_tokens=2).status_code == 200
    assert not (ray_home / ".ray").exists(), sorted(p.name for p in (ray_home / ".ray").iterdir())


def test_a_repeated_prompt_prefix_goes_to_one_replica(served):
    replicas = []
    for i in range(8):
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": f"question {i}?"}]
        body = {"messages": messages, "max_tokens": 2}
        response = httpx.post(f"{served.base_url}/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        replicas.append(response.headers[REPLICA_HEADER])
    assert len(set(replicas)) == 1, replicas


def test_a_stream_passes_through_the_proxy_incrementally(served):
    body = {"prompt": "Hello", "max_tokens": 400, "ignore_eos": True, "stream": True}
    arrivals = []
    start = time.monotonic()
    with httpx.stream("POST", f"{served.base_url}/v1/completions", json=body, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                arrivals.append((time.monotonic() - start, line.removeprefix("data: ")))
    assert arrivals[-1][1] == "[DONE]"
    first, last = arrivals[0][0], arrivals[-1][0]
    # Generating 400 tokens takes a while: the first events came long before the end, not all at once.
    assert last - first > 0.3 and first < last / 2, (first, last)
    assert len({round(at, 2) for at, _ in arrivals}) > 20


def test_every_replica_reaches_prometheus(served):
    port = re.search(r"metrics for Prometheus: http://127\.0\.0\.1:(\d+)/metrics", served.log()).group(1)
    deadline = time.monotonic() + 60
    replicas: set[str] = set()
    while time.monotonic() < deadline:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        series = re.findall(r"^ray_kvserve_generation_tokens_total\{([^}]*)\} (\S+)$", text, re.MULTILINE)
        replicas = {re.search(r'replica="([^"]+)"', labels).group(1) for labels, value in series if float(value) > 0}
        if len(replicas) == 2:
            break
        time.sleep(1)
    assert len(replicas) == 2, text
    assert re.search(r'^ray_kvserve_num_requests_running\{[^}]*deployment="KVServe"', text, re.MULTILINE)


def test_full_replicas_answer_429_queue_full(served):
    async def post(client: httpx.AsyncClient, i: int) -> httpx.Response:
        # 20 ms apart: each is routed before the next comes (a request being routed counts as queued in
        # Serve, and this queue only has room for MAX_QUEUED), and none ends before the last is sent.
        await asyncio.sleep(0.02 * i)
        body = {"prompt": f"load {i} {i * 31}", "max_tokens": 300, "ignore_eos": True}
        return await client.post(f"{served.base_url}/v1/completions", json=body)

    async def load() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(post(client, i) for i in range(24)))

    responses = asyncio.run(load())
    statuses = Counter(response.status_code for response in responses)
    assert set(statuses) == {200, 429}, statuses
    # Each replica took a full batch and queue, and Serve's queue a few more: the rest were refused at once.
    assert statuses[200] >= 2 * (MAX_NUM_SEQS + MAX_QUEUED), statuses
    for response in responses:
        if response.status_code == 429:
            assert response.json()["error"]["code"] == "queue_full"
            assert response.json()["error"]["type"] == "rate_limit_error"
            assert int(response.headers["retry-after"]) >= 1
        else:
            assert response.json()["usage"]["completion_tokens"] == 300


def test_killing_a_replica_fails_only_its_requests_and_serve_restarts_it(served):
    import psutil

    results: dict[int, tuple[str, list]] = {}
    first_events = [threading.Event() for _ in range(4)]

    def stream(i: int) -> None:
        results[i] = _stream_events(served, f"stream {i} of {i * 131}", 480, on_first=first_events[i].set)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
        time.sleep(0.05)  # one at a time: the router alternates between the two replicas
    for event in first_events:
        assert event.wait(30)
    replicas = [p for p in psutil.Process(served.process.pid).children(recursive=True) if _is_replica(p)]
    assert len(replicas) == 2
    replicas[0].kill()
    for thread in threads:
        thread.join(60)

    by_replica: dict[str, list[list]] = {}
    for replica, events in results.values():
        by_replica.setdefault(replica, []).append(events)
    assert len(by_replica) == 2, results
    failed = [replica for replica, streams in by_replica.items() if any("error" in s[-2] for s in streams)]
    assert len(failed) == 1, by_replica
    for replica, streams in by_replica.items():
        for events in streams:
            assert events[-1] == "[DONE]"
            if replica in failed:  # cut: a clean SSE error event, then [DONE]
                assert events[-2]["error"]["code"] == "shutting_down"
            else:  # untouched
                assert events[-2]["choices"][0]["finish_reason"] == "length"

    # Serve replaces the dead replica: two replicas answer again, one of them new.
    survivors = set(by_replica) - set(failed)
    deadline = time.monotonic() + 120
    seen: set[str] = set()
    i = 0
    while time.monotonic() < deadline and not seen - survivors - set(failed):
        response = _complete(served, f"after the kill {i} {i * 17}", max_tokens=2)
        if response.status_code == 200:
            seen.add(response.headers[REPLICA_HEADER])
        i += 1
        time.sleep(0.1)
    assert seen - survivors - set(failed), seen


def _is_replica(process) -> bool:
    try:
        return bool(REPLICA_TITLE.match(" ".join(process.cmdline())))
    except Exception:  # gone meanwhile
        return False


def test_a_stop_drains_then_cuts_what_is_left_and_exits_0(served):
    body = {"prompt": "Hello", "max_tokens": 500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{served.base_url}/v1/completions", json=body, timeout=60) as response:
        chunks = response.iter_text()
        raw = next(chunks)
        served.terminate()
        deadline = time.monotonic() + 5
        while httpx.get(f"{served.base_url}/health", timeout=5).status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        refused = _complete(served, "Hi", max_tokens=2)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
        raw += "".join(chunks)
    events = parse_sse(raw)
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "shutting_down"  # cut after the 0.5 s grace
    assert served.wait(timeout=60) == 0


# ---- without a server ----


def test_the_private_instance_gets_its_token_in_the_environment():
    from server.ray.local import private_auth_token

    token = private_auth_token({})["RAY_AUTH_TOKEN"]
    assert len(token) == 64 and int(token, 16) >= 0 and private_auth_token({}) != {"RAY_AUTH_TOKEN": token}
    assert private_auth_token({"RAY_AUTH_TOKEN": "given"}) == {}  # a configured token is kept
    assert private_auth_token({"RAY_AUTH_TOKEN_PATH": "/run/secrets/ray"}) == {}


def test_replicas_without_ray_say_how_to_install_it(monkeypatch, capsys, tmp_path):
    from server import cli
    from server.ray import local as ray_local

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    monkeypatch.setitem(sys.modules, "ray.serve", None)
    monkeypatch.setenv(ray_local.RAY_LOOPBACK_ENV, "1")  # restored afterwards
    level = logging.getLogger().level
    try:
        assert cli.main(["--model", str(tmp_path), "--embedding-model", "none", "--replicas", "2"]) == 2
    finally:
        logging.getLogger().setLevel(level)
    assert "pip install 'kvserve[ray]'" in capsys.readouterr().err


def test_scale_out_flags_feed_every_scale_out_field():
    import dataclasses

    from server import cli
    from server.ray.scale_out import ScaleOut

    fields = {flag.scale_out for flag in cli.FLAGS if flag.scale_out is not None}
    assert fields == {field.name for field in dataclasses.fields(ScaleOut)}
    with pytest.raises(ValueError, match="max_replicas"):
        cli.scale_out_from_args(_namespace(replicas=2, max_replicas=1))
    assert cli.scale_out_from_args(_namespace(replicas=2)) == ScaleOut(replicas=2)


def _namespace(**values):
    import argparse

    return argparse.Namespace(**values)


def test_build_app_parses_args_with_the_cli_flags():
    pytest.importorskip("ray.serve")
    from ray import serve

    from server.ray.app import build_app, parse_args
    from server.ray.deployments import replica_options
    from server.ray.router import PrefixAffineRouter
    from server.ray.scale_out import ScaleOut

    args = {"model": "m", "max-num-seqs": 16, "enable_prefix_caching": True, "embedding-model": None}
    namespace = parse_args({**args, "max-replicas": 4, "replicas": 2})
    # A model flag's value is the models it names: none for "none".
    assert (namespace.max_num_seqs, namespace.enable_prefix_caching, namespace.embedding_model) == (16, True, ())
    assert isinstance(build_app(args), serve.Application)
    with pytest.raises(ValueError, match="unrecognized arguments"):
        parse_args({"no-such-flag": 1})
    with pytest.raises(ValueError, match="max-num-seqs"):
        parse_args({"max-num-seqs": "many"})

    from server.cli.args import config_from_args

    config = config_from_args(namespace)
    options = replica_options(config, ScaleOut(replicas=2, max_replicas=4), num_cpus=0.5)
    assert options["name"] == "KVServe"
    assert options["max_ongoing_requests"] == 16 + config.max_queued_requests
    assert options["max_queued_requests"] == config.max_queued_requests
    assert options["autoscaling_config"]["target_ongoing_requests"] == 16
    assert (options["autoscaling_config"]["min_replicas"], options["autoscaling_config"]["max_replicas"]) == (2, 4)
    assert options["request_router_config"].get_request_router_class() is PrefixAffineRouter
    fixed = replica_options(config, ScaleOut(replicas=3, routing="least-loaded"), num_cpus=1)
    assert fixed["num_replicas"] == 3 and "request_router_config" not in fixed and "autoscaling_config" not in fixed


def test_prefix_hashes_follow_the_prompt_start():
    pytest.importorskip("ray.serve")
    from server.ray.router import PREFIX_CHUNK_CHARS, prefix_hashes

    def chat(*contents: str) -> bytes:
        messages = [{"role": "system", "content": contents[0]}, *({"role": "user", "content": c} for c in contents[1:])]
        return json.dumps({"messages": messages}).encode()

    a = prefix_hashes("/v1/chat/completions", chat(SYSTEM_PROMPT, "first question"))
    b = prefix_hashes("/v1/chat/completions", chat(SYSTEM_PROMPT, "second question"))
    shared = len(SYSTEM_PROMPT) // PREFIX_CHUNK_CHARS
    assert shared >= 3 and a[:shared] == b[:shared] and a[-1] != b[-1]
    assert prefix_hashes("/v1/embeddings", json.dumps({"input": SYSTEM_PROMPT}).encode()) == []
    assert prefix_hashes("/v1/completions", b"not json") == []
    completion = prefix_hashes("/v1/completions", json.dumps({"prompt": [SYSTEM_PROMPT, "other"]}).encode())
    assert completion == prefix_hashes("/v1/completions", json.dumps({"prompt": SYSTEM_PROMPT}).encode())


class _FakeReplica:
    """What the router reads of a running replica."""

    def __init__(self, replica_id, max_ongoing_requests: int = 8) -> None:
        self.replica_id = replica_id
        self.max_ongoing_requests = max_ongoing_requests

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return 0


def test_the_router_prefers_the_prefix_owner_unless_it_is_overloaded():
    pytest.importorskip("ray.serve")
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
    from ray.serve.request_router import PendingRequest

    from server.ray.router import PrefixAffineRouter

    deployment = DeploymentID(name="KVServe", app_name="kvserve")
    a, b = (_FakeReplica(ReplicaID(unique_id=name, deployment_id=deployment)) for name in ("a", "b"))

    def pending(*hashes: int) -> PendingRequest:
        metadata = RequestMetadata(request_id="r", internal_request_id=f"r{hashes}")
        return PendingRequest(args=[], kwargs={"prefix_hashes": list(hashes)}, metadata=metadata)

    def ids(ranks) -> list[set[str]]:
        return [{replica.replica_id.unique_id for replica in rank} for rank in ranks]

    async def scenario() -> None:
        router = PrefixAffineRouter(deployment, DeploymentHandleSource.UNKNOWN, use_replica_queue_len_cache=True)
        router.initialize_state(overload_threshold=2)
        router.update_replicas([a, b])
        first = pending(1, 2, 3)
        assert ids(await router.choose_replicas([a, b], first)) == [{"a", "b"}]  # nothing known: least loaded
        router.on_request_routed(first, a.replica_id, None)
        second = pending(1, 2, 4)  # shares two chunks with the first
        assert ids(await router.choose_replicas([a, b], second)) == [{"a"}, {"b"}]
        router.replica_queue_len_cache.update(a.replica_id, 2)  # a's batch is full
        assert ids(await router.choose_replicas([a, b], second)) == [{"a", "b"}]
        router.on_request_routed(second, b.replica_id, None)  # the overflow went to b
        router.replica_queue_len_cache.update(a.replica_id, 0)
        assert ids(await router.choose_replicas([a, b], pending(1, 2))) == [{"a"}, {"b"}]  # a keeps the shared prefix
        assert ids(await router.choose_replicas([a, b], pending(1, 2, 4))) == [{"b"}, {"a"}]  # b owns the longer one
        router.replica_queue_len_cache.update(a.replica_id, 1)
        router.replica_queue_len_cache.update(b.replica_id, 0)
        assert ids(await router.choose_replicas([a, b], pending(1, 2))) == [{"a"}, {"b"}]  # 1 > 2 x 0 + 1: no
        router.initialize_state(overload_threshold=10)  # a batch far from full: only the imbalance counts
        router.on_request_routed(pending(7), a.replica_id, None)
        router.replica_queue_len_cache.update(a.replica_id, 3)
        router.replica_queue_len_cache.update(b.replica_id, 1)
        assert ids(await router.choose_replicas([a, b], pending(7))) == [{"a"}, {"b"}]  # 3 <= 2 x 1 + 1
        router.replica_queue_len_cache.update(a.replica_id, 4)
        assert ids(await router.choose_replicas([a, b], pending(7))) == [{"a", "b"}]  # 4 > 2 x 1 + 1: fall back
        router.update_replicas([b])  # a is gone: its prefixes go to whoever serves them next
        third = pending(1, 2, 3)
        assert ids(await router.choose_replicas([b], third)) == [{"b"}]
        router.on_request_routed(third, b.replica_id, None)
        assert ids(await router.choose_replicas([b], pending(1))) == [{"b"}]
        await asyncio.sleep(0)  # let the replica probes update_replicas started finish

    asyncio.run(scenario())
