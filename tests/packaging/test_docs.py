"""The documentation site (mkdocs.yml, docs/) builds with --strict: every page is in the navigation and every
link and anchor resolves. The README stays a front door whose links into the docs lead somewhere."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_docs_build_strict(tmp_path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (tmp_path / "site" / "serving" / "configuration" / "index.html").is_file()


def test_the_readme_is_short_and_its_links_into_the_repository_resolve() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 220, "the README is the front door: the manual lives in docs/"
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    local = [target for target in targets if not re.match(r"[a-z]+:", target)]
    assert any(target.startswith("docs/") for target in local)
    missing = [target for target in local if not (ROOT / target).exists()]
    assert not missing, missing
