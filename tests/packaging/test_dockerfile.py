"""The Dockerfile, checked without a Docker engine.

No Docker runs on the development machines, so these tests parse the Dockerfile and hold
it to what the image must do: build with the same `make install` / `make models` (i.e.
`kvserve pull`) the rest of the suite exercises, run as a non-root user, listen on 0.0.0.0
inside, expose 8000, check /health, serve offline from models baked in at build time.
The `make` invocations are dry-run here with the Dockerfile's own variables, and the
HEALTHCHECK command is run against a live HTTP server.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import shlex
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from engine.hub import models_hub

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Instruction:
    keyword: str
    args: str


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction]

    def all(self, keyword: str) -> list[str]:
        return [i.args for i in self.instructions if i.keyword == keyword]

    def env(self) -> dict[str, str]:
        values: dict[str, str] = {}
        for args in self.all("ENV"):
            for token in shlex.split(args):
                key, sep, value = token.partition("=")
                assert sep, f"use ENV KEY=VALUE, not {args!r}"
                values[key] = value
        return values


def parse_dockerfile(text: str) -> tuple[list[Instruction], list[Stage]]:
    """Instructions (continuations joined, comments dropped) and the stages they form."""
    instructions: list[Instruction] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = pending + line
        pending = ""
        keyword, _, args = full.partition(" ")
        instructions.append(Instruction(keyword.upper(), args.strip()))
    stages: list[Stage] = []
    for ins in instructions:
        if ins.keyword == "FROM":
            m = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", ins.args, re.IGNORECASE)
            assert m, ins.args
            stages.append(Stage(m.group(1), m.group(2), []))
        elif stages:
            stages[-1].instructions.append(ins)
    return instructions, stages


@pytest.fixture(scope="module")
def dockerfile() -> tuple[list[Instruction], list[Stage]]:
    return parse_dockerfile((ROOT / "Dockerfile").read_text())


def _exec_form(args: str) -> list[str]:
    """JSON exec form of CMD/HEALTHCHECK CMD (what Docker runs without a shell)."""
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value)
    return value


def test_multi_stage_with_a_slim_runtime(dockerfile) -> None:
    _, stages = dockerfile
    assert len(stages) >= 2
    build, runtime = stages[0], stages[-1]
    assert build.name == "build"
    assert runtime.base != "build", "the runtime stage must not carry the build tools"
    copies = runtime.all("COPY")
    assert any(c.startswith("--from=build ") for c in copies)
    assert not runtime.all("RUN") or not any("make install" in r for r in runtime.all("RUN"))


def test_cpu_by_default_cuda_by_build_arg(dockerfile) -> None:
    instructions, stages = dockerfile
    args = dict(a.args.split("=", 1) for a in instructions if a.keyword == "ARG" and "=" in a.args)
    assert args["VARIANT"] == "cpu"
    assert args["TORCH_VERSION"] == "2.13.0"
    assert args["TORCH_CPU_INDEX"].endswith("/cpu") and "/cu" in args["TORCH_CUDA_INDEX"]
    install = next(r for r in stages[0].all("RUN") if "make install" in r)
    assert "cpu)" in install and "cuda)" in install and "exit 1" in install  # any other VARIANT fails the build


def test_build_runs_the_same_make_targets_as_developers(dockerfile) -> None:
    _, stages = dockerfile
    runs = " && ".join(stages[0].all("RUN"))
    assert re.search(r"\bmake install\b", runs) and re.search(r"\bmake models\b", runs)
    makefile = (ROOT / "Makefile").read_text()
    # `make models` is `kvserve pull` of exactly the named default models
    assert re.search(r"^models:.*\n\t\$\(BIN\)/kvserve pull \$\(DEFAULT_MODELS\)$", makefile, re.MULTILINE)
    defaults = re.search(r"^DEFAULT_MODELS \?= (.*)$", makefile, re.MULTILINE).group(1).split()
    assert defaults == [models_hub.DEFAULT_GENERATION_MODEL, models_hub.DEFAULT_EMBEDDING_MODEL]


def _make_dry_run(target: str, run_args: str) -> str:
    """`make -n TARGET` with the variables the Dockerfile passes (shell-expanded as in the RUN)."""
    match = re.search(rf"make {target}\s+(.*?)(?:&&|$)", run_args)
    assert match, f"no `make {target}` in {run_args!r}"
    variables = shlex.split(match.group(1).replace("$TORCH_VERSION", "2.13.0").replace("$index", "IDX"))
    proc = subprocess.run(
        ["make", "-n", "-B", "-C", str(ROOT), target, *variables],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "MAKEFLAGS": ""},
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_make_invocations_in_the_dockerfile_do_what_the_image_needs(dockerfile) -> None:
    _, stages = dockerfile
    runs = " && ".join(stages[0].all("RUN"))
    install = _make_dry_run("install", runs)
    assert "python3 -m venv /opt/kvserve/.venv" in install
    assert (
        "pip install --disable-pip-version-check --index-url IDX --extra-index-url https://pypi.org/simple "
        "'torch==2.13.0'" in install
    )
    assert "pip install --disable-pip-version-check -e '.'" in install  # no dev extras in the image
    models = _make_dry_run("models", runs)
    assert "/opt/kvserve/.venv/bin/kvserve pull smollm2-135m-instruct all-minilm-l6-v2" in models


def test_models_are_baked_where_the_runtime_looks(dockerfile) -> None:
    _, stages = dockerfile
    build_env, runtime_env = stages[0].env(), stages[-1].env()
    assert build_env["KVSERVE_HOME"] == runtime_env["KVSERVE_HOME"]
    assert runtime_env["KVSERVE_HOME"].startswith("/opt/kvserve/")
    assert any(c.split()[-1] == "/opt/kvserve" for c in stages[-1].all("COPY") if c.startswith("--from=build"))
    assert runtime_env["HF_HUB_OFFLINE"] == "1"


def test_runtime_listens_everywhere_as_non_root(dockerfile) -> None:
    _, stages = dockerfile
    runtime = stages[-1]
    env = runtime.env()
    assert env["KVSERVE_HOST"] == "0.0.0.0" and env["KVSERVE_PORT"] == "8000"
    assert "/opt/kvserve/.venv/bin" in env["PATH"]
    users = runtime.all("USER")
    assert users and users[-1] not in ("root", "0", "0:0")
    assert any("useradd" in r and users[-1] in r for r in runtime.all("RUN"))
    keywords = [i.keyword for i in runtime.instructions]
    assert keywords.index("USER") < keywords.index("CMD")
    assert runtime.all("EXPOSE") == ["8000"]
    assert _exec_form(runtime.all("CMD")[-1]) == ["kvserve", "serve"]


def test_dockerignore_keeps_the_context_small() -> None:
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines() if line.strip()}
    assert {".git", ".venv", "tests"} <= ignored


class _HealthHandler(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        code = type(self).status if self.path == "/health" else 404
        self.send_response(code)
        self.end_headers()
        self.wfile.write(b'{"status": "x"}')

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def health_server() -> Iterator[http.server.HTTPServer]:
    server = http.server.HTTPServer(("127.0.0.1", 0), _HealthHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_healthcheck_command_follows_health(dockerfile, health_server) -> None:
    _, stages = dockerfile
    (check,) = stages[-1].all("HEALTHCHECK")
    options, _, command = check.partition("CMD ")
    assert "--start-period" in options  # model loading must not count as unhealthy
    argv = _exec_form(command)
    assert argv[0] == "python"  # the slim image has no curl
    env = {**os.environ, "KVSERVE_PORT": str(health_server.server_address[1])}
    run = [sys.executable, *argv[1:]]
    _HealthHandler.status = 200
    assert subprocess.run(run, env=env, capture_output=True, timeout=30, check=False).returncode == 0
    _HealthHandler.status = 503  # still loading, or the engine loop died
    assert subprocess.run(run, env=env, capture_output=True, timeout=30, check=False).returncode != 0
