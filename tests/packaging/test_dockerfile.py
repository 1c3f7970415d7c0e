"""The Dockerfile, checked without a Docker engine.

scripts/test_image.sh builds the image and checks it in running containers (CI runs it after this
suite). These tests hold the Dockerfile to its structure where a mistake would not fail a build: base
images pinned by digest, dependency, model and kernel layers that no source edit invalidates, the lock
as the only source of versions, the partial sources the model and kernel stages copy being enough to
run them, a non-root runtime without a compiler, and a HEALTHCHECK that follows the server's port.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from engine.hub import models_hub

pytestmark = pytest.mark.slow

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


def _args(instructions: list[Instruction]) -> dict[str, str]:
    return dict(a.args.split("=", 1) for a in instructions if a.keyword == "ARG" and "=" in a.args)


def _stage(stages: list[Stage], name: str) -> Stage:
    return next(s for s in stages if s.name == name)


def _copied_sources(stage: Stage) -> list[str]:
    """The build-context paths a stage COPYs (not --from=)."""
    paths: list[str] = []
    for args in stage.all("COPY"):
        if not args.startswith("--from="):
            paths += shlex.split(args)[:-1]
    return paths


def test_base_images_are_pinned_by_digest(dockerfile) -> None:
    instructions, stages = dockerfile
    args = _args(instructions)
    for name in ("BUILD_IMAGE", "PYTHON_IMAGE"):
        assert re.fullmatch(r"python:3\.11-[a-z-]*bookworm@sha256:[0-9a-f]{64}", args[name]), args[name]
    assert "slim" in args["PYTHON_IMAGE"] and "slim" not in args["BUILD_IMAGE"]  # the runtime has no gcc
    assert [s.base for s in stages] == ["${BUILD_IMAGE}", "deps", "deps", "${PYTHON_IMAGE}"]
    assert [s.name for s in stages] == ["deps", "models", "kernels", "runtime"]


def test_dependencies_come_from_the_lock_only(dockerfile) -> None:
    instructions, stages = dockerfile
    deps = _stage(stages, "deps")
    # Nothing of the source reaches the dependency layer: only the locks, the wheelhouse and CA certificates.
    assert sorted(_copied_sources(deps)) == ["${CA_CERTIFICATES}", "deploy/requirements*.lock", "deploy/wheelhouse/"]
    (install,) = [r for r in deps.all("RUN") if "pip install" in r]
    assert '-c deploy/requirements.lock $torch_index "torch==$TORCH_VERSION"' in install
    assert "-r deploy/requirements.lock" in install and "-e" not in install.split()
    args = _args(instructions)
    assert args["VARIANT"] == "cpu" and args["TORCH_VERSION"] == "2.13.0"
    assert args["TORCH_CPU_INDEX"].endswith("/cpu") and "/cu" in args["TORCH_CUDA_INDEX"]
    assert "cpu)" in install and "cuda)" in install and "exit 1" in install  # any other VARIANT fails the build
    # The wheelhouse build: no index at all.
    assert 'if [ "$WHEELHOUSE" = 1 ]; then' in install and "PIP_NO_INDEX=1 PIP_FIND_LINKS=/opt/wheelhouse" in install
    # A mirror and a CA bundle by build argument.
    declared = {a.args.split("=", 1)[0] for a in instructions if a.keyword == "ARG"}
    assert {"PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_TRUSTED_HOST", "CA_CERTIFICATES", "WHEELHOUSE"} <= declared
    assert any("update-ca-certificates" in r for r in deps.all("RUN"))
    assert deps.env()["PIP_CERT"] == "/etc/ssl/certs/ca-certificates.crt"


def test_the_torch_pin_agrees_with_the_makefile(dockerfile) -> None:
    instructions, _ = dockerfile
    makefile = (ROOT / "Makefile").read_text()
    spec = re.search(r"^TORCH_SPEC \?= (.*)$", makefile, re.MULTILINE).group(1)
    assert spec == f"torch=={_args(instructions)['TORCH_VERSION']}"


def _stage_sources(stage: Stage, dest: Path) -> None:
    """Copy what `stage` COPYs from the build context into dest, as Docker would (globs expanded)."""
    for pattern in _copied_sources(stage):
        matches = sorted(ROOT.glob(pattern.rstrip("/")))
        assert matches, f"{stage.name}: COPY {pattern} matches nothing"
        for src in matches:
            target = dest / src.relative_to(ROOT)
            target.parent.mkdir(parents=True, exist_ok=True)
            if src.is_dir():
                shutil.copytree(src, target, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy2(src, target)


def _run_in(tree: Path, code: str, home: Path) -> subprocess.CompletedProcess[str]:
    # -P would drop the working directory; PYTHONPATH puts the partial tree ahead of the editable install.
    env = {**os.environ, "PYTHONPATH": str(tree), "KVSERVE_HOME": str(home)}
    return subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, capture_output=True, text=True, timeout=120)


def test_the_models_stage_sources_are_enough_for_kvserve_pull(dockerfile, tmp_path) -> None:
    _, stages = dockerfile
    models = _stage(stages, "models")
    tree = tmp_path / "src"
    _stage_sources(models, tree)
    assert "python -m server pull" in " ".join(models.all("RUN"))
    code = (
        "import sys, server.__main__ as m; from pathlib import Path;"
        "assert Path(m.__file__).is_relative_to(Path.cwd()), m.__file__;"
        "sys.argv = ['kvserve', 'models']; sys.exit(m.main())"
    )
    result = _run_in(tree, code, tmp_path / "home")
    assert result.returncode == 0, result.stderr
    for name in models_hub.MODELS:  # `kvserve pull` with no names pulls every one of these
        assert name in result.stdout
    makefile = (ROOT / "Makefile").read_text()
    defaults = re.search(r"^DEFAULT_MODELS \?= (.*)$", makefile, re.MULTILINE).group(1).split()
    assert sorted(defaults) == sorted(models_hub.MODELS)  # the image bakes what `make models` pulls


def test_the_kernels_stage_builds_every_kernel_from_its_sources(dockerfile, tmp_path) -> None:
    _, stages = dockerfile
    kernels = _stage(stages, "kernels")
    tree = tmp_path / "src"
    _stage_sources(kernels, tree)
    assert sorted(p.name for p in (tree / "engine/ops").glob("*.c")) == sorted(
        p.name for p in (ROOT / "engine/ops").glob("*.c")
    )
    # The kernels are keyed by the sources' hash: the copy must name the same files the runtime will look for.
    code = (
        "from pathlib import Path; from engine.ops import loader;"
        "assert Path(loader.__file__).is_relative_to(Path.cwd()), loader.__file__;"
        "print('\\n'.join(loader.library_path(p.stem, isa).name for p in sorted(loader.SOURCE_DIR.glob('*.c'))"
        " for isa in loader.ISA_BUILDS))"
    )
    result = _run_in(tree, code, tmp_path / "home")
    assert result.returncode == 0, result.stderr
    from engine.ops import loader

    # every instruction-set build of every kernel: the machine that runs the image picks its own
    expected = [
        loader.library_path(p.stem, isa).name
        for p in sorted(loader.SOURCE_DIR.glob("*.c"))
        for isa in loader.ISA_BUILDS
    ]
    assert result.stdout.split() == expected
    (build,) = kernels.all("RUN")
    assert "prebuild(p.stem) for p in sorted(SOURCE_DIR.glob('*.c'))" in build


def test_source_layers_come_last(dockerfile) -> None:
    _, stages = dockerfile
    runtime = stages[-1]
    copies = runtime.all("COPY")
    from_stages = [c for c in copies if c.startswith("--from=")]
    assert [c.split()[0] for c in from_stages] == ["--from=deps", "--from=models", "--from=kernels"]
    assert from_stages[0].split()[1:] == ["/opt/kvserve/.venv", "/opt/kvserve/.venv"]
    last_from = max(i for i, ins in enumerate(runtime.instructions) if ins.keyword == "COPY" and "--from=" in ins.args)
    first_source = min(
        i for i, ins in enumerate(runtime.instructions) if ins.keyword == "COPY" and "--from=" not in ins.args
    )
    assert last_from < first_source
    assert sorted(_copied_sources(runtime)) == ["README.md", "clients", "engine", "pyproject.toml", "server"]
    (install,) = [r for r in runtime.all("RUN") if "pip install" in r]
    assert "--no-index" in install and "--no-deps" in install and "--no-build-isolation" in install


def test_models_and_kernels_are_where_the_runtime_looks(dockerfile) -> None:
    _, stages = dockerfile
    home = stages[-1].env()["KVSERVE_HOME"]
    assert _stage(stages, "models").env()["KVSERVE_HOME"] == home == _stage(stages, "kernels").env()["KVSERVE_HOME"]
    copies = stages[-1].all("COPY")
    assert f"--from=models {home}/models {home}/models" in copies
    assert f"--from=kernels {home}/kernels {home}/kernels" in copies
    assert stages[-1].env()["HF_HUB_OFFLINE"] == "1"


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
    assert not any(line.startswith("deploy") for line in ignored)  # the locks, the wheelhouse, CA certificates


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


def _healthcheck(argv: list[str], server_argv: list[str], environ: dict[str, str]) -> int:
    """Run the image's HEALTHCHECK command here, as if `server_argv` were the only process on the machine."""
    assert argv[:3] == ["python", "-m", "server.healthcheck"]
    code = (
        "import json, sys, server.healthcheck as h; h._process_commands = lambda: [json.loads(sys.argv[1])];"
        "sys.exit(h.main())"
    )
    run = [sys.executable, "-c", code, json.dumps(server_argv)]
    return subprocess.run(run, env=environ, capture_output=True, timeout=30, check=False).returncode


def test_healthcheck_follows_health_on_the_servers_port(dockerfile, health_server) -> None:
    _, stages = dockerfile
    (check,) = stages[-1].all("HEALTHCHECK")
    options, _, command = check.partition("CMD ")
    assert "--start-period" in options  # model loading must not count as unhealthy
    argv = _exec_form(command)  # python: the slim image has no curl
    port = str(health_server.server_address[1])
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSERVE_")}
    serve = ["/opt/kvserve/.venv/bin/python", "/opt/kvserve/.venv/bin/kvserve", "serve"]
    _HealthHandler.status = 200
    assert _healthcheck(argv, serve, {**env, "KVSERVE_PORT": port}) == 0  # the image's default: KVSERVE_PORT
    assert _healthcheck(argv, [*serve, "--port", port], {**env, "KVSERVE_PORT": "1"}) == 0  # the command line wins
    assert _healthcheck(argv, [*serve, f"--port={port}", "--host", "0.0.0.0"], env) == 0
    assert _healthcheck(argv, serve, {**env, "KVSERVE_PORT": "1"}) != 0  # nothing listens there
    _HealthHandler.status = 503  # still loading, draining, or the engine loop died
    assert _healthcheck(argv, [*serve, "--port", port], env) != 0
