"""The servers a benchmark measures, as subprocesses: start one on a free port, wait for /health, stop it
(its whole process group); llama.cpp's `llama-server` (built when missing); and `python -m` programs whose
stdout is JSON, run with this checkout importable.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx

from clients.bench.memory import MemorySampler

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
LLAMA_CPP = ROOT / "third_party" / "llama.cpp"
BUILD_SCRIPT = ROOT / "scripts" / "build_llama_cpp.sh"
# Instruction sets a benchmark can hold both servers to: the build directory of llama.cpp's server made for it
# (LLAMA_CPP_ISA in the build script), and what kvserve's process is started with.
LLAMA_BUILD_DIRS = {"native": "build", "avx2": "build-avx2"}
ISAS = tuple(LLAMA_BUILD_DIRS)
# An AVX2-only CPU's instruction sets on a newer CPU: kvserve's own kernels in their AVX2 build (no 512-bit or
# VNNI products), and torch's kernels capped at AVX2 (ATen's vectorised loops, oneDNN, MKL's float32 products).
KVSERVE_ISA_ENV = {
    "native": {},
    "avx2": {
        "KVSERVE_NATIVE_ISA": "avx2",
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    },
}


def llama_server_path(isa: str = "native") -> Path:
    """Where the build script puts llama-server built for `isa` (one of ISAS)."""
    return LLAMA_CPP / LLAMA_BUILD_DIRS[isa] / "bin" / "llama-server"


LLAMA_SERVER = llama_server_path()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server_process(
    cmd: Sequence[str], port: int, log_path: Path, *, ready_timeout_s: float = 600.0, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """Start a server, wait for GET /health == 200, yield it, and stop it (SIGTERM, then SIGKILL)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    logger.info("starting: %s", " ".join(cmd))
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            list(cmd), stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True
        )
        try:
            _wait_healthy(proc, f"http://127.0.0.1:{port}/health", ready_timeout_s, log_path)
            yield proc
        finally:
            _stop(proc)


def split_serve_args(argv: Sequence[str] | None) -> tuple[list[str], list[str]]:
    """(the program's own flags, the flags after `--` for the `kvserve serve` it starts)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        return argv, []
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1 :]


@contextlib.contextmanager
def kvserve_server(serve_args: Sequence[str], log_prefix: str) -> Iterator[tuple[str, int]]:
    """`python -m server serve SERVE_ARGS` on a free port, this checkout importable; yields (base URL, pid)
    once /health answers 200, and stops it afterwards. Its log goes to a fresh temp dir (logged)."""
    port = free_port()
    cmd = [sys.executable, "-m", "server", "serve", "--port", str(port), *serve_args]
    log_path = Path(tempfile.mkdtemp(prefix=log_prefix)) / "server.log"
    logger.info("server log: %s", log_path)
    with server_process(cmd, port, log_path, env=python_env()) as proc:
        yield f"http://127.0.0.1:{port}", proc.pid


def _wait_healthy(proc: subprocess.Popen[bytes], url: str, timeout_s: float, log_path: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"server exited with code {proc.returncode} before it was ready:\n{tail}")
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server not healthy at {url} after {timeout_s:.0f} s (log: {log_path})")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    # The server runs in its own session: signal its process group so helper processes stop with it.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def ensure_llama_server(isa: str = "native") -> Path | None:
    """The llama-server binary for `isa`, built from the llama-cpp-python sdist if needed; None (with a message)
    if not."""
    binary = llama_server_path(isa)
    if binary.exists():
        return binary
    if shutil.which("cmake") is None:
        logger.warning(
            "llama.cpp skipped: llama-server is not built and cmake is missing "
            "(apt-get install -y cmake build-essential, then scripts/build_llama_cpp.sh)"
        )
        return None
    logger.info("building llama-server for %s (a few minutes): %s", isa, BUILD_SCRIPT)
    env = {**os.environ, "PYTHON": sys.executable, "LLAMA_CPP_ISA": isa}
    if (
        subprocess.run(["bash", str(BUILD_SCRIPT)], check=False, cwd=ROOT, env=env).returncode != 0
        or not binary.exists()
    ):
        logger.warning("llama.cpp skipped: building llama-server failed")
        return None
    return binary


def kvserve_command(model: str, port: int, serve_args: Sequence[str] = ()) -> list[str]:
    return [sys.executable, "-m", "server", "serve", "--model", model, "--port", str(port), *serve_args]


def llama_server_command(binary: Path, gguf: Path, port: int, parallel: int = 32) -> list[str]:
    # -kvu: one KV buffer shared by all slots, so a 512-token prompt fits although 8192 / 32 slots = 256
    # (kvserve's paged cache is shared the same way).
    return [
        str(binary),
        "-m",
        str(gguf),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-c",
        "8192",
        "-np",
        str(parallel),
        "-kvu",
    ]


def python_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def run_json_program(module: str, args: Sequence[str], *, sample_memory: bool = False) -> tuple[Any, float | None]:
    """Run `python -m module ARGS` (its log and progress go to this terminal) and parse its stdout as JSON.

    Returns the parsed output and, with `sample_memory`, the peak RSS in MiB of the program's process tree.
    """
    cmd = [sys.executable, "-m", module, *args]
    logger.info("running: %s", " ".join(cmd))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, cwd=ROOT, env=python_env())
    with MemorySampler(proc.pid if sample_memory else None) as sampler:
        stdout, _ = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"{module} exited with code {proc.returncode}")
    try:
        return json.loads(stdout), sampler.peak_rss_mib
    except ValueError as exc:
        raise RuntimeError(f"{module} printed no JSON: {stdout[-500:]!r}") from exc


def resolve_gguf(model: str) -> Path:
    """The model's GGUF file, as the engine's model cache resolves it."""
    cmd = [sys.executable, "-m", "engine.bench.gguf_file", model]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT, env=python_env(), check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"cannot find the GGUF of {model} (exit code {proc.returncode})")
    return Path(proc.stdout.strip())
