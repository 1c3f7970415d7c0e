"""Build a kernel's C source into a shared library once, cache it, load it with ctypes.

Every op module in engine/ops binds its C functions the same way (`bind`) and
offers the same surface: the torch path, the native path, and `available()`.
`KVSERVE_NATIVE_KERNELS=0` (read when a library is first loaded) turns every
native kernel off.

Why ctypes and not a torch C++ extension: the kernels are plain C over raw
pointers, so they compile in about a second with only gcc (no torch headers,
no ninja), and a fresh machine or container needs nothing beyond a compiler.
The library links libgomp; torch has already loaded its own copy under the
same soname, so both share one OpenMP thread pool.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine.hub.models_hub import kvserve_home

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent
CFLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC", "-std=c11")
DISABLE_ENV = "KVSERVE_NATIVE_KERNELS"
# The C types of the kernels' arguments: raw pointers to tensor data, and int64 sizes.
PTR = ctypes.c_void_p
I64 = ctypes.c_int64


class KernelUnavailable(RuntimeError):
    """Why a native kernel cannot be used on this machine."""


def _check_machine() -> None:
    if os.environ.get(DISABLE_ENV, "1") == "0":
        raise KernelUnavailable(f"{DISABLE_ENV}=0")
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        raise KernelUnavailable(f"the CPU lacks AVX2 (torch reports {capability})")


def library_path(name: str) -> Path:
    """Where the build of `engine/ops/<name>.c` is cached: keyed by the sources and flags.

    Every .c file counts, because a kernel may #include another.
    """
    sources = [SOURCE_DIR / f"{name}.c", *sorted(SOURCE_DIR.glob("*.c"))]
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sources) + " ".join(CFLAGS).encode()).hexdigest()[:16]
    return kvserve_home() / "kernels" / f"{name}-{digest}.so"


def _build(source: Path, target: Path) -> None:
    compiler = os.environ.get("CC", "gcc")
    if shutil.which(compiler) is None:
        raise KernelUnavailable(f"no C compiler to build it ({compiler!r} is not on PATH)")
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent builders never see half a file.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        command = [compiler, *CFLAGS, "-o", str(built), str(source)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise KernelUnavailable(f"{' '.join(command)} failed:\n{result.stderr.strip()}")
        os.replace(built, target)
    logger.info("built native kernel %s", target)


@functools.cache
def _load(name: str) -> ctypes.CDLL | KernelUnavailable:
    """The compiled `engine/ops/<name>.c`, or why it cannot be used (logged once per library)."""
    try:
        _check_machine()
        target = library_path(name)
        if not target.exists():  # a cached build needs no compiler (e.g. a slim runtime image)
            _build(SOURCE_DIR / f"{name}.c", target)
        return ctypes.CDLL(str(target))
    except KernelUnavailable as error:
        problem = error
    except OSError as error:
        problem = KernelUnavailable(str(error))
    logger.warning("native kernel %s unavailable, using the torch reference: %s", name, problem)
    return problem


def load_library(name: str) -> ctypes.CDLL | None:
    """The compiled `engine/ops/<name>.c`, built on first use, or None when it cannot be used."""
    loaded = _load(name)
    return loaded if isinstance(loaded, ctypes.CDLL) else None


def unavailable_reason(name: str) -> str | None:
    """Why `engine/ops/<name>.c` cannot be used on this machine, or None when it loads."""
    loaded = _load(name)
    return str(loaded) if isinstance(loaded, KernelUnavailable) else None


def bind(library: str, symbol: str, argtypes: list[Any], restype: Any) -> Callable[..., Any] | None:
    """`symbol` of the compiled `engine/ops/<library>.c` with its C signature, or None when it cannot be used.

    Every op module binds its kernels through this, once, in a `functools.cache`d `_kernel()`.
    """
    loaded = load_library(library)
    if loaded is None:
        return None
    function = getattr(loaded, symbol)
    function.argtypes = argtypes
    function.restype = restype
    return function
