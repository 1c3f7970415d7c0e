"""pyproject.toml and the Makefile: what `make install` / `make test` rely on."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_console_script_points_at_the_cli() -> None:
    target = PYPROJECT["project"]["scripts"]["kvserve"]
    module_name, _, func_name = target.partition(":")
    assert callable(getattr(importlib.import_module(module_name), func_name))


def test_every_dependency_is_bounded_and_explained() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    deps = PYPROJECT["project"]["dependencies"] + [
        d for ds in PYPROJECT["project"]["optional-dependencies"].values() for d in ds
    ]
    for dep in deps:
        operators = {spec.operator for spec in Requirement(dep).specifier}
        assert ">=" in operators and "<" in operators, f"{dep}: needs a lower and an upper bound"
        # a comment says why: on the line above, or above a run of requirements sharing it
        lines_before = [line.strip() for line in text.split(f'"{dep}"')[0].rstrip().splitlines()]
        reason = next(line for line in reversed(lines_before) if not line.startswith('"'))
        assert reason.startswith("#"), f"{dep}: no reason given"
    torch = next(Requirement(d) for d in PYPROJECT["project"]["dependencies"] if d.startswith("torch"))
    assert torch.specifier.contains("2.13.0")  # the pinned CPU wheel the Makefile installs satisfies the range


def test_packages_found_include_every_top_level_package() -> None:
    include = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    for package in ("engine", "server", "clients"):
        assert (ROOT / package / "__init__.py").is_file()
        assert package in include and f"{package}.*" in include


def test_package_data_holds_every_playground_file() -> None:
    """The page works from an installed wheel: every file the server serves is package data."""
    from fnmatch import fnmatch

    patterns = PYPROJECT["tool"]["setuptools"]["package-data"]["server"]
    folder = ROOT / "server" / "playground"
    served = [
        p for p in folder.rglob("*") if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts
    ]
    assert any(p.name == "index.html" for p in served) and any(p.name == "login.html" for p in served)
    for path in served:
        relative = path.relative_to(ROOT / "server").as_posix()
        assert any(fnmatch(relative, pattern) for pattern in patterns), relative


def test_gpu_tests_are_deselected_by_default() -> None:
    options = PYPROJECT["tool"]["pytest"]["ini_options"]
    assert "-m 'not gpu'" in options["addopts"]
    assert any(m.startswith("gpu:") for m in options["markers"])


def _make_dry_run(target: str) -> list[str]:
    proc = subprocess.run(
        ["make", "--no-print-directory", "-n", "-B", "-C", str(ROOT), target],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def test_make_test_installs_the_locks_pulls_then_runs_pytest() -> None:
    lines = _make_dry_run("test")
    torch_at = next(i for i, line in enumerate(lines) if "pip install" in line and "'torch==2.13.0'" in line)
    runtime_at = next(
        i for i, line in enumerate(lines) if "pip install" in line and "-r deploy/requirements.lock" in line
    )
    dev_at = next(
        i for i, line in enumerate(lines) if "pip install" in line and "-r deploy/requirements-dev.lock" in line
    )
    package_at = next(i for i, line in enumerate(lines) if "pip install" in line and "-e '.[dev]'" in line)
    pull_at = next(i for i, line in enumerate(lines) if "kvserve pull" in line)
    pytest_at = next(i for i, line in enumerate(lines) if re.search(r"python -m pytest", line))
    # torch first: the CPU wheel, never a CUDA build
    assert torch_at < runtime_at < dev_at < package_at < pull_at < pytest_at


def test_make_serve_installs_the_runtime_lock_only() -> None:
    lines = _make_dry_run("serve")
    installs = [line for line in lines if "pip install" in line]
    assert any("-r deploy/requirements.lock" in line for line in installs)
    assert not any("requirements-dev.lock" in line or "[dev]" in line for line in installs), installs
    assert any("--no-deps -e '.'" in line for line in installs)  # kvserve itself, nothing left to resolve
    assert "kvserve serve" in lines[-1]


def test_make_test_fast_deselects_the_slow_tests() -> None:
    pytest_line = next(line for line in _make_dry_run("test-fast") if "python -m pytest" in line)
    assert "-m 'not slow and not gpu'" in pytest_line
    markers = PYPROJECT["tool"]["pytest"]["ini_options"]["markers"]
    assert any(marker.startswith("slow:") for marker in markers)


def test_ci_runs_make_test() -> None:
    script = (ROOT / ".ci" / "run").read_text()
    assert script.startswith("#!/usr/bin/env bash") and "set -euo pipefail" in script
    assert re.search(r"^make test$", script, re.MULTILINE)


def test_python_m_server_is_the_cli() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "server", "--help"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0
    for command in ("serve", "pull", "models", "chat", "bench"):
        assert command in proc.stdout


def test_serve_asks_for_huge_pages_before_torch_is_imported_and_keeps_a_value_already_set() -> None:
    """torch's CPU allocator reads THP_MEM_ALLOC_ENABLE once, at its first allocation: `kvserve serve` sets it
    before the server (and torch) is imported, and leaves a value the environment gives."""
    code = (
        "import os, sys; from server.__main__ import build_parser; assert 'torch' not in sys.modules; "
        "build_parser(['serve']); print(os.environ.get('THP_MEM_ALLOC_ENABLE'), 'torch' in sys.modules)"
    )
    for preset, expected in ((None, "1 True"), ("0", "0 True")):
        env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
        if preset is not None:
            env["THP_MEM_ALLOC_ENABLE"] = preset
        proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split() == expected.split()


def test_readme_starts_with_the_two_commands_and_the_configuration_page_lists_every_serve_flag() -> None:
    import argparse

    from server import cli

    readme = (ROOT / "README.md").read_text()
    first_block = readme.split("```bash", 1)[1].split("```", 1)[0]
    assert [line.split()[0:2] for line in first_block.strip().splitlines()] == [["make", "serve"], ["make", "test"]]
    page = (ROOT / "docs" / "serving" / "configuration.md").read_text()
    parser = argparse.ArgumentParser(add_help=False)
    cli.add_arguments(parser)
    flags = [(opt, action.dest) for action in parser._actions for opt in action.option_strings if opt.startswith("--")]
    assert len(flags) > 20
    for flag, dest in flags:
        if flag[2:].replace("-", "_") != dest:  # a shorthand for another flag (--no-playground): no variable of its own
            assert f"| `{flag}` | |" in page, f"the configuration page's flag table lacks {flag}"
            continue
        env = "KVSERVE_" + flag[2:].replace("-", "_").upper()
        assert f"| `{flag}` | `{env}` |" in page, f"the configuration page's flag table lacks {flag}"
