"""ScaleOut: how many kvserve replicas to run on Ray Serve, and how requests reach them.

What `kvserve serve --replicas N` (and the Ray application builder, server/ray/app.py) is told beside the
ServerConfig: not a setting of any one replica, so not in ServerConfig. Plain data, no Ray import: the CLI
builds it whether or not Ray is installed.
"""

from __future__ import annotations

from dataclasses import dataclass

# prefix: a request goes to the replica its prompt's prefix hashes to (server/ray/router.py), so that
# replica's prefix cache holds it; least-loaded: Ray Serve's own power-of-two-choices router.
ROUTINGS = ("prefix", "least-loaded")
# shared: every replica serves the whole catalogue (server/catalogue/pool.py loads what is asked for);
# per-model: each catalogue model is a Serve deployment of its own, with its own replicas, and the ingress
# sends a request to the deployment of the model it names (server/ray/model_routes.py).
MODEL_DEPLOYMENTS = ("shared", "per-model")


@dataclass(frozen=True)
class ScaleOut:
    """replicas: replicas to run (0: no Ray, one process with plain uvicorn).
    max_replicas: autoscale between `replicas` and this many on ongoing requests (None: exactly `replicas`).
    routing: one of ROUTINGS.
    model_deployments: one of MODEL_DEPLOYMENTS.
    metrics_port: where the local Ray instance's Prometheus endpoint listens, every replica's series on it
        (0: a free port, logged at start). Used by `kvserve serve --replicas` only; a Ray cluster has its own.
    """

    replicas: int = 0
    max_replicas: int | None = None
    routing: str = "prefix"
    metrics_port: int = 0
    model_deployments: str = "shared"

    def __post_init__(self) -> None:
        if self.replicas < 0:
            raise ValueError(f"replicas must be non-negative, got {self.replicas}")
        if self.max_replicas is not None:
            if self.replicas == 0:
                raise ValueError("max_replicas needs replicas (the least number of replicas) to be at least 1")
            if self.max_replicas < self.replicas:
                raise ValueError(f"max_replicas ({self.max_replicas}) must be at least replicas ({self.replicas})")
        if self.routing not in ROUTINGS:
            raise ValueError(f"replica_routing must be one of {ROUTINGS}, got {self.routing!r}")
        if self.model_deployments not in MODEL_DEPLOYMENTS:
            raise ValueError(f"model_deployments must be one of {MODEL_DEPLOYMENTS}, got {self.model_deployments!r}")
        if self.model_deployments == "per-model" and self.replicas == 0:
            raise ValueError("model_deployments per-model runs on Ray Serve: it needs replicas to be at least 1")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"replica_metrics_port must be in [0, 65535], got {self.metrics_port}")

    @property
    def is_distributed(self) -> bool:
        """Whether to run on Ray Serve at all."""
        return self.replicas > 0

    @property
    def most_replicas(self) -> int:
        """The most replicas that can run at once (what each one's share of the machine is sized for)."""
        return self.max_replicas if self.max_replicas is not None else max(self.replicas, 1)
