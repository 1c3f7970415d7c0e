"""Several models from one server: each answers as it does served alone, loads on its first request while
the others stream, unloads when idle past its keep-alive (its memory freed), makes room by unloading the
least recently used idle model (never a busy one: 503 with Retry-After), refuses a model larger than the
budget, fails only its own requests when its load fails, frees everything when clients leave, and is loaded
and unloaded by an admin."""

from __future__ import annotations

import dataclasses
import gc
import statistics
import threading
import time
import weakref

import httpx
import pytest

from engine import SamplingParams, load_generation
from engine.config import EmbedderConfig, EngineConfig
from engine.llm import LLM
from server.app import create_app
from server.catalogue.entries import ModelEntry
from server.state import state_of
from tests.support.flaky_engine import FlakyEngine
from tests.support.server_harness import ServerThread, make_server_config, send_and_hang_up
from tests.support.tiny_models import make_tiny_model

pytestmark = pytest.mark.slow

EMBEDDING_MODEL = "all-minilm-l6-v2"
PROMPT = "The quick brown fox"
SLOW_LOAD_S = 1.5  # the third model's load: torch work on the loader thread, longer than the stream's wait


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    """Three tiny llamas with different random weights."""
    return {name: str(make_tiny_model(tmp_path_factory.mktemp(name), "llama", seed=seed))
            for seed, name in enumerate(("tiny-a", "tiny-b", "tiny-c"))}  # fmt: skip


def _entry(config: EngineConfig, name: str, path: str, **fields) -> ModelEntry:
    return ModelEntry((name,), "generate", dataclasses.replace(config, model=path), **fields)


def _busy_torch_work(seconds: float) -> None:
    import torch

    a = torch.randn(256, 256)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        a = torch.tanh(a @ a)


class _Factory:
    """Every generation model as a FlakyEngine (its steps can be slowed); `slow` models take SLOW_LOAD_S of
    torch work to load; `broken` ones fail to load; each load is counted."""

    def __init__(self, slow: set[str] = frozenset(), broken: set[str] = frozenset()) -> None:
        self.slow, self.broken = slow, broken
        self.engines: dict[str, FlakyEngine] = {}
        self.loads: list[str] = []

    def __call__(self, config: EngineConfig):
        self.loads.append(config.model)
        if config.model in self.broken:
            raise RuntimeError("injected load failure: the weights are unreadable")
        if config.model in self.slow:
            _busy_torch_work(SLOW_LOAD_S)
        loaded = load_generation(config)
        flaky = FlakyEngine(loaded.engine)
        self.engines[config.model] = flaky
        return type(loaded)(flaky, loaded.tokenizer)


@pytest.fixture(scope="module")
def served(model_dirs, tmp_path_factory):
    """tiny-a (the default), tiny-b and slow-c (tiny-c, slow to load) on demand, an embedder on demand,
    and a model whose load fails."""
    config = make_server_config(model_dirs["tiny-a"], served_model_name="tiny-a")
    broken = str(tmp_path_factory.mktemp("broken"))
    more = (
        _entry(config.engine, "tiny-b", model_dirs["tiny-b"]),
        _entry(config.engine, "slow-c", model_dirs["tiny-c"]),
        _entry(config.engine, "broken", broken),
        ModelEntry(("minilm",), "embed", EmbedderConfig(model=EMBEDDING_MODEL)),
    )
    config = dataclasses.replace(config, models=more, keep_alive=60.0)
    factory = _Factory(slow={model_dirs["tiny-c"]}, broken={broken})
    with ServerThread(create_app(config, engine_factory=factory)) as server:
        server.factory = factory
        yield server


def _complete(server, model: str, **fields) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, **fields}
    return httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)


def _cards(server, **params) -> dict[str, dict]:
    answer = httpx.get(f"{server.base_url}/v1/models", params=params, timeout=10)
    assert answer.status_code == 200, answer.text
    return {card["id"]: card for card in answer.json()["data"]}


def _wait_status(server, model: str, status: str, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        card = _cards(server)[model]
        if card["status"] == status:
            return card
        time.sleep(0.05)
    raise AssertionError(f"{model} not {status} within {timeout}s: {_cards(server)[model]}")


def test_requests_alternating_between_models_answer_as_each_model_served_alone(served, model_dirs):
    texts = {}
    for model in ("tiny-a", "tiny-b", "tiny-a", "tiny-b"):
        answer = _complete(served, model)
        assert answer.status_code == 200, answer.text
        assert answer.json()["model"] == model
        texts.setdefault(model, set()).add(answer.json()["choices"][0]["text"])
    for model in ("tiny-a", "tiny-b"):
        alone = LLM.from_config(EngineConfig(model=model_dirs[model], max_model_len=256))
        expected = alone.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0))[0][0].text
        assert texts[model] == {expected}
    assert texts["tiny-a"] != texts["tiny-b"]  # two models really answered
    vectors = httpx.post(f"{served.base_url}/v1/embeddings", json={"model": "minilm", "input": [PROMPT]}, timeout=60)
    assert vectors.status_code == 200, vectors.text
    from engine import Embedder

    alone = Embedder(EmbedderConfig(model=EMBEDDING_MODEL)).embed([PROMPT]).vectors[0]
    assert max(abs(a - b) for a, b in zip(vectors.json()["data"][0]["embedding"], alone.tolist())) < 1e-5
    cards = _cards(served, loaded="true")
    assert {"tiny-a", "tiny-b", "minilm"} <= set(cards) and "slow-c" not in cards


def _stream_arrivals(server, model: str, max_tokens: int, arrivals: list[float]) -> None:
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60) as answer:
        for line in answer.iter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.monotonic())


def test_a_model_loads_on_demand_while_another_keeps_streaming(served):
    engine_a = next(e for path, e in served.factory.engines.items() if "tiny-a" in path)
    engine_a.step_delay = 0.02  # steps of a real model's length, so the latency is the step loop's
    # The suite's one process holds the objects of every test before this one (the imports alone: ~785k, a full
    # collection 0.4 s); a collection the load's allocations set off would walk them all, holding the GIL, a pause
    # a server's own process does not have. Frozen, they are left out of collections while this test measures.
    gc.freeze()
    try:
        arrivals: list[float] = []
        stream = threading.Thread(target=_stream_arrivals, args=(served, "tiny-a", 200, arrivals))
        stream.start()
        while len(arrivals) < 40:
            time.sleep(0.01)
        load_start = time.monotonic()
        answers = []
        loader = threading.Thread(target=lambda: answers.append(_complete(served, "slow-c")))
        loader.start()
        time.sleep(0.3)
        assert _cards(served)["slow-c"]["status"] == "loading"
        assert httpx.get(f"{served.base_url}/health", timeout=5).status_code == 200  # answered during the load
        loader.join(60)
        load_end = time.monotonic()
        stream.join(60)
    finally:
        engine_a.step_delay = 0.0
        gc.unfreeze()
    assert answers[0].status_code == 200, answers[0].text
    assert load_end - load_start >= SLOW_LOAD_S
    gaps = [(b, b - a) for a, b in zip(arrivals, arrivals[1:])]
    idle = [gap for end, gap in gaps if end < load_start]
    loading = [gap for end, gap in gaps if load_start <= end <= load_end]
    assert len(loading) >= 20, "the stream stalled while the model loaded"
    assert statistics.median(loading) <= 2 * statistics.median(idle), (statistics.median(idle), loading)
    assert max(loading) < SLOW_LOAD_S / 2  # never waited for the load
    # The load's thread ended with it: a lasting one would keep its OpenMP team and slow every step after.
    deadline = time.monotonic() + 5
    while any(t.name.startswith("kvserve-load") for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("kvserve-load")]


def test_an_idle_model_unloads_after_its_keep_alive_and_its_memory_is_freed(served):
    refused = httpx.post(f"{served.base_url}/api/generate", json={"model": "tiny-b", "keep_alive": "soon"}, timeout=10)
    assert refused.status_code == 400 and "keep_alive" in refused.json()["error"]
    answer = httpx.post(
        f"{served.base_url}/api/generate",
        json={"model": "tiny-b", "prompt": PROMPT, "stream": False, "keep_alive": "1s", "options": {"num_predict": 4}},
        timeout=60,
    )
    assert answer.status_code == 200, answer.text
    engine_b = next(e for path, e in served.factory.engines.items() if "tiny-b" in path)
    model_b = weakref.ref(engine_b._inner.runner.model)
    ps = httpx.get(f"{served.base_url}/api/ps", timeout=10).json()["models"]
    b = next(m for m in ps if m["name"] == "tiny-b")
    assert b["size"] > 0 and not b["expires_at"].startswith("2318")  # it expires; the default is kept
    assert next(m for m in ps if m["name"] == "tiny-a")["expires_at"].startswith("2318")
    card = _wait_status(served, "tiny-b", "unloaded", timeout=10)
    assert card["loaded"] is False
    del engine_b
    served.factory.engines = {p: e for p, e in served.factory.engines.items() if "tiny-b" not in p}
    import gc

    gc.collect()
    assert model_b() is None  # nothing holds the weights any more
    assert "tiny-b" not in [m["name"] for m in httpx.get(f"{served.base_url}/api/ps", timeout=10).json()["models"]]
    assert "tiny-b" in [m["name"] for m in httpx.get(f"{served.base_url}/api/tags", timeout=10).json()["models"]]
    # Ollama's empty request loads it again; with keep_alive 0 it unloads at once.
    load = httpx.post(f"{served.base_url}/api/generate", json={"model": "tiny-b"}, timeout=60).json()
    assert load["done_reason"] == "load" and _cards(served)["tiny-b"]["loaded"]
    unload = httpx.post(f"{served.base_url}/api/generate", json={"model": "tiny-b", "keep_alive": 0}, timeout=60).json()
    assert unload["done_reason"] == "unload" and not _cards(served)["tiny-b"]["loaded"]
    # Ollama's load_duration: the wait for the load, inside total_duration; 0 once loaded.
    body = {"model": "tiny-b", "prompt": PROMPT, "stream": False, "options": {"num_predict": 2}}
    timings = [httpx.post(f"{served.base_url}/api/generate", json=body, timeout=60).json() for _ in range(2)]
    assert timings[0]["load_duration"] > 0 and timings[0]["total_duration"] > timings[0]["load_duration"]
    assert timings[1]["load_duration"] == 0
    httpx.post(f"{served.base_url}/api/generate", json={"model": "tiny-b", "keep_alive": 0}, timeout=60)


def test_a_load_gives_its_transient_memory_back_to_the_system(served, monkeypatch):
    """After a load the freed heap is trimmed (malloc_trim, without a full collection, which would stall the
    streaming models), as after an unload: a load's transient buffers are not kept as resident memory."""
    from server.catalogue import pool

    httpx.post(f"{served.base_url}/api/generate", json={"model": "tiny-b", "keep_alive": 0}, timeout=60)
    _wait_status(served, "tiny-b", "unloaded")
    calls = []
    real = pool._trim_heap
    monkeypatch.setattr(pool, "_trim_heap", lambda: calls.append(1) or real())
    assert _complete(served, "tiny-b").status_code == 200
    assert calls == [1]


def test_a_failed_load_fails_only_its_own_requests(served):
    loads_before = served.factory.loads.count(next(p for p in served.factory.broken))
    for _ in range(2):  # the next request tries again
        answer = _complete(served, "broken")
        assert answer.status_code == 500
        assert answer.json()["error"]["code"] == "model_load_failed"
        assert "unreadable" in answer.json()["error"]["message"]
    assert served.factory.loads.count(next(p for p in served.factory.broken)) == loads_before + 2
    assert _cards(served)["broken"]["status"] == "failed"
    assert _complete(served, "tiny-a").status_code == 200
    assert httpx.get(f"{served.base_url}/health", timeout=5).status_code == 200


def test_a_request_wrong_on_its_body_alone_is_refused_before_its_model_loads(served):
    """Each route checks what needs no model before acquiring one: the broken model's loads (each request
    tries again) are not counted up, and the answer is the request's 400, not the load's 500."""
    broken = next(iter(served.factory.broken))
    loads_before = served.factory.loads.count(broken)
    prompt = {"prompt": PROMPT}
    chat = {"messages": [{"role": "user", "content": PROMPT}]}
    wrong = [
        ("/v1/completions", {**prompt, "stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/completions", {**prompt, "logit_bias": {"first": 1}}, "logit_bias"),
        ("/v1/chat/completions", {**chat, "top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {**chat, "max_tokens": 2, "min_tokens": 5}, "min_tokens"),
        ("/v1/chat/completions", {**chat, "store": True}, "store"),
        ("/v1/responses", {"input": PROMPT, "previous_response_id": "resp_1"}, "previous_response_id"),
        ("/api/generate", {**prompt, "raw": True, "system": "Be brief."}, "raw"),
    ]
    for path, body, param in wrong:
        answer = httpx.post(f"{served.base_url}{path}", json={"model": "broken", **body}, timeout=30)
        assert answer.status_code == 400, (path, answer.text)
        assert param in answer.text, (path, answer.text)
    assert served.factory.loads.count(broken) == loads_before
    assert _complete(served, "broken").json()["error"]["code"] == "model_load_failed"  # a valid one tries it
    assert served.factory.loads.count(broken) == loads_before + 1


def test_abandoned_requests_free_everything_in_every_model(served):
    for model in ("tiny-a", "tiny-b"):
        assert _complete(served, model).status_code == 200  # both loaded
    for model in ("tiny-a", "tiny-b"):
        body = {"model": model, "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True}
        send_and_hang_up(served.base_url, "/v1/completions", body, linger=0.3)
    pool = state_of(served.app).models
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        rows = {row.entry.name: row for row in pool.statuses()}
        engines = [pool.loaded(rows[m].entry).engine for m in ("tiny-a", "tiny-b")]
        if all(rows[m].requests_inside == 0 for m in rows) and all(
            e.num_active_requests == 0 and e.stats().num_used_blocks == 0 for e in engines
        ):
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"requests or blocks left behind: {rows}")


def test_each_models_metrics_carry_its_name(served):
    assert _complete(served, "tiny-b").status_code == 200
    page = httpx.get(f"{served.base_url}/metrics", timeout=10).text
    for model in ("tiny-a", "tiny-b"):
        assert f'kvserve:num_requests_running{{model_name="{model}"}}' in page
        assert f'kvserve:e2e_request_latency_seconds_count{{model_name="{model}"}}' in page


@pytest.fixture(scope="module")
def crowded(model_dirs):
    """Room for two models out of three; an admin key and a user key."""
    config = make_server_config(
        model_dirs["tiny-a"], served_model_name="tiny-a", api_keys=("user",), admin_api_keys=("admin",)
    )
    more = tuple(_entry(config.engine, name, model_dirs[name]) for name in ("tiny-b", "tiny-c"))
    config = dataclasses.replace(config, models=more, max_loaded_models=2)
    factory = _Factory()
    with ServerThread(create_app(config, engine_factory=factory)) as server:
        server.factory = factory
        yield server


def _as(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _loaded(server) -> set[str]:
    answer = httpx.get(f"{server.base_url}/v1/models?loaded=true", headers=_as("user"), timeout=10)
    return {card["id"] for card in answer.json()["data"]}


def _post(server, model: str, **fields) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 4, **fields}
    return httpx.post(f"{server.base_url}/v1/completions", json=body, headers=_as("user"), timeout=60)


def test_the_least_recently_used_idle_model_makes_room(crowded):
    assert _loaded(crowded) == {"tiny-a"}
    assert _post(crowded, "tiny-b").status_code == 200
    assert _loaded(crowded) == {"tiny-a", "tiny-b"}
    assert _post(crowded, "tiny-a").status_code == 200  # tiny-b is now the least recently used
    assert _post(crowded, "tiny-c").status_code == 200
    assert _loaded(crowded) == {"tiny-a", "tiny-c"}
    assert _post(crowded, "tiny-b").status_code == 200  # tiny-a's turn to go
    assert _loaded(crowded) == {"tiny-c", "tiny-b"}


def test_a_busy_model_is_never_unloaded_and_the_request_is_told_when_to_retry(crowded):
    for model in ("tiny-a", "tiny-b"):
        assert _post(crowded, model).status_code == 200
    assert _loaded(crowded) == {"tiny-a", "tiny-b"}
    engines = [e for path, e in crowded.factory.engines.items() if "tiny-a" in path or "tiny-b" in path]
    for engine in engines:
        engine.step_delay = 0.02
    try:
        streams = [
            threading.Thread(target=_post, args=(crowded, m), kwargs={"max_tokens": 60, "ignore_eos": True})
            for m in ("tiny-a", "tiny-b")
        ]
        for stream in streams:
            stream.start()
        time.sleep(0.3)
        answer = _post(crowded, "tiny-c")
        assert answer.status_code == 503, answer.text
        assert answer.json()["error"]["code"] == "models_busy"
        assert int(answer.headers["Retry-After"]) > 0
        for stream in streams:
            stream.join(60)
    finally:
        for engine in engines:
            engine.step_delay = 0.0
    assert _loaded(crowded) == {"tiny-a", "tiny-b"}
    assert _post(crowded, "tiny-c").status_code == 200  # idle again: room is made


def test_models_are_loaded_and_unloaded_by_an_admin_only(crowded):
    url = f"{crowded.base_url}/v1/models/tiny-c"
    refused = httpx.post(f"{url}/unload", headers=_as("user"), timeout=10)
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "admin_required"
    loaded = httpx.post(f"{url}/load", headers=_as("admin"), timeout=60)
    assert loaded.status_code == 200 and loaded.json()["loaded"] is True
    unloaded = httpx.post(f"{url}/unload", headers=_as("admin"), timeout=60)
    assert unloaded.status_code == 200 and unloaded.json()["status"] == "unloaded"
    assert httpx.post(f"{crowded.base_url}/v1/models/nope/load", headers=_as("admin"), timeout=10).status_code == 404


def test_a_model_larger_than_the_memory_budget_is_refused_naming_the_budget(model_dirs):
    config = make_server_config(model_dirs["tiny-a"], served_model_name="tiny-a")
    config = dataclasses.replace(
        config, models=(_entry(config.engine, "tiny-b", model_dirs["tiny-b"]),), memory_budget=1 << 20
    )
    with ServerThread(create_app(config)) as server:
        answer = _complete(server, "tiny-b")
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["code"] == "model_too_large"
        assert "--memory-budget" in answer.json()["error"]["message"]
        assert _complete(server, "tiny-a").status_code == 200
