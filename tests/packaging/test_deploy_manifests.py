"""deploy/: the Kubernetes, KubeRay and Docker Compose manifests, checked offline.

No cluster and no Docker run here, so the manifests are held to the schemas their tools validate against:
the Kubernetes objects and the Ray pod templates to the Kubernetes OpenAPI schemas (kubernetes-validate ships
them), serveConfigV2 to Ray Serve's own config model (when ray is installed), the Compose file to the Compose
specification's JSON schema (check-jsonschema ships it). Then to the rest of the repository, so they cannot
drift from it: every KVSERVE_* name is a `kvserve serve` flag's variable, ports, user and health path are the
Dockerfile's, and the grace periods outlast the server's drain on SIGTERM.
"""

from __future__ import annotations

import copy
import importlib
import re
import shlex
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from check_jsonschema.builtin_schemas import get_builtin_schema

from server import cli

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES_MANIFEST = ROOT / "deploy" / "kubernetes" / "kvserve.yaml"
RAYSERVICE_MANIFEST = ROOT / "deploy" / "kubernetes" / "rayservice.yaml"
COMPOSE_FILE = ROOT / "deploy" / "compose.yaml"
MANIFESTS = (KUBERNETES_MANIFEST, RAYSERVICE_MANIFEST, COMPOSE_FILE)

# The Kubernetes release whose schemas the manifests must pass (one kubernetes-validate ships; strict: unknown
# fields are errors too, as `kubectl apply --validate=strict` makes them).
KUBERNETES_VERSION = "1.37.0"
# What the Ray Serve application (server/ray/app.py) provides.
RAY_IMPORT_PATH = "server.ray.app:build_app"
RAY_DEPLOYMENT_NAME = "KVServe"
# `kvserve serve` ends a stop within --shutdown-timeout + this many seconds (server/cli/runner.py).
STOP_OVERHEAD_S = 2.0
FLAGS = {flag.name: flag for flag in cli.FLAGS}
FLAG_ENV_NAMES = {cli.env_name(flag.name) for flag in cli.FLAGS}


# ---------------------------------------------------------------------------------------------- loading


def _documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def _by_kind(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    kinds = [doc["kind"] for doc in docs]
    assert len(kinds) == len(set(kinds)), kinds
    return {doc["kind"]: doc for doc in docs}


@pytest.fixture(scope="module")
def kube() -> dict[str, dict[str, Any]]:
    return _by_kind(_documents(KUBERNETES_MANIFEST))


@pytest.fixture(scope="module")
def rayservice() -> dict[str, Any]:
    (doc,) = _documents(RAYSERVICE_MANIFEST)
    return doc


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def _ray_templates(rayservice: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    cluster = rayservice["spec"]["rayClusterConfig"]
    yield "head", cluster["headGroupSpec"]["template"]
    for group in cluster["workerGroupSpecs"]:
        yield f"worker group {group['groupName']}", group["template"]


def _serve_config(rayservice: dict[str, Any]) -> dict[str, Any]:
    text = rayservice["spec"]["serveConfigV2"]
    assert isinstance(text, str), "serveConfigV2 is a YAML string, not a mapping"
    return yaml.safe_load(text)


def _kvserve_app(rayservice: dict[str, Any]) -> dict[str, Any]:
    (app,) = [a for a in _serve_config(rayservice)["applications"] if a["import_path"] == RAY_IMPORT_PATH]
    return app


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {item["name"]: item["value"] for item in container.get("env", []) if "value" in item}


def _seconds(duration: str | int | float) -> float:
    """A Compose / Dockerfile duration ("15s", "1m30s", "500ms") or a bare number of seconds."""
    if isinstance(duration, int | float):
        return float(duration)
    units = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
    parts = re.findall(r"(\d+(?:\.\d+)?)(us|ms|s|m|h)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, f"not a duration: {duration!r}"
    return sum(float(n) * units[u] for n, u in parts)


# --------------------------------------------------------------------------------------- the Dockerfile


def _runtime_stage() -> list[tuple[str, str]]:
    """(KEYWORD, arguments) of the Dockerfile's last stage, continuation lines joined, comments dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in (ROOT / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, args = (pending + line).partition(" ")
        pending = ""
        if keyword.upper() == "FROM":
            instructions = []
        instructions.append((keyword.upper(), args.strip()))
    return instructions


@pytest.fixture(scope="module")
def image() -> dict[str, Any]:
    """What the manifests rely on in the image: user and group ids, exposed port, ENV, HEALTHCHECK."""
    stage = _runtime_stage()
    runs = " ".join(args for keyword, args in stage if keyword == "RUN")
    env: dict[str, str] = {}
    for keyword, args in stage:
        if keyword == "ENV":
            env.update(token.split("=", 1) for token in shlex.split(args))
    (expose,) = [args for keyword, args in stage if keyword == "EXPOSE"]
    healthchecks = [args for keyword, args in stage if keyword == "HEALTHCHECK"]
    return {
        "uid": int(re.search(r"useradd\b[^&]*--uid (\d+)", runs).group(1)),
        "gid": int(re.search(r"groupadd\b[^&]*--gid (\d+)", runs).group(1)),
        "port": int(expose),
        "env": env,
        "healthcheck": healthchecks[-1] if healthchecks else None,
    }


# ------------------------------------------------------------------- Kubernetes: the schemas themselves


def test_the_pinned_kubernetes_version_is_shipped() -> None:
    # validate() silently falls back to an older release's schemas when asked for one it lacks
    minor = ".".join(KUBERNETES_VERSION.split(".")[:2])
    version = kubernetes_validate.validate({"apiVersion": "v1", "kind": "Namespace"}, KUBERNETES_VERSION, strict=True)
    assert version == minor


@pytest.mark.parametrize("doc", _documents(KUBERNETES_MANIFEST), ids=lambda doc: doc["kind"])
def test_kubernetes_objects_match_the_schemas(doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_kubernetes_manifest_holds_a_deployment_its_service_and_autoscaler(kube) -> None:
    assert set(kube) == {"Deployment", "Service", "HorizontalPodAutoscaler"}
    deployment, service, hpa = kube["Deployment"], kube["Service"], kube["HorizontalPodAutoscaler"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert service["spec"]["selector"].items() <= labels.items()
    assert hpa["apiVersion"] == "autoscaling/v2"
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    (metric,) = hpa["spec"]["metrics"]
    assert metric["resource"]["name"] == "cpu" and metric["resource"]["target"]["type"] == "Utilization"
    # a replica count in the Deployment would be reset on every `kubectl apply`, undoing the autoscaler's
    assert "replicas" not in deployment["spec"]


BROKEN_PODS: dict[str, Callable[[dict[str, Any], dict[str, Any]], None]] = {
    "probe port as a list": lambda pod, c: c["readinessProbe"]["httpGet"].__setitem__("port", [8000]),
    "misspelled probe field": lambda pod, c: c.__setitem__("livenessProbes", c.pop("livenessProbe")),
    "grace period as text": lambda pod, c: pod.__setitem__("terminationGracePeriodSeconds", "40"),
    "memory limit as a mapping": lambda pod, c: c["resources"]["limits"].__setitem__("memory", {"Gi": 3}),
}


@pytest.mark.parametrize("broken", BROKEN_PODS.values(), ids=BROKEN_PODS.keys())
def test_a_broken_kubernetes_manifest_is_rejected(kube, broken) -> None:
    deployment = copy.deepcopy(kube["Deployment"])
    pod = deployment["spec"]["template"]["spec"]
    broken(pod, pod["containers"][0])
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


# -------------------------------------------------------------------------- Kubernetes: the kvserve pod


def _kvserve_pod(kube) -> dict[str, Any]:
    return kube["Deployment"]["spec"]["template"]["spec"]


def _kvserve_container(kube) -> dict[str, Any]:
    (container,) = _kvserve_pod(kube)["containers"]
    return container


def _container_port(container: dict[str, Any], port: int | str) -> int:
    """A probe's or a Service's port: a number, or the name of one of the container's ports."""
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in container["ports"] if p.get("name") == port]
    return number


def test_probes_check_health_on_the_images_port(kube, image) -> None:
    container = _kvserve_container(kube)
    assert "KVSERVE_PORT" not in _env(container)  # the image's port is the one probed
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        check = container[probe]["httpGet"]
        assert check["path"] == "/health", probe
        assert _container_port(container, check["port"]) == image["port"], probe
    service_port = kube["Service"]["spec"]["ports"][0]
    assert _container_port(container, service_port["targetPort"]) == image["port"]


def test_startup_probe_allows_for_model_loading(kube, image) -> None:
    startup = _kvserve_container(kube)["startupProbe"]
    window = startup["periodSeconds"] * startup["failureThreshold"]
    # at least the start period the image's own HEALTHCHECK grants the models
    start_period = re.search(r"--start-period=(\S+)", image["healthcheck"] or "")
    assert window >= (_seconds(start_period.group(1)) if start_period else 120)


def test_a_draining_pod_is_neither_killed_nor_restarted(kube) -> None:
    pod, container = _kvserve_pod(kube), _kvserve_container(kube)
    assert "KVSERVE_SHUTDOWN_TIMEOUT" in _env(container), "set it explicitly: the grace period depends on it"
    shutdown = float(_env(container)["KVSERVE_SHUTDOWN_TIMEOUT"])
    drain = shutdown + STOP_OVERHEAD_S  # /health answers 503 this long after SIGTERM
    pre_stop = container.get("lifecycle", {}).get("preStop", {})
    pre_stop_s = float(pre_stop["exec"]["command"][-1]) if "exec" in pre_stop else 0.0
    if "exec" in pre_stop:
        assert pre_stop["exec"]["command"][0] == "sleep"
    assert pod["terminationGracePeriodSeconds"] > pre_stop_s + drain
    # the liveness probe needs failureThreshold failures in a row: the first may come right as the drain starts
    liveness = container["livenessProbe"]
    assert (liveness["failureThreshold"] - 1) * liveness["periodSeconds"] > drain


def test_resources_are_requested_and_limited(kube) -> None:
    container = _kvserve_container(kube)
    resources = container["resources"]
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(resources[kind]), kind
    # torch's thread count follows the CPUs the pod may use, not the node's
    threads = int(_env(container)["KVSERVE_NUM_THREADS"])
    assert threads <= float(resources["limits"]["cpu"])


def _assert_pod_security(pod: dict[str, Any], image, *, read_only_root: bool) -> None:
    context = pod["securityContext"]
    assert context["runAsNonRoot"] is True
    assert (context["runAsUser"], context["runAsGroup"]) == (image["uid"], image["gid"])
    assert context["fsGroup"] == image["gid"]  # volumes writable by the image's group
    assert context["seccompProfile"]["type"] == "RuntimeDefault"
    # a Service named kvserve would inject KVSERVE_PORT=tcp://..., which `kvserve serve` reads as --port
    assert cli.env_name("port") == "KVSERVE_PORT"
    assert pod["enableServiceLinks"] is False
    volumes = {volume["name"]: volume for volume in pod.get("volumes", [])}
    for container in pod["containers"]:
        security = container["securityContext"]
        assert security["allowPrivilegeEscalation"] is False
        assert security["capabilities"]["drop"] == ["ALL"]
        assert security.get("readOnlyRootFilesystem", False) is read_only_root
        (tmp,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/tmp"]
        assert "emptyDir" in volumes[tmp["name"]]


def test_kvserve_pod_runs_as_the_images_user_on_a_read_only_root(kube, image) -> None:
    _assert_pod_security(_kvserve_pod(kube), image, read_only_root=True)


def test_model_cache_volume_is_writable_and_holds_the_hub_cache(kube, image) -> None:
    pod, container = _kvserve_pod(kube), _kvserve_container(kube)
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    mounts = [m for m in container["volumeMounts"] if m["mountPath"] != "/tmp"]
    (cache,) = mounts
    assert not cache.get("readOnly", False)
    assert "emptyDir" in volumes[cache["name"]] or "persistentVolumeClaim" in volumes[cache["name"]]
    # a Hub id (with HF_HUB_OFFLINE=0) is downloaded into the image's HF_HOME: on the volume, not the read-only root
    assert image["env"]["HF_HOME"].startswith(cache["mountPath"].rstrip("/") + "/")
    # a model of your own is served from the volume: the example path lies on it
    examples = re.findall(r"value: (/\S+)", KUBERNETES_MANIFEST.read_text())
    assert examples and all(path.startswith(cache["mountPath"] + "/") for path in examples)


# ------------------------------------------------------------------------------------ Ray on Kubernetes


# Fields of KubeRay's ray.io/v1 RayService that a manifest like this one may use.
RAYSERVICE_KEYS = {"serveConfigV2", "rayClusterConfig", "upgradeStrategy", "serveService"}
RAYCLUSTER_KEYS = {"rayVersion", "enableInTreeAutoscaling", "autoscalerOptions", "headGroupSpec", "workerGroupSpecs"}
HEAD_GROUP_KEYS = {"rayStartParams", "template", "serviceType"}
WORKER_GROUP_KEYS = {"groupName", "replicas", "minReplicas", "maxReplicas", "rayStartParams", "template"}


def test_rayservice_has_the_structure_kuberay_expects(rayservice) -> None:
    assert (rayservice["apiVersion"], rayservice["kind"]) == ("ray.io/v1", "RayService")
    spec = rayservice["spec"]
    # KubeRay's CRD is not in kubernetes-validate: at least no misspelled key goes unnoticed
    assert set(spec) <= RAYSERVICE_KEYS
    cluster = spec["rayClusterConfig"]
    assert set(cluster) <= RAYCLUSTER_KEYS
    assert re.fullmatch(r"\d+\.\d+\.\d+", cluster["rayVersion"])
    head = cluster["headGroupSpec"]
    assert set(head) <= HEAD_GROUP_KEYS and "template" in head
    assert cluster["workerGroupSpecs"], "Serve's replicas run on workers: the head has num-cpus 0"
    assert head["rayStartParams"].get("num-cpus") == "0"
    for group in cluster["workerGroupSpecs"]:
        assert set(group) <= WORKER_GROUP_KEYS
        assert {"groupName", "template", "rayStartParams"} <= set(group)
        assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    for params in [head["rayStartParams"]] + [g["rayStartParams"] for g in cluster["workerGroupSpecs"]]:
        assert all(isinstance(v, str) for v in params.values()), "rayStartParams is a map of strings"
    for where, template in _ray_templates(rayservice):
        (container,) = template["spec"]["containers"]
        assert container["image"] == "kvserve-ray:latest", where


@pytest.mark.parametrize("group", ["head", "worker"])
def test_ray_pod_templates_match_the_pod_schema(rayservice, group: str) -> None:
    templates = [t for where, t in _ray_templates(rayservice) if where.startswith(group)]
    assert templates
    for template in templates:
        assert set(template) <= {"metadata", "spec"}  # a PodTemplateSpec
        # KubeRay builds each Ray pod from its template (and adds to it): the template alone must be a valid pod
        metadata = {"name": f"kvserve-ray-{group}", **template.get("metadata", {})}
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": template["spec"]}
        kubernetes_validate.validate(pod, KUBERNETES_VERSION, strict=True)


def test_a_broken_ray_pod_template_is_rejected(rayservice) -> None:
    template = copy.deepcopy(dict(_ray_templates(rayservice))["head"])
    template["spec"]["containers"][0]["ports"][0]["containerPort"] = "6379"
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "broken"}, "spec": template["spec"]}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pod, KUBERNETES_VERSION, strict=True)


def test_ray_pods_run_as_the_images_user(rayservice, image) -> None:
    for _, template in _ray_templates(rayservice):
        _assert_pod_security(template["spec"], image, read_only_root=False)


def test_ray_probes_need_no_tools_the_image_lacks(rayservice) -> None:
    # KubeRay adds its own probes only where none is set, and some of those run wget: not in a python slim image
    for where, template in _ray_templates(rayservice):
        (container,) = template["spec"]["containers"]
        for probe in ("readinessProbe", "livenessProbe"):
            assert "httpGet" in container[probe], f"{where}: {probe}"


def test_serve_config_routes_to_the_kvserve_application(rayservice) -> None:
    app = _kvserve_app(rayservice)
    assert app["route_prefix"] == "/"
    (deployment,) = [d for d in app["deployments"] if d["name"] == RAY_DEPLOYMENT_NAME]
    autoscaling = deployment["autoscaling_config"]
    assert "num_replicas" not in deployment or deployment["num_replicas"] == "auto"  # the autoscaler decides
    assert 1 <= autoscaling["min_replicas"] <= autoscaling["max_replicas"]
    assert autoscaling["target_ongoing_requests"] > 0
    config = _serve_config(rayservice)
    serve_port = config["http_options"]["port"]
    for group in rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        (container,) = group["template"]["spec"]["containers"]
        assert _container_port(container, "serve") == serve_port
        # a worker is ready for traffic once Serve's proxy on it is
        readiness = container["readinessProbe"]["httpGet"]
        assert readiness["path"] == "/-/healthz" and _container_port(container, readiness["port"]) == serve_port


def test_serve_app_args_are_kvserve_serve_flags(rayservice) -> None:
    app = _kvserve_app(rayservice)
    for name, value in app["args"].items():
        assert not name.startswith("-"), f"{name}: flag names go without their leading dashes"
        flag = FLAGS.get(name.replace("-", "_"))
        assert flag is not None, f"{name} is not a `kvserve serve` flag"
        flag.kind(str(value))  # the value parses as the flag's own would
    (deployment,) = [d for d in app["deployments"] if d["name"] == RAY_DEPLOYMENT_NAME]
    # the deployment's settings restate what the application derives from the args: they must agree
    args = {name.replace("_", "-"): value for name, value in app["args"].items()}
    autoscaling = deployment["autoscaling_config"]
    assert autoscaling["min_replicas"] == int(args.get("replicas", 1))
    assert autoscaling["max_replicas"] == int(args["max-replicas"])
    assert autoscaling["target_ongoing_requests"] == int(args["max-num-seqs"])  # one full batch per replica
    assert int(args["num-threads"]) == deployment["ray_actor_options"]["num_cpus"]


def test_ray_workers_have_room_for_every_replica(rayservice) -> None:
    app = _kvserve_app(rayservice)
    (deployment,) = [d for d in app["deployments"] if d["name"] == RAY_DEPLOYMENT_NAME]
    cpus = deployment["ray_actor_options"]["num_cpus"]
    room = 0
    for group in rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        (container,) = group["template"]["spec"]["containers"]
        worker_cpus = float(container["resources"]["limits"]["cpu"])
        assert worker_cpus >= cpus, "a replica must fit on one worker"
        room += group["maxReplicas"] * int(worker_cpus // cpus)
    assert room >= deployment["autoscaling_config"]["max_replicas"]


def _fields(model: type) -> set[str]:
    fields = getattr(model, "model_fields", None) or model.__fields__  # pydantic 2, else 1
    return set(fields)


RAY_MISSING = "ray[serve] is not installed (the dev extra brings it)"


def _validate_serve_config(config: dict[str, Any]) -> None:
    """Ray Serve's own checks of a config, as `serve deploy` (and so KubeRay) runs them; ValueError if it fails."""
    schema = pytest.importorskip("ray.serve.schema", reason=RAY_MISSING)
    from ray.serve.config import AutoscalingConfig

    schema.ServeDeploySchema(**config)
    for app in config["applications"]:
        for deployment in app.get("deployments", []):
            # the deploy schema keeps autoscaling_config as a plain mapping: Serve checks it when it applies it
            AutoscalingConfig(**deployment.get("autoscaling_config", {}))


def test_serve_config_matches_ray_serves_schema(rayservice) -> None:
    _validate_serve_config(_serve_config(rayservice))
    from ray.serve.config import AutoscalingConfig
    from ray.serve.schema import DeploymentSchema, ServeApplicationSchema, ServeDeploySchema

    # the models accept unknown keys, so a misspelled one would be dropped quietly: every key must be a field
    config = _serve_config(rayservice)
    assert set(config) <= _fields(ServeDeploySchema)
    for app in config["applications"]:
        assert set(app) <= _fields(ServeApplicationSchema)
        for deployment in app.get("deployments", []):
            assert set(deployment) <= _fields(DeploymentSchema)
            assert set(deployment.get("autoscaling_config", {})) <= _fields(AutoscalingConfig)


@pytest.mark.parametrize(
    "broken",
    [
        lambda app, deployment: deployment["autoscaling_config"].__setitem__("min_replicas", -1),
        lambda app, deployment: deployment.__setitem__("num_replicas", 2),  # beside autoscaling: refused
        lambda app, deployment: deployment.__setitem__("max_ongoing_requests", 0),
    ],
)
def test_a_broken_serve_config_is_rejected(rayservice, broken) -> None:
    config = _serve_config(rayservice)
    app = next(a for a in config["applications"] if a["import_path"] == RAY_IMPORT_PATH)
    broken(app, next(d for d in app["deployments"] if d["name"] == RAY_DEPLOYMENT_NAME))
    with pytest.raises(ValueError):  # pydantic's ValidationError is a ValueError
        _validate_serve_config(config)


def _deployment_names(app: Any) -> set[str]:
    """Names of the deployments a Serve Application binds (the ingress and what it is bound to)."""
    bound = getattr(app, "_bound_deployment", None)
    if bound is None:
        return set()
    names = {bound.name}
    for arg in [*bound.init_args, *bound.init_kwargs.values()]:
        names |= _deployment_names(arg)
    return names


def test_the_ray_app_builds_from_the_manifests_args(rayservice) -> None:
    module_name, _, builder = RAY_IMPORT_PATH.partition(":")
    source = ROOT / Path(*module_name.split(".")).with_suffix(".py")
    if not source.exists():
        pytest.skip(f"{source.relative_to(ROOT)} is not in this tree yet")
    pytest.importorskip("ray.serve", reason=RAY_MISSING)
    module = importlib.import_module(module_name)
    # what Serve does with the config: call the builder with the args (binding deployments needs no cluster)
    app = getattr(module, builder)(_kvserve_app(rayservice)["args"])
    names = _deployment_names(app)
    if not names:  # Serve's Application no longer exposes its bound deployment: look for the name in the source
        names = set(re.findall(r"[\"']([A-Za-z]\w*)[\"']", "".join(p.read_text() for p in source.parent.glob("*.py"))))
    assert RAY_DEPLOYMENT_NAME in names, f"serveConfigV2 configures {RAY_DEPLOYMENT_NAME}, the application has {names}"


# ------------------------------------------------------------------------------------------- Compose


@pytest.fixture(scope="module")
def compose_validator() -> jsonschema.protocols.Validator:
    schema = get_builtin_schema("vendor.compose-spec")  # the Compose specification's own schema, vendored
    validator_class = jsonschema.validators.validator_for(schema)
    validator_class.check_schema(schema)
    return validator_class(schema, format_checker=validator_class.FORMAT_CHECKER)


def test_compose_file_matches_the_compose_schema(compose, compose_validator) -> None:
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in compose_validator.iter_errors(compose)]
    assert not errors, errors


@pytest.mark.parametrize(
    "broken",
    [
        lambda s: s.__setitem__("stop_grace_periods", s.pop("stop_grace_period")),
        lambda s: s.__setitem__("ports", [[8000, 8000]]),
        lambda s: s.__setitem__("tmpfs", {"/tmp": True}),
    ],
)
def test_a_broken_compose_file_is_rejected(compose, compose_validator, broken) -> None:
    doc = copy.deepcopy(compose)
    broken(doc["services"]["kvserve"])
    assert list(compose_validator.iter_errors(doc))


def test_compose_builds_the_repositorys_image(compose, image) -> None:
    (name,) = compose["services"]
    service = compose["services"][name]
    assert (COMPOSE_FILE.parent / service["build"] / "Dockerfile").resolve() == ROOT / "Dockerfile"
    assert service["image"] == "kvserve"
    assert f"{image['port']}:{image['port']}" in service["ports"]
    # no healthcheck of its own: the image's HEALTHCHECK applies, so there must be one
    assert "healthcheck" not in service
    assert image["healthcheck"], "the compose file relies on the image's HEALTHCHECK"


def test_compose_runs_read_only_as_the_images_user(compose, image) -> None:
    service = compose["services"]["kvserve"]
    assert service["read_only"] is True
    assert "/tmp" in service["tmpfs"]
    assert service["user"] == f"{image['uid']}:{image['gid']}"
    assert service["cap_drop"] == ["ALL"] and "no-new-privileges:true" in service["security_opt"]


def test_compose_stop_outlasts_the_drain(compose) -> None:
    service = compose["services"]["kvserve"]
    shutdown = float(service["environment"]["KVSERVE_SHUTDOWN_TIMEOUT"])
    assert _seconds(service["stop_grace_period"]) > shutdown + STOP_OVERHEAD_S


def test_compose_cache_volume_holds_the_hub_cache(compose, image) -> None:
    service = compose["services"]["kvserve"]
    (mount,) = service["volumes"]
    volume, _, path = mount.partition(":")
    assert volume in compose["volumes"], "a named volume: it takes its owner from the image, so kvserve can write"
    assert image["env"]["HF_HOME"].startswith(path.rstrip("/") + "/")
    examples = re.findall(r"KVSERVE_MODEL: (/\S+)", COMPOSE_FILE.read_text())
    assert examples and all(example.startswith(path + "/") for example in examples)
    assert "KVSERVE_API_KEY" not in service["environment"]  # an example only, commented out


# ------------------------------------------------------------------------------------------ all of them


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_every_kvserve_variable_is_a_serve_flag(path: Path) -> None:
    # comments included: the commented-out examples must work once uncommented
    names = set(re.findall(r"\bKVSERVE_[A-Z0-9_]+", path.read_text()))
    assert names, path
    assert names <= FLAG_ENV_NAMES, f"not a `kvserve serve` variable: {sorted(names - FLAG_ENV_NAMES)}"


def test_every_kvserve_value_parses_as_its_flag(kube, compose) -> None:
    values = dict(_env(_kvserve_container(kube)))
    values.update(compose["services"]["kvserve"]["environment"])
    for name, value in values.items():
        flag = next((f for f in cli.FLAGS if cli.env_name(f.name) == name), None)
        if flag is not None:
            flag.kind(str(value))
