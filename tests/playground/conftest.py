"""Fixtures for the playground's browser tests: one real server and one headless Chromium per module,
a fresh page per test (with its console errors collected), and where screenshots go."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.support.server_harness import REPO_ROOT, ServerProcess

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
VIEWPORT = {"width": 1366, "height": 860}


def _unavailable(reason: str) -> None:
    """Skip the module, or fail it when KVSERVE_REQUIRE_BROWSER=1 (CI) asks for the browser tests to run."""
    if os.environ.get("KVSERVE_REQUIRE_BROWSER") == "1":
        pytest.fail(f"KVSERVE_REQUIRE_BROWSER=1 but {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def screenshot_dir() -> Path:
    folder = Path(os.environ.get("KVSERVE_SCREENSHOT_DIR") or REPO_ROOT / "build" / "screenshots")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("playwright is not installed (pip install playwright)")
    if not CHROMIUM.exists() or shutil.which(str(CHROMIUM)) is None:
        _unavailable(f"no Chromium at {CHROMIUM} (apt-get install chromium)")
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The real default models behind `python -m server.cli`, playground on (the default)."""
    from engine.hub import models_hub

    if not models_hub.is_cached(models_hub.DEFAULT_GENERATION_MODEL):
        pytest.skip(f"{models_hub.DEFAULT_GENERATION_MODEL} is not in the local cache (kvserve pull)")
    log = tmp_path_factory.mktemp("playground-server") / "server.log"
    srv = ServerProcess(["--max-model-len", "1024"], log)
    try:
        srv.wait_ready(timeout=300)
    except BaseException:
        srv.kill()
        print(srv.log()[-4000:])
        raise
    try:
        yield srv
    finally:
        srv.terminate()
        try:
            srv.wait(30)
        except Exception:
            srv.kill()


@dataclass
class PageErrors:
    """Console errors and uncaught exceptions a page reported."""

    messages: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.messages)


@pytest.fixture
def page(browser: Any, server: ServerProcess) -> Iterator[Any]:
    """A fresh page (own context) on the server's playground; `page.errors` collects what it reports."""
    context = browser.new_context(viewport=VIEWPORT, base_url=server.base_url)
    tab = context.new_page()
    errors = PageErrors()
    tab.on("console", lambda msg: errors.messages.append(f"console: {msg.text}") if msg.type == "error" else None)
    tab.on("pageerror", lambda exc: errors.messages.append(f"pageerror: {exc}"))
    tab.errors = errors
    tab.set_default_timeout(30_000)
    try:
        yield tab
    finally:
        context.close()
