"""The kvserve application on Ray Serve: the KVServe deployment (server/ray/replica.py), its ingress
(server/ray/ingress.py), and the Serve options each gets from the ServerConfig and ScaleOut.

KVServe's options, and why:
- max_ongoing_requests = --max-num-seqs + --max-queued-requests: what one kvserve holds at once (a full
  running batch and a full queue), so a replica is sent no more than it would admit itself.
- max_queued_requests = --max-queued-requests: requests waiting (at each caller of KVServe: the ingress)
  for a replica with room. Past it the ingress answers 429 `queue_full` at once, as kvserve does, instead
  of a request waiting in an unbounded queue.
- autoscaling (--max-replicas): between --replicas and --max-replicas replicas, aiming at
  target_ongoing_requests = --max-num-seqs per replica, i.e. one full running batch: more than that per
  replica means requests start to wait for a batch slot, which is when another replica helps.
- graceful_shutdown_timeout_s = --shutdown-timeout: how long a stopping replica's requests may run.
- request router: PrefixAffineRouter (server/ray/router.py) with --replica-routing prefix, passing the
  affine replica over at --max-num-seqs ongoing requests; Serve's power of two choices with least-loaded.
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from server.config import ServerConfig
from server.ray.ingress import KVServeIngress
from server.ray.model_routes import SHARED_DEPLOYMENT, ModelRoutes, model_deployments
from server.ray.replica import KVServe
from server.ray.router import PrefixAffineRouter
from server.ray.scale_out import ScaleOut

APP_NAME = "kvserve"
REPLICA_DEPLOYMENT = SHARED_DEPLOYMENT
INGRESS_DEPLOYMENT = "KVServeIngress"
# The ingress outlives the replicas' grace by this much, so it can end the requests a replica's stop cut.
INGRESS_EXTRA_GRACE_S = 5.0
DRAIN_POLL_S = 0.25  # how often a stopping replica checks whether its requests are done (Serve's default: 2 s)
# Requests the ingress takes at once when --limit-concurrency sets no bound: it only forwards.
INGRESS_MAX_ONGOING = 10_000


def replica_options(config: ServerConfig, scale_out: ScaleOut, num_cpus: float) -> dict[str, Any]:
    """KVServe's Serve options (the module docstring says why each); num_cpus: Ray CPUs per replica."""
    batch = config.engine.max_num_seqs
    options: dict[str, Any] = {
        "name": REPLICA_DEPLOYMENT,
        "max_ongoing_requests": batch + config.max_queued_requests,
        "max_queued_requests": config.max_queued_requests,
        "graceful_shutdown_timeout_s": config.shutdown_timeout,
        "graceful_shutdown_wait_loop_s": DRAIN_POLL_S,
        "ray_actor_options": {"num_cpus": num_cpus},
    }
    if scale_out.max_replicas is None:
        options["num_replicas"] = max(scale_out.replicas, 1)
    else:
        options["autoscaling_config"] = {
            "min_replicas": scale_out.replicas,
            "initial_replicas": scale_out.replicas,
            "max_replicas": scale_out.max_replicas,
            "target_ongoing_requests": batch,
        }
    if scale_out.routing == "prefix":
        options["request_router_config"] = RequestRouterConfig(
            request_router_class=PrefixAffineRouter,
            request_router_kwargs={"overload_threshold": batch},
        )
    return options


def ingress_options(config: ServerConfig) -> dict[str, Any]:
    """One ingress replica, no CPU reserved (it only forwards); its bounds are --limit-concurrency's."""
    limit = config.limit_concurrency or INGRESS_MAX_ONGOING
    return {
        "name": INGRESS_DEPLOYMENT,
        "num_replicas": 1,
        "max_ongoing_requests": limit,
        "max_queued_requests": limit,
        "graceful_shutdown_timeout_s": config.shutdown_timeout + INGRESS_EXTRA_GRACE_S,
        "graceful_shutdown_wait_loop_s": DRAIN_POLL_S,
        "ray_actor_options": {"num_cpus": 0},
    }


def kvserve_application(config: ServerConfig, scale_out: ScaleOut, num_cpus: float) -> serve.Application:
    """The application: KVServeIngress (HTTP) -> KVServe (the engines): one deployment serving every model,
    or with --model-deployments per-model one per catalogue model (server/ray/model_routes.py), each with
    the replica options above and its model's name."""
    ingress = serve.deployment(KVServeIngress).options(**ingress_options(config))
    affine = scale_out.routing == "prefix"
    if scale_out.model_deployments == "shared":
        replica = serve.deployment(KVServe).options(**replica_options(config, scale_out, num_cpus))
        return ingress.bind(config, affine, None, replica.bind(config))
    deployments = model_deployments(config)
    bound = []
    for deployment in deployments:
        options = {**replica_options(deployment.config, scale_out, num_cpus), "name": deployment.name}
        bound.append(serve.deployment(KVServe).options(**options).bind(deployment.config))
    return ingress.bind(config, affine, ModelRoutes(deployments), *bound)
