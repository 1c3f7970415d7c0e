"""Per-model deployments on Ray Serve: each catalogue model a deployment of its own, and which one a request goes to.

With `--model-deployments per-model`, the application has one KVServe deployment per catalogue model
(server/ray/deployments.py), each running a kvserve whose only model is that one (ServerConfig.only_model):
its own replicas, autoscaling, CPUs and engine. The ingress (server/ray/ingress.py) reads the request's
model name and calls that model's deployment:

- the model a request names: the body's `model` field (Ollama's `/api/show` may send `name`), or the
  `{id}` of `/v1/models/{id}`, `/load` and `/unload`. Every served name and the model's path name it, and
  so does `NAME:latest` as Ollama's clients write it;
- a request that names no model goes to the default model of the task its path serves (embeddings,
  reranking, else generation); so does one naming a model that is not served, whose deployment then answers
  the 404 (or 400, for another task's model) exactly as a single kvserve would;
- the lists of models (`GET /v1/models`, Ollama's `/api/tags` and `/api/ps`) are asked of every deployment
  and joined, in catalogue order.

Plain functions and data, no Ray import: unit-tested without a cluster.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from server.catalogue.entries import LATEST, ModelEntry, Task
from server.config import ServerConfig

SHARED_DEPLOYMENT = "KVServe"  # the one deployment serving every model (--model-deployments shared)
DEPLOYMENT_PREFIX = SHARED_DEPLOYMENT + "-"
MODEL_PATH = re.compile(r"^/v1/models/(?P<id>.+?)(?:/(?:load|unload))?$")
# path -> the key of its answer's list of models
LISTING_PATHS = {"/v1/models": "data", "/api/tags": "models", "/api/ps": "models"}
_EMBED_PATHS = ("/v1/embeddings", "/embed", "/api/embed", "/api/embeddings")
_RERANK_PATHS = ("/v1/rerank", "/v2/rerank", "/rerank", "/v1/score")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


@dataclass(frozen=True)
class ModelDeployment:
    """One catalogue model's deployment: its Serve name and the config its replicas run."""

    name: str
    entry: ModelEntry
    config: ServerConfig


def model_deployments(config: ServerConfig) -> list[ModelDeployment]:
    """One deployment per catalogue model, in catalogue order (the default of each task first). Names are
    DEPLOYMENT_PREFIX + the model's name with anything but letters, digits, '.', '_' and '-' as '_' (and a
    number after it where two would be the same)."""
    deployments = []
    taken: set[str] = set()
    for entry in config.catalogue:
        base = DEPLOYMENT_PREFIX + _UNSAFE.sub("_", entry.name)
        name, number = base, 2
        while name in taken:
            name, number = f"{base}-{number}", number + 1
        taken.add(name)
        deployments.append(ModelDeployment(name, entry, dataclasses.replace(config, only_model=entry.name)))
    return deployments


def task_of_path(method: str, path: str) -> Task:
    """The task a route serves (a POST to `/` is TEI's embed route; anything not embeddings or reranking
    goes with generation: the playground, /health, /metrics, tokenizing)."""
    if path in _EMBED_PATHS or (method == "POST" and path == "/"):
        return "embed"
    if path in _RERANK_PATHS:
        return "rerank"
    return "generate"


def requested_model(method: str, path: str, body: bytes) -> str | None:
    """The model name a request gives (see the module docstring); None when it gives none."""
    match = MODEL_PATH.match(path)
    if match is not None:
        return unquote(match.group("id"))
    if method != "POST" or not body:
        return None
    try:
        request = json.loads(body)
    except (ValueError, RecursionError):  # the deployment answers the 400 (server/http/json_body.py)
        return None
    if not isinstance(request, dict):
        return None
    name = request.get("model")
    if name is None and path.startswith("/api/"):
        name = request.get("name")
    return name if isinstance(name, str) else None


class ModelRoutes:
    """Which deployment serves a request: built once from the deployments, read by the ingress."""

    def __init__(self, deployments: list[ModelDeployment]) -> None:
        self.names = [deployment.name for deployment in deployments]
        self._by_model: dict[str, str] = {}
        self._default: dict[str, str] = {}
        for deployment in deployments:
            entry = deployment.entry
            for name in (*entry.names, entry.config.model):
                self._by_model.setdefault(name, deployment.name)
            self._default.setdefault(entry.task, deployment.name)
        self._fallback = deployments[0].name

    def deployment_for(self, method: str, path: str, body: bytes) -> str:
        """The deployment to call (see the module docstring)."""
        name = requested_model(method, path, body)
        if name is not None:
            found = self._by_model.get(name) or self._by_model.get(name.removesuffix(LATEST))
            if found is not None:
                return found
        return self._default.get(task_of_path(method, path), self._fallback)

    @staticmethod
    def is_listing(method: str, path: str) -> bool:
        """Whether every deployment is asked and the answers joined."""
        return method == "GET" and path in LISTING_PATHS


def joined_listing(path: str, bodies: list[bytes]) -> bytes:
    """One list-of-models answer from each deployment's (all status 200, in deployment order): the first
    answer with every answer's models in its list."""
    key = LISTING_PATHS[path]
    answers: list[dict[str, Any]] = [json.loads(body) for body in bodies]
    joined = dict(answers[0])
    joined[key] = [model for answer in answers for model in answer.get(key, [])]
    return json.dumps(joined).encode()
