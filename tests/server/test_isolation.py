"""Isolation between clients: each API key's own prefix-cache namespace, cache_salt and prompt_cache_key on
/v1/responses, the admin-only detail of /metrics and /kv_cache, several keys from flags, the environment
and a key file, and the playground cookie's Max-Age, Secure and signed expiry."""

from __future__ import annotations

import argparse
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server import cli
from server.app import create_app
from server.http.access import ApiKeys, read_key_file
from server.playground.auth import PAGE_COOKIE, PAGE_COOKIE_MAX_AGE_S, page_token
from tests.support.server_harness import ServerThread, make_server_config

MODEL = "tiny-llama"
ALICE, BOB, ADMIN = "alice-key", "bob-key", "admin-key"
PROMPT_TOKENS = 40  # two full 16-token blocks before the one holding the last token
FULL_BLOCKS_HIT = 32
PRIVATE_SERIES = ("prefix_cache", "prompt_tokens_cached", "prompt_tokens_by_source")


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    config = make_server_config(tiny_llama_dir, api_keys=(ALICE, BOB), admin_api_keys=(ADMIN,), block_size=16)
    with ServerThread(create_app(config)) as srv:
        yield srv


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _post(server, key: str, route: str, body: dict) -> httpx.Response:
    answer = httpx.post(f"{server.base_url}{route}", json={"model": MODEL, **body}, headers=_auth(key), timeout=60)
    assert answer.status_code == 200, answer.text
    return answer


def _prefix_cache_hits(server) -> float:
    text = httpx.get(f"{server.base_url}/metrics", headers=_auth(ADMIN)).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kvserve:prefix_cache_hits_total":
                return sample.value
    raise AssertionError("no kvserve:prefix_cache_hits_total on the admin's /metrics")


def _hits_of(server, key: str, route: str, body: dict) -> float:
    before = _prefix_cache_hits(server)
    _post(server, key, route, body)
    return _prefix_cache_hits(server) - before


def _completion(first_token: int, **fields) -> dict:
    prompt = list(range(first_token, first_token + PROMPT_TOKENS))
    return {"prompt": prompt, "max_tokens": 1, "temperature": 0, **fields}


def test_keys_never_share_a_cached_prefix_and_one_key_does(server):
    body = _completion(100)
    assert _hits_of(server, ALICE, "/v1/completions", body) == 0
    assert _hits_of(server, BOB, "/v1/completions", body) == 0  # the same prompt under another key: computed again
    assert _hits_of(server, ALICE, "/v1/completions", body) == FULL_BLOCKS_HIT
    assert _hits_of(server, BOB, "/v1/completions", body) == FULL_BLOCKS_HIT
    # Within a key, cache_salt splits further.
    assert _hits_of(server, ALICE, "/v1/completions", {**body, "cache_salt": "s"}) == 0
    assert _hits_of(server, ALICE, "/v1/completions", {**body, "cache_salt": "s"}) == FULL_BLOCKS_HIT


def test_responses_take_cache_salt_and_prompt_cache_key(server):
    text = " ".join(f"word{i}" for i in range(60))
    body = {"input": text, "max_output_tokens": 1, "temperature": 0}
    assert _hits_of(server, ALICE, "/v1/responses", {**body, "cache_salt": "tenant"}) == 0
    assert _hits_of(server, ALICE, "/v1/responses", {**body, "prompt_cache_key": "tenant"}) > 0  # the same salt
    assert _hits_of(server, ALICE, "/v1/responses", {**body, "prompt_cache_key": "other"}) == 0
    assert _hits_of(server, ALICE, "/v1/responses", body) == 0  # no salt is a namespace of its own
    assert _hits_of(server, BOB, "/v1/responses", {**body, "cache_salt": "tenant"}) == 0  # another key
    for field in ("cache_salt", "prompt_cache_key"):
        answer = httpx.post(
            f"{server.base_url}/v1/responses", json={**body, field: ""}, headers=_auth(ALICE), timeout=60
        )
        assert answer.status_code == 400 and answer.json()["error"]["param"] == field, answer.text


def test_metrics_prefix_cache_series_are_for_admin_keys_only(server):
    public = httpx.get(f"{server.base_url}/metrics", headers=_auth(ALICE))
    private = httpx.get(f"{server.base_url}/metrics", headers=_auth(ADMIN))
    assert public.status_code == private.status_code == 200
    for series in PRIVATE_SERIES:
        assert series not in public.text, series
        assert series in private.text, series
    for aggregate in ("kvserve:kv_cache_usage_perc", "vllm:num_requests_running", "kvserve:prompt_tokens_total"):
        assert aggregate in public.text and aggregate in private.text, aggregate


def test_kv_cache_detail_is_for_admin_keys_only(server):
    public = httpx.get(f"{server.base_url}/kv_cache", headers=_auth(BOB)).json()
    private = httpx.get(f"{server.base_url}/kv_cache", headers=_auth(ADMIN)).json()
    assert public["detail"] is False and public["blocks"] is None and public["sequences"] is None
    assert private["detail"] is True and len(private["blocks"]) == private["num_blocks"]
    assert isinstance(private["sequences"], list)
    counts = ("num_blocks", "num_used_blocks", "num_cached_free_blocks", "num_free_blocks", "num_running")
    assert all(isinstance(public[count], int) for count in counts)
    assert set(public) == set(private)


def test_admin_rights_by_configuration():
    assert ApiKeys([]).is_open
    assert ApiKeys(["only"]).caller_for("only").is_admin  # a single-user server, as before
    several = ApiKeys(["a", "b"])
    assert not several.caller_for("a").is_admin and not several.caller_for("b").is_admin
    with_admin = ApiKeys(["a", "z"], ["z"])
    assert with_admin.caller_for("z").is_admin and not with_admin.caller_for("a").is_admin
    assert with_admin.caller_for("zz") is None and with_admin.caller_for("") is None
    # The namespace: per key, folded with the request's salt; `shared` passes the salt through.
    a, b = several.caller_for("a"), several.caller_for("b")
    assert a.cache_salt(None) != b.cache_salt(None) and a.cache_salt("s") != b.cache_salt("s")
    assert a.cache_salt("s") == ApiKeys(["a", "c"]).caller_for("a").cache_salt("s") != a.cache_salt(None)
    assert ApiKeys(["a", "b"], prefix_cache_scope="shared").caller_for("a").cache_salt("s") == "s"


def test_keys_from_flags_the_environment_and_a_file(tmp_path, monkeypatch):
    key_file = tmp_path / "keys"
    key_file.write_text("# one key per line\n\nfile-1\n  file-2  \n#not-a-key\n")
    assert read_key_file(key_file) == ("file-1", "file-2")
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n\n")
    with pytest.raises(ValueError, match="no API key"):
        read_key_file(empty)

    def config(*args: str):
        parser = argparse.ArgumentParser()
        cli.add_arguments(parser)
        return cli.config_from_args(parser.parse_args(list(args)))

    flags = config("--api-key", "a", "--api-key", "b,c", "--api-key-file", str(key_file), "--admin-api-key", "z")
    assert flags.api_keys == ("a", "b", "c", "file-1", "file-2", "z") and flags.admin_api_keys == ("z",)
    assert flags.prefix_cache_scope == "api-key" and flags.api_key == "a"
    assert config("--prefix-cache-scope", "shared").prefix_cache_scope == "shared"
    assert config().api_keys == () and config().api_key is None
    monkeypatch.setenv("KVSERVE_API_KEY", "env-1, env-2")
    assert config().api_keys == ("env-1", "env-2")
    assert config("--api-key", "flag").api_keys == ("flag",)  # the flag wins over its variable
    with pytest.raises(SystemExit):
        config("--api-key-file", str(empty))


def test_page_cookie_has_max_age_secure_over_https_and_a_signed_expiry(server):
    url = server.base_url
    # X-Forwarded-Proto from a trusted address (uvicorn's default: this machine's loopback) makes it https.
    https = {**_auth(BOB), "X-Forwarded-Proto": "https"}
    signed_in = httpx.post(f"{url}/playground/sign-in", headers=https)
    set_cookie = signed_in.headers["set-cookie"]
    assert f"Max-Age={PAGE_COOKIE_MAX_AGE_S}" in set_cookie and "Secure" in set_cookie and "HttpOnly" in set_cookie
    token = signed_in.cookies[PAGE_COOKIE]
    assert httpx.get(f"{url}/", headers={"Cookie": f"{PAGE_COOKIE}={token}"}).status_code == 200
    assert "Secure" not in httpx.post(f"{url}/playground/sign-in", headers=_auth(BOB)).headers["set-cookie"]

    secret = ApiKeys([BOB]).caller_for(BOB).page_secret
    expired = page_token(secret, now=time.time() - PAGE_COOKIE_MAX_AGE_S - 1)
    assert httpx.get(f"{url}/", headers={"Cookie": f"{PAGE_COOKIE}={expired}"}).status_code == 401
    expiry, mac = token.split(".")
    extended = f"{int(expiry) + 3600}.{mac}"  # a later expiry, not signed
    assert httpx.get(f"{url}/", headers={"Cookie": f"{PAGE_COOKIE}={extended}"}).status_code == 401
