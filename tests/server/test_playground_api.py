"""The playground's routes on a tiny llama: GET / and its assets, POST /attention against transformers,
GET /kv_cache while a request runs and after it ends, --no-playground, and the page behind --api-key."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from server.app import create_app
from server.playground.auth import PAGE_COOKIE_MAX_AGE_S
from server.playground.protocol import MAX_ATTENTION_TOKENS, KVCacheResponse
from server.playground.routes import ASSETS
from server.state import state_of
from tests.support.server_harness import ServerThread, make_server_config
from tests.support.tiny_models import make_tiny_model

pytestmark = pytest.mark.slow

PROMPT = "The quick brown fox jumps over the lazy dog. A paged KV cache stores keys and values."


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with ServerThread(create_app(make_server_config(tiny_llama_dir, block_size=4))) as srv:
        yield srv


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32, attn_implementation="eager")


def _attention(server, **body) -> httpx.Response:
    return httpx.post(f"{server.base_url}/attention", json=body, timeout=60)


def test_page_and_assets_are_served_from_the_package(server):
    page = httpx.get(f"{server.base_url}/")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert "/playground/" in page.text  # its assets, by absolute path
    for name in ASSETS:
        asset = httpx.get(f"{server.base_url}/playground/{name}")
        assert asset.status_code == 200, name
        assert asset.content == ASSETS[name][0]
    script = next(name for name in ASSETS if name.endswith(".js"))
    assert httpx.get(f"{server.base_url}/playground/{script}").headers["content-type"].startswith("text/javascript")
    for missing in ("nope.js", "..%2Fapp.py", "%2E%2E%2F%2E%2E%2Fserver%2Fapp.py"):
        assert httpx.get(f"{server.base_url}/playground/{missing}").status_code == 404, missing


def test_attention_route_equals_transformers_output_attentions(server, reference):
    answer = _attention(server, prompt=PROMPT, layer=1, head=2)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    ids = body["token_ids"]
    assert len(body["tokens"]) == len(ids) > 10
    with torch.no_grad():
        attentions = reference(torch.tensor([ids]), output_attentions=True).attentions
    assert body["num_layers"] == len(attentions)
    assert body["num_heads"] == attentions[0].shape[1]
    weights = torch.tensor(body["weights"])
    torch.testing.assert_close(weights, attentions[1][0, 2], atol=2e-6, rtol=0)
    torch.testing.assert_close(weights, attentions[1][0, 2], atol=1e-12, rtol=1e-5)  # small weights too
    assert torch.equal(weights > 0, attentions[1][0, 2] > 0)  # exactly 0 where masked, and only there
    # Another head and the mean over heads reuse the same forward.
    mean = _attention(server, prompt=PROMPT, layer=0, head="mean").json()
    torch.testing.assert_close(torch.tensor(mean["weights"]), attentions[0][0].mean(0), atol=2e-6, rtol=0)
    assert body["sliding_window"] is None and body["num_sink_tokens"] == 0
    assert body["max_tokens"] == MAX_ATTENTION_TOKENS


def test_attention_window_and_sinks(server):
    ids = list(range(20, 40))
    body = _attention(server, token_ids=ids, sliding_window=4, num_sink_tokens=1, head=0).json()
    weights = torch.tensor(body["weights"])
    i = torch.arange(len(ids)).unsqueeze(1)
    j = torch.arange(len(ids)).unsqueeze(0)
    visible = (j <= i) & ((i - j < 4) | (j < 1))
    assert (weights[~visible] == 0).all() and (weights[visible] > 0).all()
    assert (body["sliding_window"], body["num_sink_tokens"]) == (4, 1)
    # No window: sinks mean nothing and are reported as 0.
    causal = _attention(server, token_ids=ids, sliding_window=None, num_sink_tokens=3).json()
    assert (causal["sliding_window"], causal["num_sink_tokens"]) == (None, 0)


def test_a_mixed_window_model_shows_each_layers_own_mask(tmp_path):
    """Layer 0 attends to every key, layer 1 to a window of 4 (a tiny Qwen2 with max_window_layers 1); a
    request that names a window puts every layer under it."""
    mixed = make_tiny_model(tmp_path, "qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1)
    ids = list(range(20, 36))
    i = torch.arange(len(ids)).unsqueeze(1)
    j = torch.arange(len(ids)).unsqueeze(0)
    causal, windowed = j <= i, (j <= i) & (i - j < 4)
    with ServerThread(create_app(make_server_config(str(mixed)))) as srv:
        for layer, window, visible in ((0, None, causal), (1, 4, windowed)):
            body = _attention(srv, token_ids=ids, layer=layer, head=0).json()
            weights = torch.tensor(body["weights"])
            assert body["sliding_window"] == window
            assert (weights[~visible] == 0).all() and (weights[visible] > 0).all()
        full = _attention(srv, token_ids=ids, layer=1, head=0, sliding_window=None).json()
        assert full["sliding_window"] is None and (torch.tensor(full["weights"])[causal] > 0).all()


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"token_ids": list(range(MAX_ATTENTION_TOKENS + 1))}, "prompt"),
        ({"prompt": "x", "token_ids": [1]}, "prompt"),
        ({}, "prompt"),
        ({"token_ids": []}, "prompt"),
        ({"token_ids": [10**9]}, "token_ids"),
        ({"prompt": "hello", "layer": 99}, "layer"),
        ({"prompt": "hello", "head": 99}, "head"),
        ({"prompt": "hello", "head": "max"}, "head"),
        ({"prompt": "hello", "sliding_window": 0}, "sliding_window"),
        ({"prompt": "hello", "model": "other"}, "model"),
    ],
)
def test_attention_refuses_bad_requests(server, body, param):
    answer = _attention(server, **body)
    assert answer.status_code in (400, 404), answer.text
    error = answer.json()["error"]
    assert param in (error["param"] or "") + error["message"]
    if "token_ids" in body and len(body["token_ids"]) > MAX_ATTENTION_TOKENS:
        assert error["code"] == "context_length_exceeded"
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_attention_busy_is_429_and_a_cached_prompt_still_answers(server):
    view = state_of(server.app).attention_view
    assert _attention(server, token_ids=[5, 6, 7]).status_code == 200
    view.is_running = True  # as while another request's forward runs
    try:
        busy = _attention(server, token_ids=[5, 6, 8])
        assert busy.status_code == 429
        assert busy.json()["error"]["code"] == "attention_busy"
        assert busy.headers["retry-after"] == "1"
        assert _attention(server, token_ids=[5, 6, 7], layer=1).status_code == 200  # the kept forward
    finally:
        view.is_running = False


def test_hang_up_during_a_forward_keeps_the_view_busy_until_it_ends(server):
    view = state_of(server.app).attention_view
    engine = state_of(server.app).engine
    release = threading.Event()
    original = engine.llm_engine.attention_weights

    def slow(*args):
        release.wait(10)
        return original(*args)

    engine.llm_engine.attention_weights = slow
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.base_url}/attention", json={"token_ids": [9, 9, 9]}, timeout=0.5)
        assert view.is_running  # the forward goes on without its client
        assert _attention(server, token_ids=[9, 9, 10]).status_code == 429
        release.set()
        deadline = time.monotonic() + 10
        while view.is_running and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not view.is_running
        assert view.kept[-1].token_ids == (9, 9, 9)
    finally:
        engine.llm_engine.attention_weights = original
        release.set()


def test_kv_cache_while_a_request_runs_and_after(server):
    url = server.base_url
    idle = httpx.get(f"{url}/kv_cache").json()
    assert idle["object"] == "kv_cache" and idle["num_running"] == 0 and idle["sequences"] == []
    assert len(idle["blocks"]) == idle["num_blocks"]
    counts = ("num_used_blocks", "num_cached_free_blocks", "num_free_blocks")
    assert sum(idle[c] for c in counts) == idle["num_blocks"]

    seen: list[dict] = []

    async def run() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 120, "min_tokens": 120, "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data:") and not seen:
                        seen.append((await client.get("/kv_cache")).json())

    asyncio.run(run())
    during = seen[0]
    assert during["num_running"] == 1 and len(during["sequences"]) == 1
    (seq,) = during["sequences"]
    assert seq["num_tokens"] > 10 and len(seq["block_table"]) == len(seq["shared"]) >= 3
    assert during["num_used_blocks"] >= len(seq["block_table"])
    assert all(during["blocks"][b - 1] in "us" for b in seq["block_table"])
    # Ids and counts only: nothing of the request's tokens or text.
    assert set(seq) == {"id", "num_tokens", "num_computed_tokens", "block_table", "shared", "groups"}
    # The tiny LLaMA's layers all attend alike: one attention group, whose table is the block table.
    assert [g["layers"] for g in during["attention_groups"]] == [[0, 1]]
    assert seq["groups"] == [{"block_table": seq["block_table"], "shared": seq["shared"]}]
    assert set(during) == set(KVCacheResponse.model_fields)
    after = httpx.get(f"{url}/kv_cache").json()
    assert after["num_used_blocks"] == 0 and after["sequences"] == []


def test_no_playground_turns_the_page_and_its_routes_off(tiny_llama_dir):
    with ServerThread(create_app(make_server_config(tiny_llama_dir, playground=False))) as srv:
        assert httpx.get(f"{srv.base_url}/").status_code == 405  # only POST / (TEI's embed) is left
        assert httpx.get(f"{srv.base_url}/playground/main.js").status_code == 404
        assert httpx.get(f"{srv.base_url}/kv_cache").status_code == 404
        assert httpx.post(f"{srv.base_url}/attention", json={"prompt": "hi"}).status_code == 404
        assert httpx.get(f"{srv.base_url}/v1/models").status_code == 200


def test_page_behind_api_key_signs_in_with_a_cookie_only_for_the_page(tiny_llama_dir):
    key = "sekret/key"
    with ServerThread(create_app(make_server_config(tiny_llama_dir, api_key=key))) as srv:
        url = srv.base_url
        sign_in_page = httpx.get(f"{url}/")
        assert sign_in_page.status_code == 401
        assert sign_in_page.headers["content-type"].startswith("text/html") and "API key" in sign_in_page.text
        assert httpx.post(f"{url}/playground/sign-in").status_code == 401
        assert httpx.post(f"{url}/playground/sign-in", headers={"Authorization": "Bearer wrong"}).status_code == 401
        signed_in = httpx.post(f"{url}/playground/sign-in", headers={"Authorization": f"Bearer {key}"})
        assert signed_in.status_code == 200 and signed_in.json() == {"signed_in": True}
        set_cookie = signed_in.headers["set-cookie"]
        assert "HttpOnly" in set_cookie and "SameSite=strict" in set_cookie and "Path=/" in set_cookie
        assert f"Max-Age={PAGE_COOKIE_MAX_AGE_S}" in set_cookie and "Secure" not in set_cookie  # over http
        token = signed_in.cookies["kvserve_playground"]
        assert key not in token and "sekret" not in token  # derived from the key, not the key
        cookie = {"Cookie": f"kvserve_playground={token}"}
        assert httpx.get(f"{url}/", headers=cookie).status_code == 200
        assert httpx.get(f"{url}/playground/api.js", headers=cookie).status_code == 200
        # Other cookies on the same host, even ones a strict parser refuses, do not hide it.
        noisy = {"Cookie": f'x={{"a":1}}; y=a b; kvserve_playground={token}; z=1'}
        assert httpx.get(f"{url}/", headers=noisy).status_code == 200
        assert httpx.get(f"{url}/", headers={"Cookie": "kvserve_playground=wrong"}).status_code == 401
        assert httpx.get(f"{url}/", headers={"Cookie": f"kvserve_playground={key}"}).status_code == 401
        assert httpx.get(f"{url}/", headers={"Authorization": f"Bearer {key}"}).status_code == 200
        # The cookie opens the page only: every API route (and any path that climbs out of /playground/)
        # still wants the header.
        for method, path in (
            ("GET", "/kv_cache"),
            ("GET", "/v1/models"),
            ("POST", "/attention"),
            ("POST", "/"),
            ("POST", "/playground/sign-in"),
            ("GET", "/metrics"),
        ):
            answer = httpx.request(method, f"{url}{path}", headers=cookie, json={"token_ids": [1]})
            assert answer.status_code == 401, path
            assert answer.json()["error"]["code"] == "invalid_api_key"
        for path in ("/playground/..%2Fv1%2Fmodels", "/playground/%2E%2E/kv_cache"):
            assert httpx.get(f"{url}{path}", headers=cookie).status_code == 404, path
        auth = {"Authorization": f"Bearer {key}"}
        assert httpx.get(f"{url}/kv_cache", headers=auth).status_code == 200


def test_no_playground_with_api_key_has_no_sign_in_page(tiny_llama_dir):
    config = make_server_config(tiny_llama_dir, api_key="k", playground=False)
    with ServerThread(create_app(config)) as srv:
        answer = httpx.get(f"{srv.base_url}/")
        assert answer.status_code == 401 and answer.json()["error"]["code"] == "invalid_api_key"
        assert (
            httpx.post(f"{srv.base_url}/playground/sign-in", headers={"Authorization": "Bearer k"}).status_code == 404
        )
