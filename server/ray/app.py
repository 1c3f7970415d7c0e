"""kvserve as a Ray Serve application: `build_app`, the builder Serve imports as `server.ray.app:build_app`.

    serve run server.ray.app:build_app model=smollm2-135m-instruct max-num-seqs=16 replicas=2

deploys it to the Ray cluster `serve run` connects to (RAY_ADDRESS, or a new local one); a KubeRay
RayService does the same from its serveConfigV2:

    applications:
      - name: kvserve
        import_path: server.ray.app:build_app
        route_prefix: /
        args: {model: smollm2-135m-instruct, max-num-seqs: 16, replica-routing: prefix}
        deployments:
          - name: KVServe
            autoscaling_config: {min_replicas: 2, max_replicas: 8, target_ongoing_requests: 16}
            ray_actor_options: {num_cpus: 4}

`args` holds `kvserve serve` flags without their dashes, each parsed by the very definitions the CLI
uses (server/cli/flags.py FLAGS; KVSERVE_<NAME> variables set where the application is built count as there),
so a flag means the same on Ray. Some flags belong to the server process and are Serve's on Ray: --host,
--port, --timeout-keep-alive, --timeout-request-head, --timeout-request-body, --max-request-head-bytes,
--max-connections-per-client (Serve's HTTP proxy has its own http_options) and --replica-metrics-port
(the cluster's own metrics port). --replicas
(default 1 here), --max-replicas and --replica-routing set the KVServe deployment's options
(server/ray/deployments.py); a `deployments:` entry in the Serve config overrides any of them.

Each replica reserves --num-threads CPUs (1 when unset) in Ray, and without --num-threads runs torch on as
many threads as it reserved; serveConfigV2's ray_actor_options (num_cpus) overrides the reservation.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any, NoReturn

from ray import serve

from server.cli.args import add_arguments, config_from_args, scale_out_from_args
from server.ray.deployments import kvserve_application


class _ArgsError(ValueError):
    pass


class _RaisingParser(argparse.ArgumentParser):
    """argparse that raises instead of printing and exiting: the caller is Serve, not a shell."""

    def error(self, message: str) -> NoReturn:
        raise _ArgsError(message)


def _flag_text(value: Any) -> str:
    """A value from a Serve config (YAML: ints, bools, lists, null) as the text the flag parses."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return ",".join(str(item) for item in value)
    return str(value)


def parse_args(args: Mapping[str, Any]) -> argparse.Namespace:
    """`kvserve serve` flags from a mapping of flag names without dashes (`max-num-seqs` or
    `max_num_seqs`) to values. Raises ValueError naming an unknown flag or a bad value."""
    parser = _RaisingParser(prog="server.ray.app:build_app", add_help=False)
    add_arguments(parser)
    argv = []
    for name, value in args.items():
        argv += ["--" + str(name).lstrip("-").replace("_", "-"), _flag_text(value)]
    return parser.parse_args(argv)


def build_app(args: dict[str, Any]) -> serve.Application:
    """The kvserve application (KVServeIngress -> KVServe) for `args` (see the module docstring).
    Raises ValueError on an unknown flag, a bad value, or a combination that cannot work."""
    namespace = parse_args(args)
    if namespace.replicas == 0:
        namespace.replicas = 1  # the CLI's 0 means "no Ray"; an application on Ray has at least one replica
    config = config_from_args(namespace)
    scale_out = scale_out_from_args(namespace)
    return kvserve_application(config, scale_out, num_cpus=float(config.engine.num_threads or 1))
