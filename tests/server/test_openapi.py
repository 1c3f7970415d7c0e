"""/openapi.json tells the truth: every status code, body, header and content type a route answers is
documented (server/http/openapi.py), and the server answers nothing else: no 5xx, no undocumented status
or content type, no body or header off its schema.

A live server (a tiny model, small limits) is fuzzed by schemathesis from the document; the answers
random requests rarely reach (SSE streams, 413, 401, 503 while loading or draining) are asked for
on purpose and checked against the document the same way.
"""

from __future__ import annotations

import dataclasses

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.errors import FailureGroup
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from starlette.testclient import TestClient
from uvicorn.protocols.http.flow_control import service_unavailable

from server.app import create_app
from server.state import state_of
from tests.support.server_harness import ServerThread, make_server_config
from tests.support.tiny_models import make_tiny_llama

pytestmark = pytest.mark.slow

EMBEDDING_MODEL = "all-minilm-l6-v2"
ERROR_BODY = {"$ref": "#/components/schemas/ErrorResponse"}
ANTHROPIC_ERROR_BODY = {"$ref": "#/components/schemas/AnthropicError"}  # the Messages routes' errors
OLLAMA_ERROR_BODY = {"$ref": "#/components/schemas/OllamaError"}  # the /api routes' errors
PLAIN_TEXT = {"schema": {"type": "string"}}
GATED = {"401", "413", "500", "503"}  # the middleware's checks: API key, body size, readiness, its catch-all
QUEUED = GATED | {"400", "404", "429", "504"}  # routes whose requests wait in an engine's queue
# What each operation may answer besides 200
# (server/errors.py, server/http/middleware.py, server/openai/served_models.py).
EXPECTED_ERRORS = {
    ("post", "/v1/completions"): QUEUED,
    ("post", "/v1/chat/completions"): QUEUED,
    ("post", "/v1/responses"): QUEUED,
    ("post", "/v1/messages"): QUEUED,
    ("post", "/v1/messages/count_tokens"): GATED | {"400", "404"},
    ("post", "/api/chat"): QUEUED,
    ("post", "/api/generate"): QUEUED,
    ("post", "/api/embed"): QUEUED,
    ("post", "/api/embeddings"): QUEUED,
    ("post", "/api/show"): GATED | {"400", "404"},
    ("get", "/api/version"): GATED,
    ("get", "/api/tags"): GATED,
    ("get", "/api/ps"): GATED,
    ("post", "/v1/embeddings"): QUEUED,
    ("post", "/embed"): QUEUED,
    ("post", "/"): QUEUED,
    ("post", "/rerank"): QUEUED,
    ("post", "/v1/rerank"): QUEUED,
    ("post", "/v2/rerank"): QUEUED,
    ("post", "/v1/score"): QUEUED,
    ("post", "/tokenize"): GATED | {"400", "404"},
    ("post", "/detokenize"): GATED | {"400", "404"},
    ("get", "/v1/models"): GATED | {"400"},
    ("get", "/v1/models/{model_id}"): GATED | {"404"},
    ("post", "/v1/models/{model_id}/load"): GATED | {"400", "403", "404"},
    ("post", "/v1/models/{model_id}/unload"): GATED | {"403", "404"},
    ("get", "/tokenizer_info"): GATED | {"400", "404"},
    ("get", "/health"): {"500", "503"},
    ("get", "/metrics"): {"401", "500", "503"},
    ("post", "/attention"): GATED | {"400", "404", "429"},
    ("get", "/kv_cache"): GATED | {"400", "404"},
    ("get", "/"): GATED | {"404"},
    ("get", "/playground/{name}"): GATED | {"404"},
    ("post", "/playground/sign-in"): GATED,
}
# The playground page and its files: a browser without the API key gets an HTML sign-in page.
PAGE_ROUTES = {("get", "/"), ("get", "/playground/{name}")}
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
]
# Bounds the fuzzing: examples per operation and generation mode (the coverage phase adds its boundary cases).
MAX_EXAMPLES = 25
SEED = 20261130
MAX_REQUEST_BYTES = 64 * 1024
MAX_BATCH = 4

# The document is the app's own, made without loading a model (create_app loads nothing until it serves):
# schemathesis builds one test per operation from it when this file is collected.
schema = schemathesis.openapi.from_dict(
    create_app(make_server_config("unused-model-dir")).openapi(),
    config=schemathesis.Config.from_dict(
        {"seed": SEED, "generation": {"max-examples": MAX_EXAMPLES, "database": "none"}}
    ),
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def serves_embeddings() -> bool:
    from engine.hub import models_hub

    return models_hub.is_cached(EMBEDDING_MODEL)


@pytest.fixture(scope="module")
def rerank_model_dir(tmp_path_factory, serves_embeddings):
    """A tiny random BERT cross-encoder (its tokenizer is the embedding model's), when that model is cached."""
    if not serves_embeddings:
        return None
    from engine.hub.models_hub import resolve_model
    from tests.engine.test_reranker import make_tiny_cross_encoder

    return make_tiny_cross_encoder(tmp_path_factory.mktemp("tiny-rerank"), "bert", str(resolve_model(EMBEDDING_MODEL)))


@pytest.fixture(scope="module")
def live_server(model_dir, serves_embeddings, rerank_model_dir):
    from engine.config import EmbedderConfig, RerankerConfig

    # Small limits bound every generated request: a 64-token context ends any generation within a few
    # dozen steps, and 4 items per batch keep embedding requests short (more is the documented 413).
    config = make_server_config(
        model_dir,
        max_model_len=64,
        max_client_batch_size=MAX_BATCH,
        max_request_bytes=MAX_REQUEST_BYTES,
        request_timeout=30.0,
    )
    if serves_embeddings:
        config = dataclasses.replace(config, embedder=EmbedderConfig(model=EMBEDDING_MODEL, max_model_len=64))
    if rerank_model_dir is not None:
        config = dataclasses.replace(config, reranker=RerankerConfig(model=str(rerank_model_dir)))
    with ServerThread(create_app(config)) as server:
        yield server


def validated(case: schemathesis.Case, response, checks=CHECKS) -> None:
    case.validate_response(response, checks=checks)


# ---- the document ----


def test_every_operation_documents_exactly_the_statuses_it_answers():
    document = schema.raw_schema
    operations = {(method, path): op for path, ops in document["paths"].items() for method, op in ops.items()}
    assert set(operations) == set(EXPECTED_ERRORS)
    for key, operation in operations.items():
        responses = operation["responses"]
        assert set(responses) == {"200"} | EXPECTED_ERRORS[key], key
        for status, response in responses.items():
            # uvicorn's 503 past --limit-concurrency comes before the middleware that adds X-Request-Id.
            assert response["headers"]["X-Request-Id"]["required"] is (status != "503"), (key, status)
            if status == "503":
                assert response["content"]["text/plain"] == PLAIN_TEXT, key
            if key in PAGE_ROUTES and status == "401":
                assert set(response["content"]) == {"text/html"}, key
            elif status != "200" and key not in (("get", "/health"), ("get", "/metrics")):
                body = ERROR_BODY
                if key[1].startswith("/v1/messages"):
                    body = ANTHROPIC_ERROR_BODY
                elif key[1].startswith("/api/"):
                    body = OLLAMA_ERROR_BODY
                error_body = {"application/json": {"schema": body}}
                assert response["content"] == (
                    error_body | {"text/plain": PLAIN_TEXT} if status == "503" else error_body
                )
                assert ("Retry-After" in response["headers"]) == (status in ("429", "503")), (key, status)
    assert "HTTPValidationError" not in document["components"]["schemas"]  # bad requests are 400, never 422
    assert set(document["components"]["schemas"]["ErrorDetail"]["required"]) == {"message", "type", "param", "code"}


def test_streaming_routes_document_sse_and_metrics_plain_text():
    document = schema.raw_schema
    for path, chunk in (("/v1/completions", "CompletionResponse"), ("/v1/chat/completions", "ChatCompletionChunk")):
        content = document["paths"][path]["post"]["responses"]["200"]["content"]
        assert set(content) == {"application/json", "text/event-stream"}
        data = content["text/event-stream"]["itemSchema"]["properties"]["data"]
        assert {"const": "[DONE]"} in data["anyOf"]
        event_body = next(branch for branch in data["anyOf"] if "contentSchema" in branch)["contentSchema"]
        assert event_body == {"anyOf": [{"$ref": f"#/components/schemas/{chunk}"}, ERROR_BODY]}
        assert chunk in document["components"]["schemas"]
    assert set(document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}


# ---- the live server, fuzzed from its document ----


@schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck))
def test_live_server_answers_only_what_its_document_says(case, live_server):
    case.call_and_validate(base_url=live_server.base_url, timeout=60, checks=CHECKS)


# ---- answers random requests rarely reach, asked for on purpose ----

PROMPT = "Hello world"
MESSAGES = [{"role": "user", "content": PROMPT}]
STREAMED = {"stream": True, "stream_options": {"include_usage": True}, "max_tokens": 4}


@pytest.mark.parametrize(
    ("path", "body", "status", "media_type"),
    [
        ("/v1/completions", {"prompt": PROMPT, "logprobs": 2, **STREAMED}, 200, "text/event-stream"),
        ("/v1/completions", {"prompt": [PROMPT, PROMPT], "n": 2, "echo": True, **STREAMED}, 200, "text/event-stream"),
        ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 2, **STREAMED}, 200, None),
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "logprobs": 2}, 200, "application/json"),
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4}, 200, "application/json"),
        ("/v1/responses", {"input": PROMPT, "stream": True, "max_output_tokens": 4}, 200, "text/event-stream"),
        ("/v1/responses", {"input": PROMPT, "max_output_tokens": 4}, 200, "application/json"),
        (
            "/v1/messages",
            {"model": "tiny-llama", "messages": MESSAGES, "max_tokens": 4, "stream": True},
            200,
            "text/event-stream",
        ),
        ("/v1/messages", {"messages": MESSAGES, "max_tokens": 4, "model": "no-such-model"}, 404, None),
        ("/v1/messages/count_tokens", {"messages": MESSAGES, "model": "tiny-llama"}, 200, "application/json"),
        ("/api/chat", {"model": "tiny-llama", "messages": MESSAGES, "options": {"num_predict": 4}}, 200, None),
        ("/api/chat", {"model": "tiny-llama", "messages": MESSAGES, "stream": False}, 200, "application/json"),
        ("/api/generate", {"model": "tiny-llama", "prompt": PROMPT, "stream": False}, 200, "application/json"),
        ("/api/chat", {"model": "no-such-model", "messages": MESSAGES}, 404, None),
        ("/v1/completions", {"prompt": PROMPT, "model": "no-such-model"}, 404, None),
        ("/v1/completions", {"prompt": [PROMPT] * (MAX_BATCH + 1), "max_tokens": 1}, 413, None),
        ("/tokenize", {"prompt": "x" * MAX_REQUEST_BYTES}, 413, None),
        ("/v1/embeddings", {"input": [PROMPT], "encoding_format": "base64"}, 200, "application/json"),
        ("/embed", {"inputs": [PROMPT] * (MAX_BATCH + 1)}, 413, None),
        ("/rerank", {"query": PROMPT, "texts": [PROMPT, "x"], "return_text": True}, 200, "application/json"),
        ("/v1/rerank", {"query": PROMPT, "documents": [PROMPT, {"text": "x"}], "top_n": 1}, 200, "application/json"),
        ("/v1/rerank", {"query": PROMPT, "documents": [PROMPT], "return_documents": False}, 200, None),
        ("/v1/score", {"text_1": PROMPT, "text_2": [PROMPT, "x"]}, 200, "application/json"),
        ("/v1/score", {"text_1": PROMPT, "text_2": [PROMPT] * (MAX_BATCH + 1)}, 413, None),
    ],
)
def test_live_answers_match_the_document(live_server, serves_embeddings, path, body, status, media_type):
    """Each answer is checked as the fuzzer checks its own (without an embedding model, embeddings and
    reranking are a 404: the tiny reranker borrows the embedding model's tokenizer)."""
    case = schema[path]["POST"].Case(body=body, media_type="application/json")
    response = case.call(base_url=live_server.base_url, timeout=60)
    if not serves_embeddings and path in ("/v1/embeddings", "/embed", "/rerank", "/v1/rerank", "/v1/score"):
        status = 404
    assert response.status_code == status, response.text
    if media_type is None and body.get("stream"):
        media_type = "text/event-stream"
    if media_type is None and path.startswith("/api/") and status == 200:
        media_type = "application/x-ndjson"  # Ollama streams unless told not to
    if media_type is not None and response.status_code == 200:
        assert response.headers["content-type"][0].startswith(media_type)
    validated(case, response)


def test_an_sse_chunk_off_its_schema_would_be_caught(live_server):
    """The SSE events really are validated: against a document whose chunk needs a field no chunk has, they fail."""
    document = dict(schema.raw_schema)
    components = {**document["components"], "schemas": dict(document["components"]["schemas"])}
    chunk = components["schemas"]["ChatCompletionChunk"]
    components["schemas"]["ChatCompletionChunk"] = {**chunk, "required": [*chunk["required"], "no_such_field"]}
    strict = schemathesis.openapi.from_dict({**document, "components": components})
    case = strict["/v1/chat/completions"]["POST"].Case(body={"messages": MESSAGES, **STREAMED})
    response = case.call(base_url=live_server.base_url, timeout=60)
    assert response.status_code == 200
    with pytest.raises(FailureGroup) as failures:
        validated(case, response)
    assert [failure.title for failure in failures.value.exceptions] == ["SSE event violates schema"]


# ---- a server not serving yet: the middleware's answers (no lifespan: the models never load) ----


def _call(app, case: schemathesis.Case, headers: dict[str, str] | None = None) -> httpx.Response:
    with_body = {"json": case.body} if case.method.upper() == "POST" else {}
    return TestClient(app).request(case.method, case.formatted_path, headers=headers, **with_body)


@pytest.mark.parametrize(
    ("path", "method", "body"),
    [
        ("/v1/completions", "POST", {"prompt": PROMPT}),
        ("/v1/messages", "POST", {"model": "m", "max_tokens": 1, "messages": MESSAGES}),
        ("/v1/models", "GET", None),
        ("/metrics", "GET", None),
    ],
)
def test_a_missing_api_key_is_the_documented_401(path, method, body):
    app = create_app(make_server_config("unused-model-dir", api_key="secret"))
    case = schema[path][method].Case(**({"body": body, "media_type": "application/json"} if body else {}))
    response = _call(app, case)
    assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
    validated(case, response)


@pytest.mark.parametrize("draining", [False, True])
def test_loading_and_draining_are_the_documented_503(draining):
    app = create_app(make_server_config("unused-model-dir"))
    if draining:
        state_of(app).shutdown.begin_draining()
    for path, method, body in (
        ("/v1/chat/completions", "POST", {"messages": MESSAGES}),
        ("/v1/messages", "POST", {"model": "m", "max_tokens": 1, "messages": MESSAGES}),
        ("/v1/embeddings", "POST", {"input": PROMPT}),
        ("/tokenize", "POST", {"prompt": PROMPT}),
        ("/v1/models", "GET", None),
        ("/health", "GET", None),
    ):
        case = schema[path][method].Case(**({"body": body, "media_type": "application/json"} if body else {}))
        response = _call(app, case)
        assert response.status_code == 503, (path, response.text)
        if path == "/v1/messages":
            assert response.json()["error"]["type"] == "overloaded_error"
        elif path != "/health":
            assert response.headers["retry-after"] == "1"
            assert response.json()["error"]["code"] == ("shutting_down" if draining else "model_loading")
        else:
            assert response.json()["status"] == ("draining" if draining else "loading")
        validated(case, response, checks=CHECKS[1:])  # a 503 on purpose: not_a_server_error would flag it
    metrics = schema["/metrics"]["GET"].Case()
    response = _call(app, metrics)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    validated(metrics, response)


def test_the_plain_text_503_past_the_connection_limit_is_documented():
    """uvicorn's own answer when --limit-concurrency connections are open, on any route."""
    for path, method in (("/v1/completions", "POST"), ("/health", "GET"), ("/metrics", "GET")):
        case = schema[path][method].Case()
        response = TestClient(service_unavailable).request(method, path)
        assert response.status_code == 503 and response.headers["content-type"].startswith("text/plain")
        validated(case, response, checks=CHECKS[1:])  # a 503 on purpose: not_a_server_error would flag it


def test_docs_page_is_served(live_server):
    response = httpx.get(f"{live_server.base_url}/docs")
    assert response.status_code == 200 and "/openapi.json" in response.text
    assert httpx.get(f"{live_server.base_url}/openapi.json").json() == schema.raw_schema
