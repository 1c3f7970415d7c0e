"""POST /v1/embeddings (through the openai SDK) and POST /embed (httpx) over real HTTP.

The embedding router is mounted on a small FastAPI app with the ServerState and error
handlers the server gives it, and served by uvicorn on a free port. A client that leaves
is checked on the ASGI app directly, with an embedder that never answers.
"""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import types
from contextlib import asynccontextmanager

import httpx
import numpy as np
import openai
import pytest
import torch
from fastapi import FastAPI

from engine.config import EmbedderConfig, EngineConfig
from engine.hub.models_hub import DEFAULT_GENERATION_MODEL
from engine.serving.async_encoder import AsyncEncoder
from engine.serving.torch_worker import RequestLimits
from server.config import ServerConfig
from server.errors import install_error_handlers
from server.routes import embeddings as embedding_routes
from server.state import ServerState, attach_state, state_of
from tests.engine.test_embedder import MODEL_NAME, SENTENCES, embedder, minilm_dir, st_model, st_vectors  # noqa: F401
from tests.support.asgi import SilentEncoder, post_and_leave
from tests.support.server_harness import ServerThread

GENERATION_MODEL = DEFAULT_GENERATION_MODEL
MAX_CLIENT_BATCH_SIZE = 40


class _RecordingMetrics:
    """Stands in for ServerMetrics: records what the routes observe."""

    def __init__(self) -> None:
        self.observed: list[dict] = []

    def observe_embedding_request(self, **fields) -> None:
        self.observed.append(fields)


def _make_app(async_embedder) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await async_embedder.start()
        yield
        await async_embedder.stop()

    app = FastAPI(lifespan=lifespan)
    config = ServerConfig(
        engine=EngineConfig(model=GENERATION_MODEL),
        embedder=EmbedderConfig(model=MODEL_NAME),
        max_client_batch_size=MAX_CLIENT_BATCH_SIZE,
    )
    state = ServerState(config=config, is_ready=True)
    state.models.install(state.models.default("embed"), async_embedder)
    state.metrics = _RecordingMetrics()
    attach_state(app, state)
    app.include_router(embedding_routes.router)
    install_error_handlers(app)
    return app


@pytest.fixture(scope="module")
def server(embedder):  # noqa: F811 - the session fixture imported above
    async_embedder = AsyncEncoder(embedder)
    assert async_embedder.model_name == MODEL_NAME  # the alias it was configured with
    app = _make_app(async_embedder)
    server = ServerThread(app).start(wait_ready=False)  # the test app has no readiness to wait for
    yield types.SimpleNamespace(url=server.base_url, app=app)
    server.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _assert_exact(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() <= 1e-5
    assert torch.nn.functional.cosine_similarity(ours, ref).min().item() >= 0.99999


def test_openai_sdk_float_matches_sentence_transformers(client, st_vectors, server):  # noqa: F811
    response = client.embeddings.create(model=MODEL_NAME, input=SENTENCES, encoding_format="float")
    assert [d.index for d in response.data] == list(range(len(SENTENCES)))
    _assert_exact(torch.tensor([d.embedding for d in response.data]), st_vectors)
    assert response.model == MODEL_NAME
    assert response.usage.prompt_tokens == response.usage.total_tokens > len(SENTENCES) * 3
    observed = state_of(server.app).metrics.observed[-1]
    assert observed["endpoint"] == "/v1/embeddings" and observed["num_inputs"] == len(SENTENCES)
    assert observed["num_prompt_tokens"] == response.usage.prompt_tokens and observed["latency_seconds"] > 0


def test_openai_sdk_default_base64_matches_sentence_transformers(client, st_vectors):  # noqa: F811
    # the SDK asks for base64 when encoding_format is not given, and decodes it itself
    response = client.embeddings.create(model=MODEL_NAME, input=SENTENCES)
    _assert_exact(torch.tensor(np.array([d.embedding for d in response.data])), st_vectors)


def test_base64_decodes_to_the_float_vector(server):
    body = {"model": MODEL_NAME, "input": "base64 round trip"}
    floats = httpx.post(f"{server.url}/v1/embeddings", json={**body, "encoding_format": "float"}).json()
    packed = httpx.post(f"{server.url}/v1/embeddings", json={**body, "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(packed["data"][0]["embedding"]), dtype="<f4")
    assert decoded.tolist() == floats["data"][0]["embedding"]  # bit for bit


def test_single_string_token_ids_and_dimensions(client, embedder):  # noqa: F811
    one = client.embeddings.create(model=MODEL_NAME, input="Hello", encoding_format="float")
    assert len(one.data) == 1 and len(one.data[0].embedding) == 384
    ids = embedder.tokenize(["Hello"])[0]
    by_ids = client.embeddings.create(model=MODEL_NAME, input=ids, encoding_format="float")
    np.testing.assert_allclose(by_ids.data[0].embedding, one.data[0].embedding, atol=1e-6)
    other = embedder.tokenize(["Hi there"])[0]
    two = client.embeddings.create(model=MODEL_NAME, input=[ids, other], encoding_format="float")
    assert len(two.data) == 2 and two.usage.prompt_tokens == len(ids) + len(other)
    short = client.embeddings.create(model=MODEL_NAME, input="Hello", dimensions=32, encoding_format="float")
    full = np.array(one.data[0].embedding[:32])
    np.testing.assert_allclose(short.data[0].embedding, full / np.linalg.norm(full), atol=1e-6)


def test_tei_embed_matches_sentence_transformers(server, st_vectors):  # noqa: F811
    response = httpx.post(f"{server.url}/embed", json={"inputs": SENTENCES}, timeout=120)
    assert response.status_code == 200
    _assert_exact(torch.tensor(response.json()), st_vectors)
    single = httpx.post(f"{server.url}/embed", json={"inputs": "Hello", "normalize": False}).json()
    assert len(single) == 1 and abs(np.linalg.norm(single[0]) - 1.0) > 1e-3


def test_tei_embed_truncates_both_ways(server, embedder):  # noqa: F811
    text = " ".join(f"piece{i}" for i in range(600))
    too_long = httpx.post(f"{server.url}/embed", json={"inputs": text})
    assert too_long.status_code == 400
    message = too_long.json()["error"]["message"]
    num_tokens = len(embedder.tokenize([text], truncate=True)[0])  # 512: the text itself is longer
    assert num_tokens == 512 and "512" in message and "1728 tokens" in message
    for direction in ("Right", "left"):
        got = httpx.post(
            f"{server.url}/embed", json={"inputs": text, "truncate": True, "truncation_direction": direction}
        )
        assert got.status_code == 200
        want = embedder.embed([text], truncate=True, truncation_direction=direction.lower()).vectors
        np.testing.assert_allclose(got.json()[0], want[0].numpy(), atol=1e-6)


def test_over_long_input_is_a_400_with_both_numbers(client):
    text = "word " * 600
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model=MODEL_NAME, input=["fine", text])
    message = info.value.body["message"]
    assert "602" in message and "512" in message


def test_too_many_inputs_is_a_413_naming_the_limit(client, server):
    with pytest.raises(openai.APIStatusError) as info:
        client.embeddings.create(model=MODEL_NAME, input=["x"] * (MAX_CLIENT_BATCH_SIZE + 1))
    assert info.value.status_code == 413 and str(MAX_CLIENT_BATCH_SIZE) in info.value.body["message"]
    response = httpx.post(f"{server.url}/embed", json={"inputs": ["x"] * (MAX_CLIENT_BATCH_SIZE + 1)})
    assert response.status_code == 413 and str(MAX_CLIENT_BATCH_SIZE) in response.json()["error"]["message"]


def test_model_names(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.embeddings.create(model="no-such-model", input="x")
    assert info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model=GENERATION_MODEL, input="x")
    message = info.value.body["message"]
    assert "generation model" in message and "/v1/completions" in message and MODEL_NAME in message


def test_malformed_requests(server):
    cases = (
        {"model": MODEL_NAME, "input": []},
        {"model": MODEL_NAME, "input": [[1, 2], "mixed"]},
        {"model": MODEL_NAME, "input": "x", "dimensions": 1000},
        {"model": MODEL_NAME, "input": [[1, 99999]]},
    )
    for body in cases:
        response = httpx.post(f"{server.url}/v1/embeddings", json=body)
        assert 400 <= response.status_code < 500, body
    response = httpx.post(f"{server.url}/v1/embeddings", json={"model": MODEL_NAME, "input": "x", "bogus": 1})
    assert response.status_code in (400, 422)


@pytest.mark.parametrize(
    ("path", "body", "param", "words"),
    [
        ("/v1/embeddings", {"input": "\ud800"}, "input", "input: the text is not valid Unicode (a lone surrogate)"),
        ("/v1/embeddings", {"input": ["fine", "broken \udfff"]}, "input.1", "input.1: the text is not valid Unicode"),
        ("/embed", {"inputs": "\ud800"}, "inputs", "not valid Unicode"),
        ("/v1/embeddings", {"input": [5, True]}, "input", "token id is a non-negative integer"),
        ("/embed", {"inputs": [[5], [False]]}, "inputs", "token id is a non-negative integer"),
        ("/v1/embeddings", {"input": "x", "dimensions": 10**30}, "dimensions", "dimensions: "),
    ],
)
def test_invalid_text_and_bool_token_ids_are_a_400_naming_the_input(server, path, body, param, words):
    # json.dumps escapes a lone surrogate as \ud800 (httpx's own encoder cannot send one)
    content = json.dumps(body).encode()
    response = httpx.post(f"{server.url}{path}", content=content, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error
    ok = httpx.post(f"{server.url}/v1/embeddings", json={"input": "still fine"})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize(
    ("path", "body"),
    [("/v1/embeddings", {"model": MODEL_NAME, "input": ["a", "b"]}), ("/embed", {"inputs": "a"})],
)
def test_client_leaving_cancels_the_embedding_with_a_499(path, body):
    silent = SilentEncoder(MODEL_NAME, 512)
    app = _make_app(silent)
    payload = json.dumps(body).encode()
    sent = post_and_leave(
        app, path, payload, silent.is_working
    )  # the client leaves while its inputs are being embedded
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499
    assert silent.num_cancelled == 1


def test_embedding_queue_bound_and_deadline_answer_429_and_504(embedder, monkeypatch):  # noqa: F811
    """Embeddings keep generation's contract over HTTP: a full queue is a 429 with Retry-After,
    a request past --request-timeout is a 504, and the server answers normally afterwards."""
    gate = threading.Event()
    real_forward = embedder.forward_pooled

    def gated_forward(token_ids):
        gate.wait()
        return real_forward(token_ids)

    monkeypatch.setattr(embedder, "forward_pooled", gated_forward)
    app = _make_app(AsyncEncoder(embedder, limits=RequestLimits(max_queued_requests=1, request_timeout=1.0)))
    body = {"model": MODEL_NAME, "input": "x"}

    async def main():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://kvserve") as client:
                in_forward = asyncio.create_task(client.post("/v1/embeddings", json=body))
                await asyncio.sleep(0.2)  # taken into the forward that waits at the gate
                queued = asyncio.create_task(client.post("/v1/embeddings", json=body))
                await asyncio.sleep(0.2)
                full = await client.post("/v1/embeddings", json=body)
                timed_out = [await queued, await in_forward]
                gate.set()
                after = await client.post("/v1/embeddings", json=body)
                return full, timed_out, after

    full, timed_out, after = asyncio.run(main())
    assert full.status_code == 429 and full.headers["Retry-After"] == "1"
    assert full.json()["error"]["code"] == "queue_full"
    for response in timed_out:
        assert response.status_code == 504 and response.json()["error"]["code"] == "request_timeout"
    assert after.status_code == 200 and len(after.json()["data"][0]["embedding"]) == 384
