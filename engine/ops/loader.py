"""Build a kernel's C source into a shared library once, cache it, load it with ctypes.

Every op module in engine/ops binds its C functions the same way (`bind`) and
offers the same surface: the torch path, the native path, and `available()`.
`KVSERVE_NATIVE_KERNELS=0` (read when a library is first loaded) turns every
native kernel off.

Each kernel is built for the AVX2 baseline and, where the compiler can, for the
instruction sets that make some of its loops shorter (ISA_BUILDS: VNNI's one-instruction
int8 dot products); the loader takes the best build this CPU runs, falling back to the
baseline where that build cannot be made. `KVSERVE_NATIVE_ISA=avx2` (or another
ISA_BUILDS name the CPU has) picks one instead.

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
from engine.ops.cpu_features import cpu_features

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent
CFLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC", "-std=c11")
DISABLE_ENV = "KVSERVE_NATIVE_KERNELS"
ISA_ENV = "KVSERVE_NATIVE_ISA"
BASELINE_ISA = "avx2"
# Build name -> (compiler flags added to CFLAGS, the CPU features it needs), from the least preferred: the AVX
# encoding of VNNI is preferred to AVX-512's (the same 256-bit instruction, without letting the compiler
# use AVX-512 elsewhere).
ISA_BUILDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    BASELINE_ISA: ((), ("avx2", "fma", "f16c")),
    "avx512vnni": (("-mavx512f", "-mavx512vl", "-mavx512vnni"), ("avx512f", "avx512vl", "avx512_vnni")),
    "avxvnni": (("-mavxvnni",), ("avx_vnni",)),
}
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


def _runs_here(isa: str) -> bool:
    return all(feature in cpu_features() for feature in ISA_BUILDS[isa][1])


@functools.cache
def chosen_isa() -> str:
    """The ISA_BUILDS entry the kernels load: KVSERVE_NATIVE_ISA's where this CPU runs it, else the best it runs."""
    asked = os.environ.get(ISA_ENV)
    if asked:
        if asked in ISA_BUILDS and _runs_here(asked):
            return asked
        logger.warning("%s=%s is not a build this CPU runs (%s); choosing one", ISA_ENV, asked, ", ".join(ISA_BUILDS))
    return [isa for isa in ISA_BUILDS if isa == BASELINE_ISA or _runs_here(isa)][-1]


def avx512_kernels_allowed() -> bool:
    """Whether KVSERVE_NATIVE_ISA leaves the kernels that use 512-bit registers on (the register-tiled GGUF
    products): unset, or naming the avx512vnni build. Naming a 256-bit build keeps every product in it."""
    return os.environ.get(ISA_ENV, "") in ("", "avx512vnni")


def build_flags(isa: str) -> tuple[str, ...]:
    return (*CFLAGS, *ISA_BUILDS[isa][0])


def library_path(name: str, isa: str | None = None) -> Path:
    """Where the `isa` build (default: `chosen_isa()`) of `engine/ops/<name>.c` is cached: keyed by the
    sources and flags. Every .c file counts, because a kernel may #include another.
    """
    isa = isa or chosen_isa()
    flags = build_flags(isa)
    sources = [SOURCE_DIR / f"{name}.c", *sorted(SOURCE_DIR.glob("*.c"))]
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sources) + " ".join(flags).encode()).hexdigest()[:16]
    suffix = "" if flags == CFLAGS else f"-{isa}"
    return kvserve_home() / "kernels" / f"{name}{suffix}-{digest}.so"


def _build(source: Path, target: Path, flags: tuple[str, ...]) -> None:
    compiler = os.environ.get("CC", "gcc")
    if shutil.which(compiler) is None:
        raise KernelUnavailable(f"no C compiler to build it ({compiler!r} is not on PATH)")
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent builders never see half a file.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        command = [compiler, *flags, "-o", str(built), str(source)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise KernelUnavailable(f"{' '.join(command)} failed:\n{result.stderr.strip()}")
        os.replace(built, target)
    logger.info("built native kernel %s", target)


def _built(name: str, isa: str) -> Path:
    """The `isa` build of `engine/ops/<name>.c`, compiled unless cached (a cached build needs no compiler,
    e.g. in a slim runtime image)."""
    target = library_path(name, isa)
    if not target.exists():
        _build(SOURCE_DIR / f"{name}.c", target, build_flags(isa))
    return target


def _load_build(name: str, isa: str) -> ctypes.CDLL:
    target = _built(name, isa)
    try:
        return ctypes.CDLL(str(target))
    except OSError as error:
        raise KernelUnavailable(str(error)) from error


@functools.cache
def _load(name: str) -> ctypes.CDLL | KernelUnavailable:
    """The compiled `engine/ops/<name>.c`, or why it cannot be used (logged once per library): the chosen
    ISA build, else the AVX2 baseline (a compiler too old for the chosen one's flags, an image built without it)."""
    try:
        _check_machine()
        isa = chosen_isa()
        if isa != BASELINE_ISA:
            try:
                return _load_build(name, isa)
            except KernelUnavailable as error:
                logger.warning("native kernel %s: no %s build (%s); using the %s one", name, isa, error, BASELINE_ISA)
        return _load_build(name, BASELINE_ISA)
    except KernelUnavailable as error:
        problem = error
    logger.warning("native kernel %s unavailable, using the torch reference: %s", name, problem)
    return problem


def prebuild(name: str) -> list[Path]:
    """Builds every ISA_BUILDS variant of `engine/ops/<name>.c` the compiler can make, whatever this CPU
    runs (an image's kernels stage: the machine that runs the image picks its own); returns the files."""
    built = []
    for isa in ISA_BUILDS:
        try:
            built.append(_built(name, isa))
        except KernelUnavailable as error:
            logger.warning("native kernel %s: no %s build: %s", name, isa, error)
    return built


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
