"""Admission bounds (400 request_too_large, never a 429 that cannot succeed), cache_salt
isolation through the HTTP API, and /metrics behind the API key."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.errors import InvalidRequestError
from engine.params import MAX_CACHE_SALT_CHARS, SamplingParams
from server.app import create_app
from server.config import ServerConfig
from server.openai.params import DEFAULT_COST_CONTEXTS
from server.state import state_of
from tests.support.server_harness import ServerThread, make_server_config
from tests.support.tiny_models import make_tiny_llama

MODEL = "tiny-llama"
API_KEY = "admission-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_QUEUED = 4
MAX_COST = 1000  # tokens; the server's context (max_model_len) is 256
SALTED_PROMPT = list(range(1, 41))  # two full 16-token blocks before the one holding the last token


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    config = make_server_config(model_dir, api_key=API_KEY, max_queued_requests=MAX_QUEUED, max_request_cost=MAX_COST)
    with ServerThread(create_app(config)) as srv:
        yield srv


def post(server, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}{route}", json={"model": MODEL, **body}, headers=AUTH, timeout=60)


def refused(response: httpx.Response, param: str) -> dict:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "request_too_large" and error["param"] == param, error
    return error


def chat(content: str, **fields) -> dict:
    return {"messages": [{"role": "user", "content": content}], **fields}


def prefix_cache_hits(server) -> float:
    text = httpx.get(f"{server.base_url}/metrics", headers=AUTH).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kvserve:prefix_cache_hits_total" and sample.labels.get("model_name") == MODEL:
                return sample.value
    raise AssertionError("no kvserve:prefix_cache_hits_total sample")


# ---- admission ----


def test_more_prompts_than_the_queue_holds_is_a_400_not_a_429(server):
    response = post(server, "/v1/completions", {"prompt": ["Hi"] * (MAX_QUEUED + 1), "max_tokens": 1})
    error = refused(response, "prompt")
    assert "--max-queued-requests" in error["message"] and str(MAX_QUEUED) in error["message"]
    assert "retry-after" not in response.headers
    full_queue = post(server, "/v1/completions", {"prompt": ["Hi"] * MAX_QUEUED, "max_tokens": 1})
    assert full_queue.status_code == 200, full_queue.text


def test_a_request_over_the_cost_cap_is_a_400_naming_the_flag(server):
    # 4 samples x (prompt + 250 tokens) > 1000.
    error = refused(post(server, "/v1/completions", {"prompt": "Hi", "n": 4, "max_tokens": 250}), "max_tokens")
    assert "--max-request-cost" in error["message"] and str(MAX_COST) in error["message"]
    refused(post(server, "/v1/completions", {"prompt": ["Hi", "Ho"], "n": 2, "max_tokens": 250}), "max_tokens")
    # Without max_tokens a sample may fill the context: 4 x 256 > 1000.
    error = refused(post(server, "/v1/chat/completions", chat("Hi", n=4)), "n")
    assert "--max-request-cost" in error["message"]
    refused(post(server, "/v1/chat/completions", chat("Hi", n=4, max_tokens=250, stream=True)), "max_tokens")


def test_ordinary_requests_under_the_caps_still_work(server):
    completion = post(server, "/v1/completions", {"prompt": ["Hi", "Ho"], "n": 2, "max_tokens": 4})
    assert completion.status_code == 200, completion.text
    assert len(completion.json()["choices"]) == 4
    answer = post(server, "/v1/chat/completions", chat("Hi", n=3, max_tokens=4))
    assert answer.status_code == 200, answer.text
    assert len(answer.json()["choices"]) == 3


def test_by_default_no_request_may_hold_more_tokens_than_the_kv_cache(tmp_path):
    """64 prompts x n=128 once held an 8-token request back for 22 s: now it is refused at once."""
    config = make_server_config(make_tiny_llama(tmp_path), max_num_seqs=64)
    assert config.max_request_cost is None
    with ServerThread(create_app(config)) as srv:
        engine = state_of(srv.app).engine
        capacity = max(engine.kv_cache_tokens, DEFAULT_COST_CONTEXTS * engine.max_model_len)
        assert 0 < capacity < 64 * 128 * 16
        body = {"model": MODEL, "prompt": ["Hello there"] * 64, "n": 128, "max_tokens": 16}
        response = httpx.post(f"{srv.base_url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["code"] == "request_too_large" and str(capacity) in error["message"]
        small = httpx.post(f"{srv.base_url}/v1/completions", json={**body, "prompt": "Hi", "n": 2}, timeout=60)
        assert small.status_code == 200, small.text
        # A few samples that may each fill the context (no max_tokens) are always admissible.
        whole = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "n": 4, "max_tokens": None}
        response = httpx.post(f"{srv.base_url}/v1/chat/completions", json={**whole, "max_tokens": 1}, timeout=60)
        assert response.status_code == 200, response.text


def test_max_request_cost_defaults_to_a_bound_and_must_be_positive():
    assert ServerConfig().max_request_cost is None  # the KV cache's capacity
    with pytest.raises(ValueError, match="max_request_cost"):
        ServerConfig(max_request_cost=0)


def test_the_cost_flag_and_its_env_var_reach_the_config(monkeypatch):
    import argparse

    from server import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert cli.config_from_args(parser.parse_args(["--max-request-cost", "5000"])).max_request_cost == 5000
    monkeypatch.setenv("KVSERVE_MAX_REQUEST_COST", "7000")
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert cli.config_from_args(parser.parse_args([])).max_request_cost == 7000


# ---- cache_salt ----


@pytest.mark.parametrize("salt", ["", "x" * (MAX_CACHE_SALT_CHARS + 1), 123, ["a"]])
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_cache_salt_must_be_a_short_non_empty_string(server, route, salt):
    body = {"prompt": "Hi"} if route == "/v1/completions" else chat("Hi")
    response = post(server, route, {**body, "max_tokens": 1, "cache_salt": salt})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "cache_salt"


def test_sampling_params_check_the_salt_for_offline_use_too():
    assert SamplingParams(cache_salt="x" * MAX_CACHE_SALT_CHARS).cache_salt == "x" * MAX_CACHE_SALT_CHARS
    for salt in ("", "x" * (MAX_CACHE_SALT_CHARS + 1), 5):
        with pytest.raises(InvalidRequestError, match="cache_salt"):
            SamplingParams(cache_salt=salt)


def test_requests_share_cached_prefixes_only_within_a_cache_salt(server):
    def hits_of(cache_salt: str | None) -> float:
        before = prefix_cache_hits(server)
        body = {"prompt": SALTED_PROMPT, "max_tokens": 1, "temperature": 0}
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        response = post(server, "/v1/completions", body)
        assert response.status_code == 200, response.text
        return prefix_cache_hits(server) - before

    assert hits_of("tenant-a") == 0
    assert hits_of("tenant-b") == 0  # the same prompt from another tenant is computed again
    assert hits_of("tenant-a") == 32  # two full blocks
    answer = post(server, "/v1/chat/completions", chat("Hi", max_tokens=2, cache_salt="tenant-a"))
    assert answer.status_code == 200, answer.text


# ---- /metrics behind the key ----


def test_metrics_needs_the_api_key_and_health_does_not(server):
    refused_metrics = httpx.get(f"{server.base_url}/metrics")
    assert refused_metrics.status_code == 401
    assert refused_metrics.json()["error"]["code"] == "invalid_api_key"
    wrong = httpx.get(f"{server.base_url}/metrics", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    assert httpx.get(f"{server.base_url}/metrics", headers=AUTH).status_code == 200
    assert httpx.get(f"{server.base_url}/health").status_code == 200
