"""POST /rerank (TEI), POST /v1/rerank and /v2/rerank (Cohere/Jina, as vLLM answers) and POST /v1/score
(vLLM) over real HTTP, on a tiny random BERT cross-encoder (tests/engine/test_reranker.py).

The rerank and models routers are mounted on a small FastAPI app with the ServerState and error
handlers the server gives them, and served by uvicorn on a free port. Scores are checked against the
Reranker's own reference (itself held equal to transformers). A client that leaves is checked on the
ASGI app directly, with a reranker that never answers.
"""

from __future__ import annotations

import json
import types
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

import httpx
import pytest
from fastapi import FastAPI
from starlette.testclient import TestClient

from engine.config import EngineConfig, RerankerConfig
from engine.pooling.reranker import Reranker, sigmoid
from engine.serving.async_encoder import AsyncEncoder
from server.catalogue.served import ServedGeneration
from server.config import ServerConfig
from server.errors import install_error_handlers
from server.http.middleware import AdmissionMiddleware
from server.routes import models as model_routes
from server.routes import rerank as rerank_routes
from server.state import ServerState, attach_state, state_of
from tests.engine.test_embedder import minilm_dir  # noqa: F401 - session fixture, used by name
from tests.engine.test_reranker import MAX_POSITIONS, cross_encoder_dirs  # noqa: F401 - a session fixture
from tests.support.asgi import SilentEncoder, post_and_leave
from tests.support.server_harness import ServerThread

GENERATION_MODEL = "tiny-generator"
RERANK_MODEL = "tiny-reranker"  # the rerank model's name as configured (a path in practice)
MAX_CLIENT_BATCH_SIZE = 8
QUERY = "what is the capital of france"
TEXTS = [
    "berlin is the capital of germany",
    "paris is the capital of france",
    "a cat",
    "the river in the city of paris is the seine",
    "",
]
LONG = "the capital of france is paris " * 20  # past the tiny model's 64 positions with any query


class _RecordingMetrics:
    """Stands in for ServerMetrics: records what the routes observe."""

    def __init__(self) -> None:
        self.observed: list[dict] = []

    def observe_embedding_request(self, **fields) -> None:
        self.observed.append(fields)


def _make_app(async_reranker, *, served: bool = True) -> FastAPI:
    """The rerank and models routes over `async_reranker` (served False: a server without a rerank model)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if async_reranker is not None:
            await async_reranker.start()
        yield
        if async_reranker is not None:
            await async_reranker.stop()

    app = FastAPI(lifespan=lifespan)
    config = ServerConfig(
        engine=EngineConfig(model=GENERATION_MODEL),
        embedder=None,
        reranker=RerankerConfig(model=RERANK_MODEL) if served else None,
        max_client_batch_size=MAX_CLIENT_BATCH_SIZE,
    )
    state = ServerState(config=config, is_ready=True)
    # only its name, context length and what it runs on are read here
    runtime = types.SimpleNamespace(
        device="cpu",
        cpu_features=("avx2",),
        kernel_build="avx2",
        prefill_dtype=None,
        kv_cache_dtype="float16",
        kv_bytes_per_token=23040,
    )
    engine = types.SimpleNamespace(
        model_name=GENERATION_MODEL, max_model_len=128, is_healthy=True, model_info=runtime, num_active_requests=0
    )
    state.models.install(state.models.default("generate"), ServedGeneration(GENERATION_MODEL, engine, None, None))
    if served:
        state.models.install(state.models.default("rerank"), async_reranker)
    state.metrics = _RecordingMetrics()
    attach_state(app, state)
    app.include_router(rerank_routes.router)
    app.include_router(model_routes.router)
    install_error_handlers(app)
    # the request id the answers' `id` is made of
    app.add_middleware(
        AdmissionMiddleware, is_ready=lambda: True, shutdown=state.shutdown, api_keys=None, max_request_bytes=1 << 20
    )
    return app


@pytest.fixture(scope="module")
def reranker(cross_encoder_dirs):  # noqa: F811
    """The tiny BERT cross-encoder, named as a configured model would be (its own instance: the name is set)."""
    reranker = Reranker(RerankerConfig(model=str(cross_encoder_dirs["bert"])))
    reranker.model_name = RERANK_MODEL
    return reranker


@pytest.fixture(scope="module")
def server(reranker):
    app = _make_app(AsyncEncoder(reranker, what="rerank"))
    server = ServerThread(app).start(wait_ready=False)  # the test app has no readiness to wait for
    yield types.SimpleNamespace(url=server.base_url, app=app)
    server.stop()


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=30)


def _logits(reranker, pairs, **options) -> list[float]:
    return reranker.score(pairs, **options).logits.tolist()


def _assert_close(ours: list[float], ref: list[float]) -> None:
    assert len(ours) == len(ref)
    assert max(abs(a - b) for a, b in zip(ours, ref, strict=True)) <= 1e-5, (ours, ref)


def _assert_error(response: httpx.Response, status: int, param: str | None, words: str, code: str | None = None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error
    if code is not None:
        assert error["code"] == code, error


# ---- TEI: /rerank ----


def test_tei_rerank_is_sorted_with_sigmoid_scores_or_raw_logits(server, reranker):
    logits = _logits(reranker, [(QUERY, t) for t in TEXTS])
    answer = _post(server, "/rerank", {"query": QUERY, "texts": TEXTS})
    assert answer.status_code == 200, answer.text
    ranks = answer.json()
    assert sorted(r["index"] for r in ranks) == list(range(len(TEXTS)))
    assert [r["index"] for r in ranks] == sorted(range(len(TEXTS)), key=lambda i: -logits[i])  # best first
    assert all(set(r) == {"index", "score"} for r in ranks)  # no text unless asked
    _assert_close([r["score"] for r in ranks], [sigmoid(logits[r["index"]]) for r in ranks])
    assert all(0 < r["score"] < 1 for r in ranks)

    raw = _post(server, "/rerank", {"query": QUERY, "texts": TEXTS, "raw_scores": True, "return_text": True}).json()
    assert [r["index"] for r in raw] == [r["index"] for r in ranks]
    _assert_close([r["score"] for r in raw], [logits[r["index"]] for r in raw])
    assert [r["text"] for r in raw] == [TEXTS[r["index"]] for r in raw]
    observed = state_of(server.app).metrics.observed[-1]
    assert observed["endpoint"] == "/rerank" and observed["num_inputs"] == len(TEXTS)
    assert observed["model_name"] == RERANK_MODEL and observed["num_prompt_tokens"] > len(TEXTS) * 3


def test_tei_rerank_truncates_both_ways_when_asked(server, reranker):
    body = {"query": QUERY, "texts": ["paris", LONG]}
    _assert_error(_post(server, "/rerank", body), 400, "texts", f"maximum of {MAX_POSITIONS} tokens")
    for side in ("right", "Left"):  # TEI's capitalised spelling is accepted
        answer = _post(server, "/rerank", {**body, "truncate": True, "truncation_direction": side, "raw_scores": True})
        assert answer.status_code == 200, answer.text
        ref = _logits(reranker, [(QUERY, t) for t in body["texts"]], truncate=True, truncation_direction=side.lower())
        _assert_close([r["score"] for r in sorted(answer.json(), key=lambda r: r["index"])], ref)


# ---- Cohere / Jina: /v1/rerank, /v2/rerank ----


def test_v1_rerank_shape_sorting_top_n_and_documents(server, reranker):
    documents = [TEXTS[0], {"text": TEXTS[1]}, TEXTS[2], {"text": TEXTS[3]}]
    texts = TEXTS[:4]
    logits = _logits(reranker, [(QUERY, t) for t in texts])
    best_first = sorted(range(len(texts)), key=lambda i: -logits[i])
    body = {"model": RERANK_MODEL, "query": QUERY, "documents": documents}
    answer = httpx.post(f"{server.url}/v1/rerank", json=body, headers={"X-Request-Id": "r-1"})
    assert answer.status_code == 200, answer.text
    payload = answer.json()
    assert set(payload) == {"id", "model", "usage", "results"}
    assert payload["id"] == "rerank-r-1" and payload["model"] == RERANK_MODEL
    num_tokens = sum(len(ids) for ids in reranker.tokenize([(QUERY, t) for t in texts]))
    assert payload["usage"] == {"total_tokens": num_tokens}
    results = payload["results"]
    assert [r["index"] for r in results] == best_first
    _assert_close([r["relevance_score"] for r in results], [sigmoid(logits[i]) for i in best_first])
    assert [r["document"] for r in results] == [{"text": texts[i]} for i in best_first]  # returned by default

    top = _post(server, "/v1/rerank", {**body, "top_n": 2, "return_documents": False}).json()["results"]
    assert [r["index"] for r in top] == best_first[:2] and all(set(r) == {"index", "relevance_score"} for r in top)
    everything = _post(server, "/v1/rerank", {**body, "top_n": 100}).json()["results"]
    assert [r["index"] for r in everything] == best_first  # top_n past the documents: all of them
    v2 = _post(server, "/v2/rerank", {"query": QUERY, "documents": documents}).json()  # model left out
    assert v2["results"] == results and v2["model"] == RERANK_MODEL
    assert state_of(server.app).metrics.observed[-1]["endpoint"] == "/v2/rerank"


def test_v1_rerank_answers_the_same_to_concurrent_clients(server, reranker):
    """Concurrent requests are batched together on the worker; each still gets its own ranking."""
    queries = [QUERY, "cat", "paris", "berlin germany", "river", "the capital"]
    references = {}
    for q in queries:
        logits = _logits(reranker, [(q, t) for t in TEXTS])
        references[q] = sorted(range(len(TEXTS)), key=lambda i, lg=logits: -lg[i])
    with ThreadPoolExecutor(len(queries)) as pool:
        answers = list(pool.map(lambda q: _post(server, "/v1/rerank", {"query": q, "documents": TEXTS}), queries))
    for q, answer in zip(queries, answers, strict=True):
        assert [r["index"] for r in answer.json()["results"]] == references[q]


# ---- vLLM: /v1/score ----


@pytest.mark.parametrize(
    ("text_1", "text_2", "pairs"),
    [
        (QUERY, TEXTS[1], [(QUERY, TEXTS[1])]),  # 1 to 1
        (QUERY, TEXTS[:3], [(QUERY, t) for t in TEXTS[:3]]),  # 1 to N
        ([QUERY], TEXTS[:3], [(QUERY, t) for t in TEXTS[:3]]),  # a list of one pairs with each
        (TEXTS[:3], TEXTS[2:5], list(zip(TEXTS[:3], TEXTS[2:5], strict=True))),  # N to N
    ],
)
def test_v1_score_pairs_as_vllm_does(server, reranker, text_1, text_2, pairs):
    answer = _post(server, "/v1/score", {"model": RERANK_MODEL, "text_1": text_1, "text_2": text_2})
    assert answer.status_code == 200, answer.text
    payload = answer.json()
    assert set(payload) == {"id", "object", "created", "model", "data", "usage"}
    assert payload["id"].startswith("score-") and payload["object"] == "list" and payload["model"] == RERANK_MODEL
    assert [d["index"] for d in payload["data"]] == list(range(len(pairs)))  # pair order, not sorted
    assert all(d["object"] == "score" for d in payload["data"])
    _assert_close([d["score"] for d in payload["data"]], [sigmoid(x) for x in _logits(reranker, pairs)])
    num_tokens = sum(len(ids) for ids in reranker.tokenize(pairs))
    assert payload["usage"] == {"prompt_tokens": num_tokens, "total_tokens": num_tokens, "completion_tokens": 0}


# ---- errors, and the server keeps serving ----


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "words"),
    [
        ("/rerank", {"query": QUERY, "texts": []}, 400, "texts", "must not be empty"),
        ("/v1/rerank", {"query": QUERY, "documents": []}, 400, "documents", "must not be empty"),
        ("/v1/score", {"text_1": [], "text_2": "x"}, 400, "text_1", "must not be empty"),
        ("/v1/score", {"text_1": "x", "text_2": []}, 400, "text_2", "must not be empty"),
        ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, 400, "text_2", "text_1 has 2 texts"),
        ("/v1/rerank", {"query": QUERY, "documents": ["ok", LONG]}, 400, "documents", "pair 1"),
        ("/v1/score", {"text_1": LONG, "text_2": "x"}, 400, "text_2", "shorten it or ask to truncate"),
        ("/rerank", {"query": "bad \ud800", "texts": ["x"]}, 400, "query", "not valid Unicode"),
        ("/v1/rerank", {"query": "q", "documents": ["x", {"text": "bad \udfff"}]}, 400, "documents.1.text", "Unicode"),
        ("/v1/score", {"text_1": "q", "text_2": ["x", "bad \ud800"]}, 400, "text_2.1", "not valid Unicode"),
        ("/rerank", {"query": QUERY, "texts": ["x"] * 9}, 413, "texts", "--max-client-batch-size"),
        ("/v1/rerank", {"query": QUERY, "documents": ["x"] * 9}, 413, "documents", "--max-client-batch-size"),
        ("/v1/score", {"text_1": QUERY, "text_2": ["x"] * 9}, 413, "text_2", "--max-client-batch-size"),
        ("/v1/rerank", {"query": QUERY, "documents": [{"txt": "x"}]}, 400, "documents.0", "must be a string or"),
        ("/v1/rerank", {"query": QUERY, "documents": ["x"], "top_n": -1}, 400, "top_n", "greater than or equal"),
        ("/v1/rerank", {"query": QUERY, "documents": ["x"], "rank_fields": ["a"]}, 400, "rank_fields", "unsupported"),
        ("/v1/score", {"text_1": 1, "text_2": "x"}, 400, "text_1", "a string or a list of strings"),
        (
            "/rerank",
            {"query": QUERY, "texts": ["x"], "truncation_direction": "middle"},
            400,
            "truncation_direction",
            "",
        ),
        ("/v1/rerank", {"model": "no-such-model", "query": QUERY, "documents": ["x"]}, 404, "model", "does not exist"),
        ("/v1/score", {"model": GENERATION_MODEL, "text_1": "a", "text_2": "b"}, 400, "model", "a generation model"),
    ],
)
def test_bad_requests_are_refused_and_the_server_keeps_serving(server, path, body, status, param, words):
    raw = json.dumps(body).encode()  # lone surrogates travel as \ud800 escapes, as a client would send them
    response = httpx.post(f"{server.url}{path}", content=raw, headers={"Content-Type": "application/json"})
    _assert_error(response, status, param, words)
    ok = _post(server, "/v1/rerank", {"query": QUERY, "documents": ["still", "fine"]})
    assert ok.status_code == 200 and len(ok.json()["results"]) == 2


def test_models_lists_the_rerank_model(server, reranker):
    cards = {card["id"]: card for card in httpx.get(f"{server.url}/v1/models").json()["data"]}
    assert cards[RERANK_MODEL]["task"] == "rerank" and cards[RERANK_MODEL]["root"] == RERANK_MODEL
    assert cards[RERANK_MODEL]["max_model_len"] == MAX_POSITIONS
    assert cards[GENERATION_MODEL]["task"] == "generate"


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/rerank", {"query": QUERY, "texts": ["x"]}),
        ("/v1/rerank", {"query": QUERY, "documents": ["x"]}),
        ("/v1/score", {"text_1": QUERY, "text_2": "x"}),
    ],
)
def test_without_a_rerank_model_every_route_is_a_404(path, body):
    with TestClient(_make_app(None, served=False)) as client:
        for request in (body, {**body, "model": RERANK_MODEL}):
            if path == "/rerank" and "model" in request:
                continue  # TEI's request names no model
            response = client.post(path, json=request)
            assert response.status_code == 404, response.text
            assert response.json()["error"]["code"] == "model_not_found"
        if path != "/rerank":
            wrong = client.post(path, json={**body, "model": GENERATION_MODEL})
            assert wrong.status_code == 400 and wrong.json()["error"]["code"] == "wrong_model_task"
        assert [card["task"] for card in client.get("/v1/models").json()["data"]] == ["generate"]


# ---- a client that leaves ----


def _silent_reranker() -> SilentEncoder:
    """A reranker whose scores never come (the routes read its activation before they wait)."""
    silent = SilentEncoder(RERANK_MODEL, MAX_POSITIONS)
    silent.embedder = types.SimpleNamespace(activate=sigmoid)
    return silent


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/rerank", {"query": "q", "texts": ["a"]}),
        ("/v1/rerank", {"query": "q", "documents": ["a", "b"]}),
        ("/v1/score", {"text_1": "q", "text_2": "a"}),
    ],
)
def test_client_leaving_cancels_the_scoring_with_a_499(path, body):
    silent = _silent_reranker()
    app = _make_app(silent)
    payload = json.dumps(body).encode()
    sent = post_and_leave(app, path, payload, silent.is_working)  # the client leaves while its pairs are being scored
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499
    assert silent.num_cancelled == 1


# ---- the whole server: the flag, the load, /v1/models ----


def test_rerank_model_flag_and_environment_variable(monkeypatch, cross_encoder_dirs):  # noqa: F811
    import argparse

    from server import cli

    def config_for(args):
        parser = argparse.ArgumentParser()
        cli.add_arguments(parser)
        return cli.config_from_args(parser.parse_args(args))

    assert config_for([]).reranker is None  # no rerank model unless one is named
    path = str(cross_encoder_dirs["bert"])
    config = config_for(["--rerank-model", path, "--dtype", "bfloat16", "--embedding-max-batch-tokens", "300"])
    assert (config.reranker.model, config.reranker.dtype, config.reranker.max_batch_tokens) == (path, "bfloat16", 300)
    monkeypatch.setenv("KVSERVE_RERANK_MODEL", path)
    assert config_for([]).reranker.model == path
    assert config_for(["--rerank-model", "none"]).reranker is None  # the flag wins over the variable


def test_the_server_loads_lists_and_serves_the_rerank_model(tmp_path, cross_encoder_dirs, reranker):  # noqa: F811
    import dataclasses

    from server.app import create_app
    from tests.support.server_harness import ServerThread, make_server_config
    from tests.support.tiny_models import make_tiny_llama

    path = str(cross_encoder_dirs["bert"])
    config = dataclasses.replace(
        make_server_config(make_tiny_llama(tmp_path / "llama"), max_model_len=64),
        reranker=RerankerConfig(model=path),
    )
    with ServerThread(create_app(config)) as live:
        cards = {card["task"]: card for card in httpx.get(f"{live.base_url}/v1/models").json()["data"]}
        assert cards["rerank"]["id"] == path and cards["rerank"]["max_model_len"] == MAX_POSITIONS
        answer = httpx.post(f"{live.base_url}/v1/rerank", json={"model": path, "query": QUERY, "documents": TEXTS})
        assert answer.status_code == 200, answer.text
        logits = _logits(reranker, [(QUERY, t) for t in TEXTS])
        assert [r["index"] for r in answer.json()["results"]] == sorted(range(len(TEXTS)), key=lambda i: -logits[i])
        wrong = httpx.post(f"{live.base_url}/v1/embeddings", json={"model": path, "input": "x"})
        assert wrong.status_code == 400 and "is a rerank model" in wrong.json()["error"]["message"]
