"""The playground behind --api-key, in the browser: the sign-in page checks the key with the server, which
answers with an HttpOnly cookie that opens the page; the page keeps the key in its origin's storage and
every call it makes carries it (a tiny llama serves it, so no default model is needed)."""

from __future__ import annotations

import pytest

from server.app import create_app
from tests.support.server_harness import ServerThread, make_server_config

pytestmark = pytest.mark.slow

KEY = "sekret/key with spaces"


def test_sign_in_then_the_page_calls_the_api_with_the_key(browser, tiny_llama_dir, screenshot_dir):
    config = make_server_config(tiny_llama_dir, api_key=KEY)
    with ServerThread(create_app(config)) as srv:
        context = browser.new_context(base_url=srv.base_url)
        page = context.new_page()
        try:
            first = page.goto("/")
            assert first is not None and first.status == 401
            page.fill("#key", "not the key")
            page.click("button[type=submit]")
            page.wait_for_selector("#problem:not([hidden])")
            assert "not this server's key" in page.inner_text("#problem")
            assert context.cookies() == []

            page.fill("#key", KEY)
            with page.expect_navigation():
                page.click("button[type=submit]")
            page.wait_for_function("window.playground && window.playground.ready === true")
            page.wait_for_function("document.getElementById('models').textContent.includes('tiny-llama')")
            page.click("#tab-kv")
            page.wait_for_function("window.playground.kv && window.playground.kv.object === 'kv_cache'")
            page.screenshot(path=str(screenshot_dir / "signed-in-kv.png"))
            (cookie,) = context.cookies()
            assert cookie["name"] == "kvserve_playground" and KEY not in cookie["value"]
            assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
            assert page.evaluate("document.cookie") == ""  # no script can read it
            assert page.evaluate("localStorage.getItem('kvserve_api_key')") == KEY
        finally:
            context.close()
        # A cookie that is not the server's gets the sign-in page again, not the playground.
        context = browser.new_context(base_url=srv.base_url)
        context.add_cookies([{"name": "kvserve_playground", "value": "wrong", "url": srv.base_url}])
        page = context.new_page()
        try:
            again = page.goto("/")
            assert again is not None and again.status == 401
            assert page.locator("#key").is_visible()
        finally:
            context.close()
