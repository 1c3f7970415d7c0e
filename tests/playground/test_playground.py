"""The playground page in a real browser (headless Chromium through Playwright) against a real server with the
default models: every view loads without errors, a chat streams and stops, the attention heatmap shows the
causal and sliding-window masks (in its data and in its pixels), the KV view follows a running request,
embeddings pair same-topic sentences, and the page works from the keyboard."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.server_harness import ServerProcess

pytestmark = pytest.mark.slow

VIEWS = ("chat", "attention", "kv", "embeddings", "metrics")
WAIT_MS = 60_000  # generous: two cores run the server, its models and the browser together

# ~20 tokens, no window on the server's side unless the request asks for one
ATTENTION_PROMPT = "The old lighthouse keeper climbed the stairs every night to light the lamp for passing ships."

# The embedding view's own example sentences: pets at even lines, cooking at odd ones.
EMBEDDING_TOPICS = ["pets", "cooking", "pets", "cooking", "pets", "cooking"]


def open_page(page: Any, view: str = "chat") -> None:
    page.goto(f"/#{view}")
    page.wait_for_function("window.playground && window.playground.ready === true")
    page.wait_for_function("window.playground.models !== undefined", timeout=WAIT_MS)


def switch_to(page: Any, view: str) -> None:
    page.click(f"#tab-{view}")
    page.wait_for_function(f"!document.getElementById('view-{view}').hidden")


def screenshot(page: Any, folder: Path, name: str) -> None:
    page.screenshot(path=str(folder / f"{name}.png"), full_page=True)


def kv_snapshot(server: ServerProcess) -> dict:
    response = httpx.get(f"{server.base_url}/kv_cache", timeout=10)
    response.raise_for_status()
    return response.json()


def wait_kv_idle(server: ServerProcess, timeout: float = 30.0) -> dict:
    """The server's KV cache once no sequence runs and no block is in use."""
    deadline = time.monotonic() + timeout
    while True:
        snapshot = kv_snapshot(server)
        if snapshot["num_running"] == 0 and not snapshot["sequences"] and snapshot["num_used_blocks"] == 0:
            return snapshot
        if time.monotonic() > deadline:
            raise AssertionError(f"KV cache still busy after {timeout}s: {json.dumps(snapshot)[:400]}")
        time.sleep(0.2)


def run_attention(page: Any, *, apply_window: bool, window: int = 4, sinks: int = 1, compare: bool = False) -> dict:
    """Ask the attention view for ATTENTION_PROMPT (layer 0, mean over heads); returns what it drew."""
    switch_to(page, "attention")
    page.fill("#att-prompt", ATTENTION_PROMPT)
    page.select_option("#att-layer", "0")
    page.select_option("#att-head", "mean")
    page.fill("#att-window", str(window))
    page.fill("#att-sinks", str(sinks))
    page.set_checked("#att-apply", apply_window)
    page.set_checked("#att-compare", compare)
    page.click("#att-run")
    expected_window = window if (apply_window or compare) else None
    page.wait_for_function(
        """([prompt, win, compare]) => {
            const a = window.playground.attention;
            return window.playground.attentionState === "ready" && a && a.tokens.join("") === prompt
                && a.sliding_window === win && a.compare === compare;
        }""",
        arg=[ATTENTION_PROMPT, expected_window, compare],
        timeout=WAIT_MS,
    )
    return page.evaluate("window.playground.attention")


# Colours of every cell's centre pixel on an attention canvas: {masked: [[i, j, rgb]], unmasked: [...]}
# by the drawn data (exact zero or not), plus the masked colours the heatmap draws with.
CELL_PIXELS_JS = """async (canvasId) => {
    const m = await import("/playground/heatmap.js");
    const a = window.playground.attention.maps.find((x) => x.canvas === canvasId);
    const canvas = document.getElementById(canvasId);
    const ctx = canvas.getContext("2d");
    const dpr = canvas.width / parseFloat(canvas.style.width);
    const {left, top, cell} = a.layout;
    const out = {masked: [], unmasked: [], mask_colors: [m.MASK_FILL, m.MASK_HATCH]};
    a.weights.forEach((row, i) => row.forEach((w, j) => {
        const x = Math.floor((left + (j + 0.5) * cell) * dpr);
        const y = Math.floor((top + (i + 0.5) * cell) * dpr);
        const px = Array.from(ctx.getImageData(x, y, 1, 1).data.slice(0, 3));
        (w === 0 ? out.masked : out.unmasked).push([i, j, px]);
    }));
    return out;
}"""


def is_mask_color(rgb: list[int], mask_colors: list[list[int]]) -> bool:
    return any(all(abs(a - b) <= 2 for a, b in zip(rgb, color, strict=True)) for color in mask_colors)


def test_page_loads_without_errors(page: Any, screenshot_dir: Path) -> None:
    open_page(page)
    paint = page.evaluate("performance.getEntriesByType('paint').map((e) => [e.name, e.startTime])")
    print(f"paint timings (ms): {paint}")
    assert page.evaluate("document.querySelectorAll('[role=tablist] > button[role=tab]').length") == len(VIEWS)
    waits = {
        "attention": "window.playground.attentionState === 'ready'",
        "kv": "(window.playground.kvPolls || 0) >= 2",
        "embeddings": "window.playground.embeddingsState === 'ready'",
        "metrics": "window.playground.metrics && window.playground.metrics.samples.length >= 2",
    }
    for view in VIEWS:
        switch_to(page, view)
        assert page.get_attribute(f"#tab-{view}", "aria-selected") == "true"
        if view in waits:
            page.wait_for_function(waits[view], timeout=WAIT_MS)
        screenshot(page, screenshot_dir, f"view-{view}")
    assert not page.errors, page.errors.messages


def test_chat_streams_and_stops(page: Any, server: ServerProcess, screenshot_dir: Path) -> None:
    open_page(page)
    page.fill("#p-max_tokens", "400")
    page.fill("#p-seed", "11")
    page.fill("#p-temperature", "0.3")
    page.fill("#chat-text", "Write a long story about a dragon who learns to bake bread.")
    # The metrics view's samples are differences between polls: the first poll must come before the reply, or
    # on a loaded machine the whole reply can fall before it and leave no interval that saw it.
    page.wait_for_function("window.playground.metrics && window.playground.metrics.samples.length > 0", timeout=WAIT_MS)
    page.click("#chat-send")
    page.wait_for_function("window.playground.chat.streaming && window.playground.chat.tokens > 0", timeout=WAIT_MS)

    counts = [page.evaluate("window.playground.chat.tokens")]
    deadline = time.monotonic() + 30
    while (len(set(counts)) < 3 or counts[-1] < 12) and time.monotonic() < deadline:
        time.sleep(0.05)
        counts.append(page.evaluate("window.playground.chat.tokens"))
    assert len(set(counts)) >= 3, f"the reply did not grow over several polls: {counts}"
    assert counts == sorted(counts)
    assert page.evaluate("window.playground.chat.streaming"), "the reply ended before it could be stopped"

    page.click("#chat-stop")
    page.wait_for_function("!window.playground.chat.streaming", timeout=10_000)
    chat = page.evaluate("window.playground.chat")
    assert chat["stopped"] and chat["error"] is None and chat["finish_reason"] is None
    stopped_at = chat["tokens"]
    assert 0 < stopped_at < 400
    spans = page.locator(".msg.assistant .tok").count()
    time.sleep(1.0)
    assert page.evaluate("window.playground.chat.tokens") == stopped_at
    assert page.locator(".msg.assistant .tok").count() == spans
    assert page.locator(".msg.assistant .stats").inner_text().count("stopped") == 1
    assert chat["messages"][-1]["role"] == "assistant" and chat["messages"][-1]["content"] == chat["text"]

    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
    wait_kv_idle(server)
    switch_to(page, "kv")
    page.wait_for_function(
        "window.playground.kv && window.playground.kv.num_running === 0 && window.playground.kv.sequences.length === 0",
        timeout=WAIT_MS,
    )
    switch_to(page, "metrics")
    page.wait_for_function(
        "window.playground.metrics.samples.some((s) => s.ttft_ms !== null && s.ttft_ms > 0)"
        " && window.playground.metrics.samples.some((s) => s.itl_ms !== null && s.itl_ms > 0)",
        timeout=WAIT_MS,
    )
    switch_to(page, "chat")
    page.hover(".msg.assistant .tok >> nth=1")
    page.wait_for_selector("#tooltip:not([hidden])")
    screenshot(page, screenshot_dir, "chat-stopped")
    assert not page.errors, page.errors.messages


def test_attention_is_causal(page: Any, screenshot_dir: Path) -> None:
    open_page(page, "attention")
    drawn = run_attention(page, apply_window=False)
    weights = drawn["weights"]
    n = len(drawn["tokens"])
    assert 15 <= n <= 30 and drawn["layer"] == 0 and drawn["head"] == "mean" and drawn["num_sink_tokens"] == 0
    assert len(weights) == n and all(len(row) == n for row in weights)
    for i, row in enumerate(weights):
        assert all(w == 0.0 for w in row[i + 1 :]), f"row {i} attends to a later token"
        assert all(w > 0.0 for w in row[: i + 1]), f"row {i} has a zero weight on or below the diagonal"
        assert sum(row) == pytest.approx(1.0, abs=1e-3)

    pixels = page.evaluate(CELL_PIXELS_JS, "att-canvas-0")
    mask_colors = pixels["mask_colors"]
    assert len(pixels["masked"]) == n * (n - 1) // 2
    wrong = [(i, j, px) for i, j, px in pixels["masked"] if not is_mask_color(px, mask_colors)]
    assert not wrong, f"cells above the diagonal not drawn masked: {wrong[:5]}"
    wrong = [(i, j, px) for i, j, px in pixels["unmasked"] if is_mask_color(px, mask_colors)]
    assert not wrong, f"non-zero weights drawn in the masked colour: {wrong[:5]}"

    layout = drawn["layout"]
    page.click("#att-canvas-0", position={"x": layout["left"] + 3, "y": layout["top"] + 5.5 * layout["cell"]})
    page.wait_for_function("window.playground.attention.selected_row === 5")
    assert page.locator("#att-row > .tokens > span").count() == n
    screenshot(page, screenshot_dir, "attention-causal")
    assert not page.errors, page.errors.messages


def test_attention_sliding_window_and_compare(page: Any, screenshot_dir: Path) -> None:
    open_page(page, "attention")
    window, sinks = 4, 1
    drawn = run_attention(page, apply_window=True, window=window, sinks=sinks)
    assert drawn["num_sink_tokens"] == sinks and not drawn["compare"]
    for i, row in enumerate(drawn["weights"]):
        for j, w in enumerate(row):
            inside = j <= i and (i - j < window or j < sinks)
            assert (w > 0.0) if inside else (w == 0.0), f"weight[{i}][{j}] = {w}"
        assert sum(row) == pytest.approx(1.0, abs=1e-3)
    pixels = page.evaluate(CELL_PIXELS_JS, "att-canvas-0")
    assert all(is_mask_color(px, pixels["mask_colors"]) for _, _, px in pixels["masked"])

    drawn = run_attention(page, apply_window=True, window=window, sinks=sinks, compare=True)
    without, with_window = drawn["maps"]
    assert without["sliding_window"] is None and with_window["sliding_window"] == window
    assert with_window["num_sink_tokens"] == sinks
    n = len(without["tokens"])
    assert all(without["weights"][i][j] > 0 for i in range(n) for j in range(i + 1))
    assert with_window["weights"] == drawn["weights"]
    for canvas in ("#att-canvas-0", "#att-canvas-1"):
        box = page.locator(canvas).bounding_box()
        assert box and box["width"] > 100 and box["height"] > 100, canvas
    left = page.locator("#att-canvas-0").bounding_box()
    right = page.locator("#att-canvas-1").bounding_box()
    assert right["x"] >= left["x"] + left["width"], "the two heatmaps are not side by side"
    screenshot(page, screenshot_dir, "attention-compare")
    assert not page.errors, page.errors.messages


def test_kv_view_follows_a_request(page: Any, server: ServerProcess, screenshot_dir: Path) -> None:
    wait_kv_idle(server)
    open_page(page, "kv")
    page.wait_for_function("(window.playground.kvPolls || 0) >= 1", timeout=WAIT_MS)
    body = {
        "model": page.evaluate("window.playground.models.generate"),
        "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}],
        "max_tokens": 300,
        "seed": 5,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        page.wait_for_function(
            """() => {
                const kv = window.playground.kv;
                return kv && kv.num_used_blocks > 0 && kv.sequences.length >= 1
                    && document.querySelectorAll("#kv-seqs .seq:not(.gone) .blk").length >= 1;
            }""",
            timeout=WAIT_MS,
        )
        kv = page.evaluate("window.playground.kv")
        assert kv["blocks"].count("u") + kv["blocks"].count("s") == kv["num_used_blocks"]
        assert page.locator("#kv-cards .card").count() >= 4
        screenshot(page, screenshot_dir, "kv-running")
    # leaving the block hangs up: the server aborts the request and frees its blocks
    page.wait_for_function(
        """() => {
            const kv = window.playground.kv;
            return kv && kv.num_used_blocks === 0 && kv.sequences.length === 0
                && document.querySelectorAll("#kv-seqs .seq").length === 0;
        }""",
        timeout=WAIT_MS,
    )
    screenshot(page, screenshot_dir, "kv-idle")
    assert not page.errors, page.errors.messages


def test_embeddings_pair_same_topic(page: Any, screenshot_dir: Path) -> None:
    open_page(page, "embeddings")
    page.wait_for_function("window.playground.embeddingsState === 'ready'", timeout=WAIT_MS)
    drawn = page.evaluate("window.playground.embeddings")
    sentences, matrix = drawn["sentences"], drawn["matrix"]
    assert len(sentences) == len(EMBEDDING_TOPICS) == len(matrix)
    for i, row in enumerate(matrix):
        assert row[i] == pytest.approx(1.0, abs=1e-4)
        assert max(range(len(row)), key=row.__getitem__) == i
        assert row == pytest.approx([r[i] for r in matrix], abs=1e-6)  # symmetric
    for i, j in enumerate(drawn["neighbours"]):
        assert j != i and EMBEDDING_TOPICS[j] == EMBEDDING_TOPICS[i], f"{sentences[i]!r} -> {sentences[j]!r}"
    assert page.locator("#emb-nn li").count() == len(sentences)
    screenshot(page, screenshot_dir, "embeddings")
    assert not page.errors, page.errors.messages


def test_keyboard(page: Any, screenshot_dir: Path) -> None:
    open_page(page)
    focused_role = "document.activeElement && document.activeElement.getAttribute('role')"
    for _ in range(10):
        page.keyboard.press("Tab")
        if page.evaluate(focused_role) == "tab":
            break
    assert page.evaluate("document.activeElement.id") == "tab-chat"
    assert page.evaluate("getComputedStyle(document.activeElement).outlineStyle") != "none", "no visible focus"

    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.id") == "tab-attention"
    page.keyboard.press("Enter")
    page.wait_for_function("!document.getElementById('view-attention').hidden")
    assert page.get_attribute("#tab-attention", "aria-selected") == "true"
    assert page.evaluate("document.getElementById('view-chat').hidden")

    page.keyboard.press("ArrowRight")
    assert page.evaluate("document.activeElement.id") == "tab-kv"
    page.keyboard.press("Space")
    page.wait_for_function("!document.getElementById('view-kv').hidden")
    page.keyboard.press("Home")
    page.keyboard.press("Enter")
    page.wait_for_function("!document.getElementById('view-chat').hidden")

    page.fill("#p-max_tokens", "200")
    page.focus("#chat-text")
    page.keyboard.type("Name a colour.")
    page.keyboard.press("Shift+Enter")
    page.keyboard.type("Then name another one.")
    assert page.input_value("#chat-text") == "Name a colour.\nThen name another one."
    assert page.locator(".msg.user").count() == 0
    page.keyboard.press("Enter")
    page.wait_for_function("window.playground.chat.tokens > 0 || window.playground.chat.error", timeout=WAIT_MS)
    assert page.locator(".msg.user .body").inner_text() == "Name a colour.\nThen name another one."
    assert page.input_value("#chat-text") == ""
    page.keyboard.press("Escape")
    page.wait_for_function("!window.playground.chat.streaming", timeout=WAIT_MS)
    assert page.evaluate("window.playground.chat.error") is None
    screenshot(page, screenshot_dir, "keyboard-chat")
    assert not page.errors, page.errors.messages
