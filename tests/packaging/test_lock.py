"""deploy/requirements.lock (and requirements-ray.lock, the same plus the `ray` extra): the pinned runtime
dependencies that `make install` and the image both install; requirements-dev.lock: the same plus the test
bench (the `dev` extra), which `make test` installs.

The lock is made by `make lock` (pip-compile); these tests keep it true without a network: every
dependency pyproject.toml declares is pinned inside its range, torch is left to the Makefile's and
the Dockerfile's own pin (CPU or CUDA wheel), the build backend is pinned for the image's offline
install of kvserve itself, and the environment the tests run in has exactly the locked versions.
"""

from __future__ import annotations

import importlib.metadata
import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "deploy" / "requirements.lock"
RAY_LOCK = ROOT / "deploy" / "requirements-ray.lock"
DEV_LOCK = ROOT / "deploy" / "requirements-dev.lock"
# Pinned for the image's offline install of kvserve itself; a developer venv keeps whatever `venv` gave it.
BUILD_TOOLS = frozenset({"setuptools", "wheel", "pip"})


def read_lock(path: Path = LOCK) -> dict[str, Version]:
    pins: dict[str, Version] = {}
    for line in path.read_text().splitlines():
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", line.strip())
        if match:
            pins[canonicalize_name(match.group(1))] = Version(match.group(2))
    return pins


@pytest.fixture(scope="module")
def pins() -> dict[str, Version]:
    return read_lock()


@pytest.fixture(scope="module")
def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_runtime_dependency_is_pinned_inside_its_range(pins, pyproject) -> None:
    for text in pyproject["project"]["dependencies"]:
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        if name == "torch":
            continue
        assert name in pins, f"{name} is a dependency but not in the lock: run `make lock`"
        assert requirement.specifier.contains(pins[name], prereleases=True), (
            f"the lock pins {name}=={pins[name]}, outside pyproject's {requirement.specifier}: run `make lock`"
        )


def test_torch_is_left_to_the_install_pin(pins) -> None:
    # The Makefile installs torch==2.13.0 first (the CPU wheel); the Dockerfile picks the CPU or CUDA build.
    assert "torch" not in pins
    assert "# torch" in LOCK.read_text()  # pip-compile names it as left out, with what required it


def test_the_build_backend_is_pinned_for_the_offline_editable_install(pins, pyproject) -> None:
    for text in pyproject["build-system"]["requires"]:
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        assert name in pins and requirement.specifier.contains(pins[name])


def test_the_ray_lock_adds_the_ray_extra_to_the_same_versions(pins, pyproject) -> None:
    ray_pins = read_lock(RAY_LOCK)
    assert {name: ray_pins.get(name) for name in pins} == pins  # generated with the runtime lock as a constraint
    for text in pyproject["project"]["optional-dependencies"]["ray"]:
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        assert name in ray_pins and requirement.specifier.contains(ray_pins[name]), name
    assert "torch" not in ray_pins


def test_the_dev_lock_adds_the_dev_extra_to_the_same_versions(pins, pyproject) -> None:
    ray_pins = read_lock(RAY_LOCK)
    dev_pins = read_lock(DEV_LOCK)
    assert {name: dev_pins.get(name) for name in ray_pins} == ray_pins  # both locks above were its constraints
    for text in pyproject["project"]["optional-dependencies"]["dev"]:
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        assert name in dev_pins, f"{name} is a dev dependency but not in the dev lock: run `make lock`"
        assert requirement.specifier.contains(dev_pins[name], prereleases=True), name
    assert "torch" not in dev_pins


def test_the_tests_run_on_the_locked_versions(pins) -> None:
    """`make test` installs exactly the locks: what passes here is what the image runs."""
    differ = {}
    for name, version in {**read_lock(DEV_LOCK), **read_lock(RAY_LOCK), **pins}.items():
        if name in BUILD_TOOLS:
            continue
        try:
            installed = Version(importlib.metadata.version(name))
        except importlib.metadata.PackageNotFoundError:
            differ[name] = (str(version), None)
            continue
        if installed != version:
            differ[name] = (str(version), str(installed))
    assert not differ, f"installed versions differ from the locks (locked, installed): {differ}"


def test_read_lock_reads_pins_and_skips_comments(tmp_path) -> None:
    lock = tmp_path / "x.lock"
    lock.write_text("# header\nfastapi==0.165.0\n    # via kvserve\nPyYAML==6.0.4\n# torch\n")
    assert read_lock(lock) == {"fastapi": Version("0.165.0"), "pyyaml": Version("6.0.4")}
