"""Per-model deployments on Ray Serve, without a cluster: one deployment per catalogue model, each serving that
model alone, and the deployment each request goes to (server/ray/model_routes.py)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from engine.config import EmbedderConfig, EngineConfig
from server.catalogue.entries import FOREVER, ModelEntry
from server.config import ServerConfig
from server.ray.model_routes import ModelRoutes, joined_listing, model_deployments, requested_model
from server.ray.scale_out import ScaleOut


def _config() -> ServerConfig:
    more = (
        ModelEntry(("qwen3:8b", "qwen"), "generate", EngineConfig(model="/models/qwen3-8b.gguf"), keep_alive=60.0),
        ModelEntry(("qwen3/8b",), "generate", EngineConfig(model="/models/other.gguf")),
        ModelEntry(("bge",), "embed", EmbedderConfig(model="/models/bge")),
    )
    return ServerConfig(engine=EngineConfig(model="/models/small"), served_model_name=("small",), models=more)


def test_each_catalogue_model_is_a_deployment_serving_it_alone_loaded_at_start():
    deployments = model_deployments(_config())
    names = [d.name for d in deployments]
    assert names == [
        "KVServe-small",
        "KVServe-all-minilm-l6-v2",
        "KVServe-qwen3_8b",
        "KVServe-qwen3_8b-2",
        "KVServe-bge",
    ]
    for deployment in deployments:
        (only,) = deployment.config.catalogue
        assert only.names == deployment.entry.names and only.config == deployment.entry.config
        assert only.preload and only.keep_alive == FOREVER
    assert deployments[2].config.catalogue[0].config.model == "/models/qwen3-8b.gguf"


def test_a_deployments_one_model_runs_on_the_servers_thread_count():
    config = _config()
    threaded = dataclasses.replace(config, engine=dataclasses.replace(config.engine, num_threads=3))
    for deployment in model_deployments(threaded):
        (only,) = deployment.config.catalogue
        if only.task == "generate":
            assert only.config.num_threads == 3


def test_only_model_must_name_a_catalogue_model():
    with pytest.raises(ValueError, match="'nope' is not in the catalogue"):
        ServerConfig(only_model="nope")


@pytest.mark.parametrize(
    ("method", "path", "body", "deployment"),
    [
        ("POST", "/v1/chat/completions", {"model": "qwen"}, "KVServe-qwen3_8b"),
        ("POST", "/v1/completions", {"model": "/models/qwen3-8b.gguf"}, "KVServe-qwen3_8b"),
        ("POST", "/api/chat", {"model": "qwen3:8b:latest"}, "KVServe-qwen3_8b"),
        ("POST", "/api/show", {"name": "bge"}, "KVServe-bge"),
        ("POST", "/v1/embeddings", {"model": "bge", "input": "x"}, "KVServe-bge"),
        ("GET", "/v1/models/qwen3/8b", None, "KVServe-qwen3_8b-2"),
        ("POST", "/v1/models/qwen3%2F8b/unload", None, "KVServe-qwen3_8b-2"),
        ("POST", "/v1/models/bge/load", None, "KVServe-bge"),
        # no model named, or one not served: the default of the path's task (which answers the 404)
        ("POST", "/v1/chat/completions", {"messages": []}, "KVServe-small"),
        ("POST", "/v1/embeddings", {"input": "x"}, "KVServe-all-minilm-l6-v2"),
        ("POST", "/", {"inputs": "x"}, "KVServe-all-minilm-l6-v2"),
        ("POST", "/v1/completions", {"model": "missing"}, "KVServe-small"),
        ("POST", "/v1/completions", b"{not json", "KVServe-small"),
        ("GET", "/health", None, "KVServe-small"),
        ("POST", "/v1/rerank", {"query": "q"}, "KVServe-small"),  # no rerank model: generation's answers
    ],
)
def test_a_request_goes_to_the_deployment_of_the_model_it_names(method, path, body, deployment):
    routes = ModelRoutes(model_deployments(_config()))
    raw = body if isinstance(body, bytes) else json.dumps(body).encode() if body is not None else b""
    assert routes.deployment_for(method, path, raw) == deployment


def test_only_a_post_body_or_a_models_path_names_a_model():
    assert requested_model("GET", "/v1/completions", b'{"model": "qwen"}') is None
    assert requested_model("POST", "/v1/completions", b'["qwen"]') is None
    assert requested_model("POST", "/v1/completions", b'{"model": 3}') is None
    assert requested_model("POST", "/v1/completions", b'{"name": "qwen"}') is None  # `name` is Ollama's only


def test_model_lists_are_asked_of_every_deployment_and_joined_in_order():
    assert ModelRoutes.is_listing("GET", "/v1/models") and ModelRoutes.is_listing("GET", "/api/ps")
    assert not ModelRoutes.is_listing("GET", "/v1/models/qwen") and not ModelRoutes.is_listing("POST", "/api/tags")
    bodies = [json.dumps({"object": "list", "data": [{"id": name}]}).encode() for name in ("a", "b")]
    assert json.loads(joined_listing("/v1/models", bodies)) == {"object": "list", "data": [{"id": "a"}, {"id": "b"}]}
    tags = [json.dumps({"models": models}).encode() for models in ([{"name": "a"}], [])]
    assert json.loads(joined_listing("/api/tags", tags)) == {"models": [{"name": "a"}]}


def test_per_model_deployments_need_ray():
    assert ScaleOut(replicas=1, model_deployments="per-model").model_deployments == "per-model"
    with pytest.raises(ValueError, match="needs replicas"):
        ScaleOut(model_deployments="per-model")
    with pytest.raises(ValueError, match="model_deployments must be one of"):
        ScaleOut(replicas=1, model_deployments="each")


def test_on_one_machine_each_models_replicas_get_an_equal_share(monkeypatch):
    from server.ray import local

    monkeypatch.setattr(local.os, "cpu_count", lambda: 16)
    config = _config()  # five models
    shared, shared_cpus = local.replica_share(config, ScaleOut(replicas=2))
    per_model, per_model_cpus = local.replica_share(config, ScaleOut(replicas=2, model_deployments="per-model"))
    assert (shared_cpus, shared.engine.num_threads) == (8.0, 7)
    assert (per_model_cpus, per_model.engine.num_threads) == (1.6, 1)
