"""What a soak sends: the seeded mix of completions and chat (streamed or not, some with n > 1), embeddings,
streams to abandon after their first event, and malformed requests."""

from __future__ import annotations

import random
from dataclasses import dataclass

from clients.bench.workload import WORDS

GENERATION_KINDS = ("completion", "completion_stream", "chat", "chat_stream")


@dataclass(frozen=True)
class SoakPlan:
    """What to send. abandon_fraction is of the streamed requests, multi_sample_fraction of the generation
    requests, the others of all requests."""

    num_requests: int = 300
    concurrency: int = 8
    duration_s: float = 180.0
    abandon_fraction: float = 0.25
    malformed_fraction: float = 0.1
    embedding_fraction: float = 0.15
    multi_sample_fraction: float = 0.2  # n = 2 or 3
    max_tokens: int = 16
    seed: int = 0


@dataclass(frozen=True)
class SoakRequest:
    kind: str  # one of GENERATION_KINDS, "embedding" or "malformed"
    body: dict | str  # a str is sent as a raw (malformed) body
    path: str
    abandon: bool = False


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 24)))


def _malformed(rng: random.Random, model: str) -> SoakRequest:
    """A request the server must refuse with a 4xx: broken JSON, a missing or mistyped field, an unknown model."""
    choices = [
        SoakRequest("malformed", '{"model": "' + model + '", "prompt": "Hi", ', "/v1/completions"),
        SoakRequest("malformed", {"model": model}, "/v1/chat/completions"),
        SoakRequest("malformed", {"model": model, "prompt": "Hi", "max_tokens": "many"}, "/v1/completions"),
        SoakRequest("malformed", {"model": model, "prompt": "Hi", "n": 0}, "/v1/completions"),
        SoakRequest("malformed", {"model": model, "messages": [{"role": "nobody"}]}, "/v1/chat/completions"),
        SoakRequest("malformed", {"model": "no-such-model", "prompt": "Hi"}, "/v1/completions"),
        SoakRequest("malformed", {"model": model, "prompt": "Hi", "temperature": -1}, "/v1/completions"),
    ]
    return rng.choice(choices)


def build_plan(plan: SoakPlan, model: str, embedding_model: str | None) -> list[SoakRequest]:
    """The seeded list of requests, in sending order."""
    rng = random.Random(plan.seed)
    requests = []
    for _ in range(plan.num_requests):
        draw = rng.random()
        if draw < plan.malformed_fraction:
            requests.append(_malformed(rng, model))
            continue
        if embedding_model and draw < plan.malformed_fraction + plan.embedding_fraction:
            inputs = [_prompt(rng) for _ in range(rng.randint(1, 4))]
            body = {"model": embedding_model, "input": inputs}
            requests.append(SoakRequest("embedding", body, "/v1/embeddings"))
            continue
        kind = rng.choice(GENERATION_KINDS)
        body: dict = {"model": model, "max_tokens": rng.randint(1, plan.max_tokens), "temperature": 0.7}
        body["seed"] = rng.randint(0, 2**31)
        if rng.random() < plan.multi_sample_fraction:
            body["n"] = rng.randint(2, 3)
        if kind.startswith("chat"):
            body["messages"] = [{"role": "user", "content": _prompt(rng)}]
            path = "/v1/chat/completions"
        else:
            body["prompt"] = _prompt(rng)
            path = "/v1/completions"
        abandon = False
        if kind.endswith("_stream"):
            body["stream"] = True
            # Abandoned streams must outlive their first event, so the server is mid-generation when they go.
            abandon = rng.random() < plan.abandon_fraction
            if abandon:
                body["max_tokens"] = max(body["max_tokens"], plan.max_tokens)
                body["ignore_eos"] = True
        requests.append(SoakRequest(kind, body, path, abandon))
    return requests
