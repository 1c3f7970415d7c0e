"""Routes and defaults that existing clients expect: GET /v1/models/{id}, TEI's embed at the root, the
default max_tokens, and token-id embedding input made by another tokenizer refused instead of embedded."""

from __future__ import annotations

import httpx
import openai
import pytest

from engine.config import EmbedderConfig
from engine.errors import ForeignTokenIdsError
from engine.pooling.embedder import Embedder
from engine.text.tokenizer import Tokenizer
from server.app import create_app
from tests.engine.test_embedder import MODEL_NAME as EMBEDDING_MODEL
from tests.engine.test_embedder import minilm_dir  # noqa: F401 - fixture
from tests.support.server_harness import ServerThread, make_server_config
from tests.support.tiny_models import make_tiny_llama

SENTENCES = [
    "hello world",
    "The quick brown fox jumps over the lazy dog.",
    "I love pizza",
    "Continuous batching lets many requests share one forward pass, and a paged cache keeps their keys in blocks.",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def server(model_dir, minilm_dir):  # noqa: F811 - the fixture above
    config = make_server_config(model_dir, embedding_model=EMBEDDING_MODEL, default_max_tokens=5)
    with ServerThread(create_app(config)) as srv:
        yield srv


def test_one_model_by_id_through_the_openai_sdk(server):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    generation = client.models.retrieve("tiny-llama")
    assert generation.id == "tiny-llama" and generation.model_extra["task"] == "generate"
    assert client.models.retrieve(EMBEDDING_MODEL).model_extra["task"] == "embed"
    listed = {m.id: m.model_dump() for m in client.models.list()}
    assert generation.model_dump() | {"created": 0} == listed["tiny-llama"] | {"created": 0}
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("no-such/model")
    assert missing.value.body["code"] == "model_not_found"


def test_tei_embed_at_the_root_equals_embed(server):
    body = {"inputs": SENTENCES, "normalize": True}
    at_root = httpx.post(f"{server.base_url}/", json=body)
    assert at_root.status_code == 200, at_root.text
    assert at_root.json() == httpx.post(f"{server.base_url}/embed", json=body).json()


def test_huggingface_hub_feature_extraction_against_the_root(server):
    hub = pytest.importorskip("huggingface_hub")
    vectors = hub.InferenceClient(model=server.base_url).feature_extraction(SENTENCES[0])
    expected = httpx.post(f"{server.base_url}/embed", json={"inputs": SENTENCES[0]}).json()
    assert vectors.shape == (1, len(expected[0]))
    assert vectors[0].tolist() == pytest.approx(expected[0], abs=1e-6)


def test_the_default_max_tokens_applies_where_a_request_sets_none(server):
    base = {"temperature": 0, "ignore_eos": True}
    chat = httpx.post(
        f"{server.base_url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], **base}
    ).json()
    assert chat["usage"]["completion_tokens"] == 5 and chat["choices"][0]["finish_reason"] == "length"
    completion = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "Hi", **base}).json()
    assert completion["usage"]["completion_tokens"] == 5
    asked = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "Hi", "max_tokens": 7, **base}).json()
    assert asked["usage"]["completion_tokens"] == 7


def test_token_ids_from_another_tokenizer_are_refused_over_http(server, model_dir):
    other = Tokenizer.from_path(model_dir)  # the generation model's tokenizer, not the embedder's
    # and tiktoken's cl100k ids for "hello world", what LangChain's OpenAIEmbeddings sends by default:
    # in this vocabulary they are two whole words ("denise 皇") that re-encode the same
    foreign = [[15339, 1917], *(other.encode(s, add_special_tokens=False) for s in SENTENCES)]
    assert len(foreign[-1]) >= 16  # long enough that the check may skip leading tokens, and still refused
    for ids in foreign:
        refused = httpx.post(f"{server.base_url}/v1/embeddings", json={"input": ids})
        assert refused.status_code == 400, ids
    error = refused.json()["error"]
    assert error["code"] == "invalid_token_ids" and "check_embedding_ctx_length=False" in error["message"]
    own = httpx.post(f"{server.base_url}/tokenize", json={"prompt": "x"})  # the server goes on
    assert own.status_code == 200


def test_token_id_input_modes(minilm_dir):  # noqa: F811 - the fixture above
    checking = Embedder(EmbedderConfig(model=EMBEDDING_MODEL))
    own = checking.tokenize(SENTENCES)
    # The model's own ids pass, and embed as the text does.
    assert checking.tokenize(own) == own
    # Without the special tokens its tokenizer puts around every text: refused (tiktoken's ids lack them).
    for ids in own:
        with pytest.raises(ForeignTokenIdsError):
            checking.tokenize([ids[1:-1]])
    # Ids its tokenizer would not make of their text (one word split in two pieces) are refused.
    cls, sep = own[0][0], own[0][-1]
    vocab = checking._tokenizers[None]
    pieces = [cls, vocab.token_to_id("play"), vocab.token_to_id("##ing"), sep]  # "playing" is one token
    assert None not in pieces and vocab.encode("playing").ids != pieces
    with pytest.raises(ForeignTokenIdsError):
        checking.tokenize([pieces])
    word = [cls, vocab.token_to_id("playing"), sep]
    assert checking.tokenize([word]) == [word]

    accepting = Embedder(EmbedderConfig(model=EMBEDDING_MODEL, token_ids="accept"))
    assert accepting.tokenize([pieces, own[0][1:-1]]) == [pieces, own[0][1:-1]]
    rejecting = Embedder(EmbedderConfig(model=EMBEDDING_MODEL, token_ids="reject"))
    with pytest.raises(ForeignTokenIdsError, match="text only"):
        rejecting.tokenize(own)
    assert rejecting.tokenize(SENTENCES) == own
    with pytest.raises(ValueError, match="token_ids"):
        EmbedderConfig(model=EMBEDDING_MODEL, token_ids="maybe")


def test_langchain_openai_embeddings_sending_text(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    embeddings = langchain_openai.OpenAIEmbeddings(
        model=EMBEDDING_MODEL,
        base_url=f"{server.base_url}/v1",
        api_key="unused",
        check_embedding_ctx_length=False,  # send the text, not tiktoken's ids (docs/api/embeddings-and-reranking.md)
    )
    vectors = embeddings.embed_documents(SENTENCES)
    expected = httpx.post(f"{server.base_url}/v1/embeddings", json={"input": SENTENCES}).json()["data"]
    for ours, theirs in zip(vectors, expected, strict=True):
        assert ours == pytest.approx(theirs["embedding"], abs=1e-6)
