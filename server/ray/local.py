"""`kvserve serve --replicas N`: the kvserve application (server/ray/deployments.py) on a local Ray Serve
instance, Serve's HTTP proxy on --host/--port, until SIGTERM/SIGINT.

The Ray instance is private to this process and this machine: every Ray port (GCS, raylet, workers, the
metrics endpoint) listens on 127.0.0.1 only, no dashboard runs, and Ray's own token authentication guards
it. Only the HTTP proxy listens on --host. Each replica gets an equal share of the machine's CPUs (for the
most replicas it may run) as Ray CPUs and, unless --num-threads says otherwise, of all cores but one as
torch threads (replica_share says why).

A stop (SIGTERM or SIGINT) is kvserve's stop (server/shutdown.py), done at the ingress
(server/ray/ingress.py): new requests get 503 `shutting_down`, /health 503 {"status": "draining"}, the
requests in flight get --shutdown-timeout seconds, and what is left then ends with 503 `shutting_down` (a
stream: an SSE error event, then [DONE]). Then the application is deleted, Serve and Ray shut down, and
the process exits 0. A second signal cuts the requests in flight at once.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import signal
import threading
from collections.abc import Mapping
from types import FrameType
from typing import TYPE_CHECKING

from server.config import ServerConfig
from server.ray.scale_out import ScaleOut

if TYPE_CHECKING:
    from ray.serve import Application
    from ray.serve.handle import DeploymentHandle

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# Ray reads this once, when first imported. Off (it is meant for desktops), Ray takes the loopback address
# as the node's address, so each Ray server binds 127.0.0.1 instead of every interface. Its only other
# effect is refusing to join a multi-node cluster, which a private instance never does.
RAY_LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
RAY_AUTH_TOKEN_ENV = "RAY_AUTH_TOKEN"
RAY_AUTH_TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"
WAIT_TICK_S = 0.5


def missing_ray() -> str | None:
    """Import Ray Serve, set up for a private local instance; None, or why --replicas cannot work."""
    os.environ[RAY_LOOPBACK_ENV] = "0"
    try:
        import ray.serve  # noqa: F401
    except ImportError as exc:
        return f"--replicas needs Ray Serve, which is not installed ({exc}); install it: pip install 'kvserve[ray]'"
    from ray._private import ray_constants

    if ray_constants.ENABLE_RAY_CLUSTER:  # Ray was imported before the variable was set
        logger.warning("Ray was imported before kvserve set it up: its ports listen on every interface")
    return None


class _Interrupted(Exception):
    """A stop signal while starting, or a second one while stopping: skip what is left of the wait."""


class _Signals:
    """Counts stop signals; raises _Interrupted where waiting is pointless (see the module docstring)."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self._serving = False
        self._previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}

    def serving(self) -> None:
        self._serving = True

    def _handle(self, sig: int, frame: FrameType | None) -> None:
        first = not self.stop.is_set()
        self.stop.set()
        if not (first and self._serving):
            raise _Interrupted()

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def replica_share(config: ServerConfig, scale_out: ScaleOut) -> tuple[ServerConfig, float]:
    """(config with each replica's torch threads, Ray CPUs per replica): an equal share of this machine for
    each of the most replicas that may run. The threads share all cores but one, unless --num-threads says:
    Serve's HTTP proxy and the ingress relay every streamed token, and with every core given to torch its
    threads and those processes contend (one replica on 2 cores served half the requests/s with 2 threads
    that it did with 1)."""
    cores = os.cpu_count() or 1
    most = scale_out.most_replicas * (len(config.catalogue) if scale_out.model_deployments == "per-model" else 1)
    if config.engine.num_threads is None:
        threads = max(1, int((cores - 1) / most))
        config = dataclasses.replace(config, engine=dataclasses.replace(config.engine, num_threads=threads))
    return config, cores / most


def private_auth_token(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment to add so the private instance's token lives in memory: {} when one is configured.

    With no token configured, Ray's token authentication writes a new one to ~/.ray/auth_token, which a
    read-only root filesystem (a hardened container) cannot hold, and which would outlive the process. A
    token in RAY_AUTH_TOKEN is read first instead, and every Ray process this one starts inherits it.
    """
    if environ.get(RAY_AUTH_TOKEN_ENV) or environ.get(RAY_AUTH_TOKEN_PATH_ENV):
        return {}
    return {RAY_AUTH_TOKEN_ENV: secrets.token_hex(32)}  # 256 bits, the size Ray's own tokens have


def serve_replicas(config: ServerConfig, scale_out: ScaleOut) -> int:
    """Run until SIGTERM/SIGINT, then stop cleanly and return 0; 1 if the application failed to start."""
    import ray
    from ray import serve

    from server.ray.deployments import APP_NAME, kvserve_application

    config, num_cpus = replica_share(config, scale_out)
    level = config.log_level.upper()
    os.environ.update(private_auth_token(os.environ))
    ray.init(
        address="local",
        num_cpus=os.cpu_count() or 1,
        include_dashboard=False,
        logging_level=level,
        namespace=APP_NAME,
        _metrics_export_port=scale_out.metrics_port or None,
    )
    signals = _Signals()  # after ray.init, which installs its own SIGTERM handler
    try:
        return _serve(config, scale_out, num_cpus, signals, kvserve_application(config, scale_out, num_cpus))
    except _Interrupted:
        logger.info("stop requested while starting: stopping now")
        return 0
    finally:
        try:
            serve.shutdown()
        except _Interrupted:
            pass
        finally:
            ray.shutdown()
            signals.restore()
            logger.info("kvserve stopped")


def _serve(config: ServerConfig, scale_out: ScaleOut, num_cpus: float, signals: _Signals, app: Application) -> int:
    import ray
    from ray import serve

    from server.ray.deployments import APP_NAME

    # kvserve's replicas write their own access log line per request: Serve's would repeat it twice.
    logging_config = {"log_level": config.log_level.upper(), "enable_access_log": False}
    http_options = {"host": config.host, "port": config.port, "keep_alive_timeout_s": config.timeout_keep_alive}
    per_model = scale_out.model_deployments == "per-model"
    logger.info(
        "starting %s replica(s) of %s%s (%.2f CPUs, %s torch threads each; routing: %s)",
        scale_out.replicas,
        "each of " if per_model else "",
        ", ".join(entry.name for entry in config.catalogue) if per_model else config.model_name,
        num_cpus,
        config.engine.num_threads,
        scale_out.routing,
    )
    try:
        serve.start(http_options=http_options, logging_config=logging_config)  # the proxy binds --host/--port
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False, logging_config=logging_config)
    except RuntimeError as exc:  # the port is taken, a model failed to load, ...
        logger.error("kvserve failed to start: %s", exc)
        return 1
    metrics_port = ray.nodes()[0]["MetricsExportPort"]
    signals.serving()
    logger.info("kvserve ready on http://%s:%d with %d replica(s)", config.host, config.port, scale_out.replicas)
    logger.info("every replica's metrics for Prometheus: http://127.0.0.1:%d/metrics (ray_kvserve_*)", metrics_port)
    while not signals.stop.wait(WAIT_TICK_S):
        pass
    _drain(serve.get_app_handle(APP_NAME), config.shutdown_timeout)
    try:
        serve.delete(APP_NAME)  # nothing is in flight any more: the replicas stop at once
    except _Interrupted:
        logger.warning("second stop signal: stopping the replicas now")
    return 0


def _drain(ingress: DeploymentHandle, grace: float) -> None:
    """kvserve's stop (server/shutdown.py) at the ingress: new requests get 503, those in flight `grace`
    seconds, then the rest are cut; a second signal cuts them at once."""
    logger.info("draining: new requests get 503; those in flight get up to %.1f s to finish", grace)
    try:
        num_cut = ingress.drain.remote(grace).result()
    except _Interrupted:
        logger.warning("second stop signal: stopping the requests in flight now")
        num_cut = ingress.drain.remote(0.0).result()
    if num_cut:
        logger.warning("stopped %d request(s) still in flight: they ended with 503", num_cut)
