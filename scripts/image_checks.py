"""Checks a built kvserve image in running containers (scripts/test_image.sh builds it and calls this).

Every container runs on the host network (no published ports) with its own port, one at a time
where they would compete for the two cores. Each check prints one line; the first failure stops
the run with exit status 1 and the container's log.

    python scripts/image_checks.py --image kvserve:test
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpx

HEALTH_TIMEOUT_S = 180.0
# docker stop's default grace: the server's default --shutdown-timeout (8 s) plus its ~1 s stop fit inside.
DOCKER_STOP_GRACE_S = 10
EXPECTED_UID = "10001"


class CheckFailed(RuntimeError):
    pass


def docker(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise CheckFailed(f"docker {' '.join(args)} exited {result.returncode}: {result.stderr.strip()}")
    return result


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ok(message: str) -> None:
    print(f"ok   {message}", flush=True)


@dataclass
class Container:
    name: str
    port: int

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def logs(self) -> str:
        result = docker("logs", self.name, check=False)
        return result.stdout + result.stderr

    def state(self, field_path: str) -> str:
        return docker("inspect", "--format", "{{" + field_path + "}}", self.name).stdout.strip()


@contextmanager
def running(image: str, name: str, port: int, *, docker_args: list[str], command: list[str]) -> Iterator[Container]:
    docker("rm", "-f", name, check=False)
    docker("run", "-d", "--name", name, *docker_args, image, *command)
    container = Container(name, port)
    try:
        yield container
    except BaseException:
        print(f"---- logs of {name}\n{container.logs()[-6000:]}\n----", file=sys.stderr)
        raise
    finally:
        docker("rm", "-f", name, check=False)


def wait_healthy(container: Container, url: str | None = None) -> float:
    """Seconds until /health answered 200 (polled from the host)."""
    start = time.monotonic()
    url = url or f"{container.base}/health"
    while time.monotonic() - start < HEALTH_TIMEOUT_S:
        if container.state(".State.Running") != "true":
            raise CheckFailed(f"{container.name} exited {container.state('.State.ExitCode')} before serving")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise CheckFailed(f"{url} not 200 within {HEALTH_TIMEOUT_S:.0f} s")


def sse_events(response: httpx.Response) -> Iterator[str]:
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield line[len("data: ") :]


def check_api(container: Container) -> None:
    """A completion, a streamed chat whose chunks arrive one by one, and embeddings."""
    with httpx.Client(base_url=container.base, timeout=60) as client:
        models = client.get("/v1/models").json()["data"]
        names = [m["id"] for m in models]
        generation = next(m["id"] for m in models if m["task"] == "generate")
        embedding = next(m["id"] for m in models if m["task"] == "embed")
        completion = client.post(
            "/v1/completions", json={"model": generation, "prompt": "The capital of France is", "max_tokens": 8}
        )
        completion.raise_for_status()
        text = completion.json()["choices"][0]["text"]
        ok(f"completion from {generation}: {text!r} (models: {names})")

        body = {
            "model": generation,
            "messages": [{"role": "user", "content": "Count from one to ten."}],
            "max_tokens": 24,
            "stream": True,
        }
        arrivals: list[float] = []
        events: list[str] = []
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            response.raise_for_status()
            for event in sse_events(response):
                arrivals.append(time.monotonic())
                events.append(event)
        if events[-1] != "[DONE]" or len(events) < 5:
            raise CheckFailed(f"streamed chat: {len(events)} events, last {events[-1]!r}")
        spread = arrivals[-2] - arrivals[0]
        if spread <= 0:
            raise CheckFailed("streamed chat: every chunk arrived at once")
        content = "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e)
        ok(f"streamed chat: {len(events) - 1} chunks over {spread * 1000:.0f} ms, then [DONE]: {content!r}")

        embeddings = client.post("/v1/embeddings", json={"model": embedding, "input": ["a cat", "a dog"]})
        embeddings.raise_for_status()
        vectors = [d["embedding"] for d in embeddings.json()["data"]]
        ok(f"embeddings from {embedding}: {len(vectors)} vectors of {len(vectors[0])} dims")

        # The playground ships in the package: its page and every file it names are served from the image.
        page = client.get("/")
        page.raise_for_status()
        assets = re.findall(r'"(/playground/[\w.-]+)"', page.text)
        if not page.headers["content-type"].startswith("text/html") or not assets:
            raise CheckFailed(f"GET /: not the playground page ({page.headers['content-type']})")
        for asset in assets:
            client.get(asset).raise_for_status()
        attention = client.post("/attention", json={"prompt": "The cat sat on the mat.", "head": 0})
        attention.raise_for_status()
        ok(f"playground: GET / and its {len(assets)} files; /attention over {len(attention.json()['tokens'])} tokens")


def check_user_and_toolchain(container: Container) -> None:
    uid = docker("exec", container.name, "id", "-u").stdout.strip()
    if uid != EXPECTED_UID:
        raise CheckFailed(f"the server runs as uid {uid}, not {EXPECTED_UID}")
    ok(f"runs as uid {uid} (not root)")
    compilers = docker("exec", container.name, "sh", "-c", "command -v gcc cc clang || true").stdout.split()
    if compilers:
        raise CheckFailed(f"the runtime image has a compiler: {compilers}")
    ok("no compiler in the runtime image")


def check_prebuilt_kernels(container: Container) -> None:
    log = container.logs()
    if "built native kernel" in log:
        raise CheckFailed("a native kernel was compiled at start-up: the image's prebuilt ones were not used")
    plan = [line for line in log.splitlines() if "decode path:" in line]
    if not plan or "native" not in plan[-1]:
        raise CheckFailed(f"the decode path does not use the native kernels: {plan}")
    ok(f"prebuilt native kernels loaded: {plan[-1].split('decode path:', 1)[1].strip()}")


def wait_health_status(container: Container, want: str, timeout: float = 60) -> float:
    start = time.monotonic()
    status = ""
    while time.monotonic() - start < timeout:
        status = container.state(".State.Health.Status")
        if status == want:
            return time.monotonic() - start
        if status == "unhealthy":
            break
        time.sleep(0.5)
    log = docker("inspect", "--format", "{{json .State.Health.Log}}", container.name).stdout
    raise CheckFailed(f"{container.name}: health {status!r}, wanted {want!r}; checks: {log[-800:]}")


@dataclass
class StreamOutcome:
    events: list[str] = field(default_factory=list)
    error: str | None = None
    first_chunk: threading.Event = field(default_factory=threading.Event)


def _long_stream(container: Container, model: str, outcome: StreamOutcome) -> None:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Write a long story about a lighthouse."}],
        "max_tokens": 4000,
        "ignore_eos": True,
        "stream": True,
    }
    try:
        with httpx.stream("POST", f"{container.base}/v1/chat/completions", json=body, timeout=60) as response:
            for event in sse_events(response):
                outcome.events.append(event)
                outcome.first_chunk.set()
    except httpx.HTTPError as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
    finally:
        outcome.first_chunk.set()


def check_stop_with_stream(container: Container) -> None:
    """docker stop mid-stream: exit 0 within the grace; the client gets an error event, then [DONE]."""
    models = httpx.get(f"{container.base}/v1/models", timeout=10).json()["data"]
    model = next(m["id"] for m in models if m["task"] == "generate")
    outcome = StreamOutcome()
    thread = threading.Thread(target=_long_stream, args=(container, model, outcome), daemon=True)
    thread.start()
    if not outcome.first_chunk.wait(60) or not outcome.events:
        raise CheckFailed(f"the long stream did not start: {outcome.error}")
    start = time.monotonic()
    docker("stop", "-t", str(DOCKER_STOP_GRACE_S), container.name, timeout=DOCKER_STOP_GRACE_S + 30)
    took = time.monotonic() - start
    thread.join(10)
    exit_code = container.state(".State.ExitCode")
    oom_or_kill = container.state(".State.OOMKilled")
    if exit_code != "0" or took >= DOCKER_STOP_GRACE_S:
        raise CheckFailed(f"docker stop took {took:.1f} s, exit code {exit_code} (OOM killed: {oom_or_kill})")
    if outcome.error or not outcome.events or outcome.events[-1] != "[DONE]":
        raise CheckFailed(f"the stream did not end cleanly: error {outcome.error}, last {outcome.events[-2:]}")
    last = json.loads(outcome.events[-2])
    ending = last.get("error", {}).get("code") or last["choices"][0].get("finish_reason")
    ok(f"docker stop mid-stream: exit 0 after {took:.1f} s; {len(outcome.events) - 1} events, ended by {ending!r}")


def check_stop_while_loading(image: str) -> None:
    port = free_port()
    docker_args = ["--network", "host", "-e", f"KVSERVE_PORT={port}"]
    with running(image, "kvserve-check-loading", port, docker_args=docker_args, command=[]) as container:
        time.sleep(1.0)  # the process is up and loading its models
        start = time.monotonic()
        docker("stop", "-t", str(DOCKER_STOP_GRACE_S), container.name, timeout=60)
        took = time.monotonic() - start
        exit_code = container.state(".State.ExitCode")
        if exit_code != "0" or took > 3:
            raise CheckFailed(f"stop while loading took {took:.1f} s, exit code {exit_code}")
        ok(f"docker stop while loading: exit 0 after {took:.1f} s")


def check_ray_image(image: str) -> None:
    """An `EXTRAS=ray` image: `kvserve serve --replicas 2` in one container, both replicas answering, a clean stop."""
    port = free_port()
    docker_args = ["--network", "host", "--shm-size", "1g", "--read-only", "--tmpfs", "/tmp"]
    command = ["kvserve", "serve", "--port", str(port), "--replicas", "2", "--embedding-model", "none"]
    with running(image, "kvserve-check-ray", port, docker_args=docker_args, command=command) as container:
        ok(f"--replicas 2 in a container: /health 200 after {wait_healthy(container):.1f} s")
        models = httpx.get(f"{container.base}/v1/models", timeout=30).json()["data"]
        model = next(m["id"] for m in models if m["task"] == "generate")
        replicas = set()
        for i in range(12):  # different prompts: the prefix router spreads them over both replicas
            body = {"model": model, "prompt": f"{i} {'apple ' * i}Once upon a time", "max_tokens": 4}
            response = httpx.post(f"{container.base}/v1/completions", json=body, timeout=60)
            response.raise_for_status()
            replicas.add(response.headers["x-kvserve-replica"])
        if len(replicas) != 2:
            raise CheckFailed(f"12 different prompts reached {len(replicas)} replica(s): {replicas}")
        ok(f"12 completions answered by both replicas: {sorted(replicas)}")
        start = time.monotonic()
        docker("stop", "-t", str(DOCKER_STOP_GRACE_S), container.name, timeout=60)
        took, exit_code = time.monotonic() - start, container.state(".State.ExitCode")
        if exit_code != "0" or took >= DOCKER_STOP_GRACE_S:
            raise CheckFailed(f"docker stop of --replicas 2 took {took:.1f} s, exit code {exit_code}")
        ok(f"docker stop of --replicas 2: exit 0 after {took:.1f} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image", default="kvserve:test")
    parser.add_argument("--ray-image", help="also check this EXTRAS=ray image with --replicas 2")
    args = parser.parse_args()
    image = args.image
    # Fast health checks for the test only; the command checked is the image's own HEALTHCHECK.
    health = ["--health-interval", "2s", "--health-start-period", "120s"]
    try:
        # 1. The default command, port from KVSERVE_PORT: the API, the user, the kernels, HEALTHCHECK, a stop.
        port = free_port()
        with running(
            image,
            "kvserve-check",
            port,
            docker_args=["--network", "host", "-e", f"KVSERVE_PORT={port}", *health],
            command=[],
        ) as container:
            ok(f"/health 200 after {wait_healthy(container):.1f} s (image {image})")
            check_api(container)
            check_user_and_toolchain(container)
            check_prebuilt_kernels(container)
            ok(f"HEALTHCHECK healthy (port from KVSERVE_PORT) {wait_health_status(container, 'healthy'):.1f} s later")
            check_stop_with_stream(container)

        # 2. A read-only root and nothing writable at all (no tmpfs), any --user, the port on the command line only.
        port = free_port()
        with running(
            image,
            "kvserve-check-ro",
            port,
            docker_args=["--network", "host", "--read-only", "--user", "12345:12345", *health],
            command=["kvserve", "serve", "--port", str(port)],
        ) as container:
            ok(f"--read-only --user 12345:12345 --port {port}: /health 200 after {wait_healthy(container):.1f} s")
            ok(
                f"HEALTHCHECK healthy with --port on the command line {wait_health_status(container, 'healthy'):.1f} s"
                " later"
            )
            check_api(container)

        # 3. No network at all: the models are in the image.
        with running(
            image, "kvserve-check-offline", 8000, docker_args=["--network", "none", *health], command=[]
        ) as container:
            waited = wait_health_status(container, "healthy", timeout=HEALTH_TIMEOUT_S)
            probe = (
                "import json, urllib.request; base = 'http://127.0.0.1:8000';"
                " model = next(m['id'] for m in json.load(urllib.request.urlopen(base + '/v1/models'))['data']"
                " if m['task'] == 'generate');"
                " body = json.dumps({'model': model, 'prompt': 'Hello', 'max_tokens': 4}).encode();"
                " request = urllib.request.Request(base + '/v1/completions', data=body,"
                " headers={'Content-Type': 'application/json'});"
                " print(json.load(urllib.request.urlopen(request, timeout=60))['choices'][0]['text'])"
            )
            text = docker("exec", container.name, "python", "-c", probe).stdout.strip()
            ok(f"--network none: healthy after {waited:.1f} s; a completion inside: {text!r}")

        # 4. SIGTERM while the models load: exits at once.
        check_stop_while_loading(image)

        # 5. Optionally, the Ray Serve image with two replicas.
        if args.ray_image:
            check_ray_image(args.ray_image)
    except CheckFailed as exc:
        print(f"FAIL {exc}", file=sys.stderr)
        return 1
    size = int(docker("image", "inspect", "--format", "{{.Size}}", image).stdout.strip())
    ok(f"image size {size / 2**30:.2f} GiB")
    layers = docker("history", "--no-trunc", "--format", "{{.Size}}\t{{.CreatedBy}}", image).stdout.splitlines()
    for line in layers:
        layer_size, created_by = line.split("\t", 1)
        created_by = re.sub(r"^/bin/sh -c (#\(nop\) )?|(dir|file|multi):[0-9a-f]{64} ", "", created_by)
        if not layer_size.startswith("0B"):
            print(f"     {layer_size:>8}  {created_by[:100]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
