"""Each catalogue model a Ray Serve deployment of its own (`--replicas 1 --model-deployments per-model`): two
tiny generation models and an embedder on one local Ray instance behind one address. A request reaches the
deployment of the model it names (each deployment serves that model alone, so an answer from the wrong one
would be a 404) and answers as the model does served alone; the lists of models join every deployment's."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from engine import SamplingParams
from engine.config import EngineConfig
from engine.hub.models_hub import kvserve_home
from engine.llm import LLM
from tests.support.server_harness import ServerProcess
from tests.support.tiny_models import make_tiny_model

pytestmark = [pytest.mark.ray, pytest.mark.slow]

EMBEDDING_MODEL = "all-minilm-l6-v2"
PROMPT = "The quick brown fox"
SERVE_ARGS = [
    *("--max-model-len", "256", "--kv-cache-memory", "8MiB", "--max-num-seqs", "2"),
    *("--replicas", "1", "--model-deployments", "per-model", "--shutdown-timeout", "0.5"),
]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    return {name: make_tiny_model(tmp_path_factory.mktemp(name), "llama", seed=seed)
            for seed, name in enumerate(("tiny-a", "tiny-b"))}  # fmt: skip


@pytest.fixture(scope="module")
def served(tmp_path_factory, model_dirs):
    pytest.importorskip("ray.serve")
    args = [
        *("--model", str(model_dirs["tiny-a"]), "--served-model-name", "tiny-a"),
        *("--model", f"tiny-b={model_dirs['tiny-b']}", "--embedding-model", EMBEDDING_MODEL),
        *SERVE_ARGS,
    ]
    env = {"HOME": str(tmp_path_factory.mktemp("home")), "KVSERVE_HOME": str(kvserve_home())}
    proc = ServerProcess(args, tmp_path_factory.mktemp("ray") / "server.log", env=env)
    try:
        proc.wait_ready(timeout=240)
        yield proc
    finally:
        if proc.process.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except Exception:
                proc.kill()
        proc.kill()


def _complete(served: ServerProcess, **body) -> httpx.Response:
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, **body}
    return httpx.post(f"{served.base_url}/v1/completions", json=body, timeout=60)


def test_each_model_answers_from_its_own_deployment_as_it_does_alone(served, model_dirs):
    texts = {}
    for model in ("tiny-a", "tiny-b", "tiny-a", "tiny-b"):
        answer = _complete(served, model=model)
        assert answer.status_code == 200, answer.text
        assert answer.json()["model"] == model
        texts.setdefault(model, set()).add(answer.json()["choices"][0]["text"])
    for model in ("tiny-a", "tiny-b"):
        alone = LLM.from_config(EngineConfig(model=str(model_dirs[model]), max_model_len=256))
        expected = alone.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0))[0][0].text
        assert texts[model] == {expected}
    assert texts["tiny-a"] != texts["tiny-b"]
    unnamed = _complete(served)  # no model: the default generation model's deployment
    assert unnamed.status_code == 200 and unnamed.json()["model"] == "tiny-a"
    vectors = httpx.post(f"{served.base_url}/v1/embeddings", json={"input": [PROMPT]}, timeout=60)
    assert vectors.status_code == 200, vectors.text
    assert vectors.json()["model"] == EMBEDDING_MODEL and len(vectors.json()["data"][0]["embedding"]) == 384


def test_the_model_lists_join_every_deployment(served):
    cards = httpx.get(f"{served.base_url}/v1/models", timeout=30).json()["data"]
    assert [card["id"] for card in cards] == ["tiny-a", EMBEDDING_MODEL, "tiny-b"]
    assert all(card["loaded"] for card in cards)
    tags = httpx.get(f"{served.base_url}/api/tags", timeout=30).json()["models"]
    assert {tag["name"].removesuffix(":latest") for tag in tags} >= {"tiny-a", "tiny-b"}


def test_errors_come_from_the_deployment_a_single_kvserve_would_answer_with(served):
    missing = _complete(served, model="no-such-model")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found", missing.text
    wrong_task = _complete(served, model=EMBEDDING_MODEL)  # the embedder's deployment refuses generation
    assert wrong_task.status_code == 400, wrong_task.text
    assert httpx.get(f"{served.base_url}/v1/models/no-such-model", timeout=30).status_code == 404


def test_unloading_one_model_leaves_the_others_and_its_next_request_loads_it(served):
    unloaded = httpx.post(f"{served.base_url}/v1/models/tiny-b/unload", timeout=60)
    assert unloaded.status_code == 200, unloaded.text
    cards = {card["id"]: card for card in httpx.get(f"{served.base_url}/v1/models", timeout=30).json()["data"]}
    assert cards["tiny-a"]["loaded"] and not cards["tiny-b"]["loaded"]
    assert _complete(served, model="tiny-a").status_code == 200
    again = _complete(served, model="tiny-b")
    assert again.status_code == 200 and again.json()["model"] == "tiny-b", again.text
