"""`kvserve serve`: flags (each also read from KVSERVE_<NAME>), the uvicorn run, and its stop on
SIGTERM/SIGINT (drain, then cut, then exit: server/shutdown.py). With --replicas N the same app runs as
N replicas on a local Ray Serve instance instead (server/ray/local.py).

server/__main__.py calls add_arguments(parser) and run(args); `python -m server.cli` works too.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from types import FrameType, SimpleNamespace
from typing import TYPE_CHECKING, Any

import uvicorn

from engine.config import (
    POOLING_MODES,
    SPECULATIVE_METHODS,
    SUPPORTED_DTYPES,
    TOKEN_ID_INPUT_MODES,
    EmbedderConfig,
    EngineConfig,
    RerankerConfig,
    SpeculativeConfig,
)
from server.config import (
    LOG_LEVELS,
    METRICS_NAMES,
    ServerConfig,
    default_embedder_config,
    default_engine_config,
    parse_bytes,
)
from server.http.access import PREFIX_CACHE_SCOPES, parse_keys, read_key_file
from server.http.h11_protocol import ConnectionLimits, cap_requests_in_progress, limited_h11_protocol
from server.ray.scale_out import ROUTINGS, ScaleOut
from server.shutdown import DRAINING, SERVING, STOPPING

if TYPE_CHECKING:
    from server.state import ServerState

ENV_PREFIX = "KVSERVE_"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# Once the stop has cut the requests still running, seconds their last bytes (an SSE error event
# and [DONE]) get to reach a client before the process exits anyway; and seconds uvicorn then
# waits for connections still open. Small, so a stop ends within --shutdown-timeout + ~2 s.
FINISH_AFTER_CUT_S = 1.0
CLOSE_CONNECTIONS_S = 1.0

logger = logging.getLogger(__name__)


def _optional(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    """'none' / '' -> None, else kind(text)."""

    def parse(text: str) -> Any:
        return None if text.strip().lower() in ("", "none", "null") else kind(text)

    parse.__name__ = kind.__name__
    if hasattr(kind, "metavar"):
        parse.metavar = kind.metavar  # type: ignore[attr-defined]
    return parse


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {text!r}")


def _one_of(*choices: str) -> Callable[[str], str]:
    """A kind that accepts one of `choices` (any case); `--help` shows them as the flag's metavar."""

    def parse(text: str) -> str:
        value = text.strip().lower()
        if value not in choices:
            raise argparse.ArgumentTypeError(f"must be one of {', '.join(choices)}; got {text!r}")
        return value

    parse.__name__ = "choice"
    parse.metavar = "{" + ",".join(choices) + "}"  # type: ignore[attr-defined]
    return parse


def _size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _keys(text: str) -> tuple[str, ...]:
    return parse_keys(text)


_keys.metavar = "KEY"  # type: ignore[attr-defined]


def _key_file(text: str) -> tuple[str, ...]:
    """--api-key-file PATH: the keys in the file; '' or none: no file."""
    if text.strip().lower() in ("", "none"):
        return ()
    try:
        return read_key_file(text)
    except (OSError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


_key_file.metavar = "PATH"  # type: ignore[attr-defined]


class _AddValues(argparse.Action):
    """A repeatable flag whose values (tuples) add up; the first use on the command line replaces the
    default (its environment variable's), as a flag wins over its variable."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        current = getattr(namespace, self.dest, None)
        earlier = () if current is None or current is self.default else current
        setattr(namespace, self.dest, (*earlier, *values))


@dataclasses.dataclass(frozen=True)
class Flag:
    """One `kvserve serve` flag: `--<name>` and KVSERVE_<NAME>.

    targets: where its value goes, as (config, field) pairs; config is "server" (ServerConfig),
    "engine" (EngineConfig), "embedder" (EmbedderConfig), "reranker" (RerankerConfig) or "speculative"
    (SpeculativeConfig, the engine's `speculative`). Its default is the first target's (a reranker field's:
    None, since no rerank model is served by default; the speculative method's: None, speculation off).
    scale_out: instead of targets, the ScaleOut field it sets (server/ray/scale_out.py): how many replicas
    run, not how each one serves, so no replica's config holds it.
    """

    name: str
    targets: tuple[tuple[str, str], ...]
    kind: Callable[[str], Any]
    help: str
    scale_out: str | None = None
    # Given several times, its values add up (a tuple); flags of one field add up too.
    repeatable: bool = False


def _flag(name: str, target: str, kind: Callable[[str], Any], help_text: str, repeatable: bool = False) -> Flag:
    """target: "server", "engine", "embedder", "reranker", "speculative", or several joined by "+"; the field
    is `name` unless the target says "config.field"."""
    targets = []
    for part in target.split("+"):
        config_name, _, field_name = part.partition(".")
        targets.append((config_name, field_name or name))
    return Flag(name, tuple(targets), kind, help_text, repeatable=repeatable)


def _scale_flag(name: str, field_name: str, kind: Callable[[str], Any], help_text: str) -> Flag:
    return Flag(name, (), kind, help_text, scale_out=field_name)


FLAGS: tuple[Flag, ...] = (
    _flag(
        "model",
        "engine",
        str,
        "generation model: a default-model name, a local HF directory or .gguf file, or a Hub id",
    ),
    _flag(
        "embedding_model",
        "embedder.model",
        _optional(str),
        "embedding model (same forms as --model); 'none' serves no embeddings",
    ),
    _flag(
        "rerank_model",
        "reranker.model",
        _optional(str),
        "rerank model, a cross-encoder (BertForSequenceClassification or XLMRobertaForSequenceClassification): "
        "a local HF directory or a Hub id; served by /v1/rerank, /rerank and /v1/score ('none': no reranking)",
    ),
    _flag(
        "served_model_name",
        "server",
        _optional(str),
        "the name clients use for the generation model (default: --model)",
    ),
    _flag("host", "server", str, "address to listen on"),
    _flag("port", "server", int, "TCP port to listen on"),
    _flag(
        "dtype",
        "engine+embedder+reranker",
        str,
        f"weights and activations dtype of every model: {', '.join(SUPPORTED_DTYPES)} (float16: CUDA only)",
    ),
    _flag(
        "quantization",
        "engine",
        str,
        "none, int8 (weight-only int8 linear layers, CPU float32), gguf (a .gguf file's own Q4_0 / Q4_1 / Q8_0 "
        "blocks, other types int8; CPU float32) or auto (gguf for a .gguf on CPU, else none)",
    ),
    _flag("device", "engine+embedder+reranker", str, "torch device of every model: cpu, cuda, cuda:1, ..."),
    _flag(
        "max_model_len",
        "engine",
        _optional(int),
        "longest prompt plus output, in tokens (default: the model's context)",
    ),
    _flag(
        "kv_cache_memory",
        "engine.kv_cache_memory_bytes",
        _size,
        "memory for the paged KV cache: bytes or with a unit (512MiB, 2GB)",
    ),
    _flag("block_size", "engine", int, "tokens per KV-cache block (a power of two)"),
    _flag("max_num_seqs", "engine", int, "most sequences in one running batch"),
    _flag("max_num_batched_tokens", "engine", int, "token budget of one engine step (chunked prefill above it)"),
    _flag(
        "sliding_window",
        "engine",
        _optional(int),
        "force a sliding attention window of this many tokens on any model",
    ),
    _flag("num_sink_tokens", "engine", int, "with a sliding window: the first N tokens stay visible forever"),
    _flag("enable_prefix_caching", "engine", _bool, "reuse KV blocks of shared prompt prefixes (true/false)"),
    _flag(
        "max_queued_requests",
        "server",
        int,
        "most requests waiting to start, for generation and for embeddings each; past it: 429 with Retry-After",
    ),
    _flag(
        "api_key",
        "server.api_keys",
        _keys,
        "require 'Authorization: Bearer KEY' on every route but /health (/metrics too); repeat it (or give "
        "a comma-separated list) for several keys, one per client",
        repeatable=True,
    ),
    _flag(
        "api_key_file",
        "server.api_keys",
        _key_file,
        "more keys, one per line of this file ('#' starts a comment line); a file with no key is an error",
    ),
    _flag(
        "admin_api_key",
        "server.admin_api_keys",
        _keys,
        "a key that also reads what tells clients about each other's requests: /metrics' prefix-cache "
        "series and /kv_cache's blocks and sequences (repeatable). Without one, only a server's single "
        "--api-key (or everyone, with no key) reads them",
        repeatable=True,
    ),
    _flag(
        "prefix_cache_scope",
        "server",
        _one_of(*PREFIX_CACHE_SCOPES),
        "api-key (the default): each API key's requests share cached prompt prefixes only among "
        "themselves, since a cached prefix answers much faster and would tell one client by timing what "
        "another sent (with one key or none it changes nothing); shared: across all keys, split only by "
        "a request's cache_salt",
    ),
    _flag("allowed_origins", "server", str, "comma-separated CORS origins ('*' for any; empty: CORS off)"),
    _flag(
        "request_timeout",
        "server",
        _optional(float),
        "seconds a generation or embedding request may take before it is aborted (none: no limit)",
    ),
    _flag(
        "max_request_bytes",
        "server",
        _size,
        "largest request body accepted (413 above it): bytes or with a unit",
    ),
    _flag(
        "shutdown_timeout",
        "server",
        float,
        "on SIGTERM/SIGINT, seconds the requests in flight get to finish while new ones get 503 "
        "(the rest then end with 503 shutting_down); a second signal cuts them at once",
    ),
    _flag(
        "max_client_batch_size",
        "server",
        int,
        "most prompts or inputs in one completions or embeddings request (413 above it)",
    ),
    _flag(
        "max_request_cost",
        "server",
        _optional(int),
        "most tokens one completions or chat request may hold: prompts x n x (prompt tokens + max_tokens, "
        "at most the context length); above it: 400 request_too_large "
        "(default: the KV cache's capacity, at least 8 contexts)",
    ),
    _flag(
        "max_request_logprobs",
        "server",
        int,
        "most logprob entries one generation request may return (each listed token and alternative: prompt "
        "logprobs, echoed ones and sampled tokens', over every choice, max_tokens counted in full); "
        "above it: 400 request_too_large",
    ),
    _flag(
        "embedding_max_batch_tokens",
        "embedder.max_batch_tokens+reranker.max_batch_tokens",
        int,
        "token budget of one embedding (or rerank) forward pass",
    ),
    _flag(
        "default_max_tokens",
        "server",
        _optional(int),
        "max_tokens of a generation request that sets none (default: chat and responses run to the context "
        "limit, as OpenAI and vLLM do; completions stop at 16, OpenAI's default there)",
    ),
    _flag(
        "embedding_token_ids",
        "embedder.token_ids",
        _one_of(*TOKEN_ID_INPUT_MODES),
        "token-id input to the embedding routes: check (default; only what the embedding model's tokenizer "
        "makes of a text, special tokens included: refuses e.g. tiktoken's ids), accept (any id in the "
        "vocabulary), reject (text only)",
    ),
    _flag(
        "pooling",
        "embedder",
        _optional(str),
        f"embedding pooling, one of {', '.join(POOLING_MODES)} (default: the model's own)",
    ),
    _flag(
        "timeout_keep_alive",
        "server",
        float,
        "seconds an idle keep-alive connection is held open after a response",
    ),
    _flag(
        "timeout_request_head",
        "server",
        float,
        "seconds a connection gets to send a complete request head, from its opening or its previous "
        "response; then it is closed (408 if a head was begun). Requests under way are not affected",
    ),
    _flag(
        "timeout_request_body",
        "server",
        float,
        "seconds a request's whole body gets to arrive once its head is in; then 408 and the connection "
        "closed. 60 carries a --max-request-bytes body (2MiB) over a ~300 kbit/s link, while a body "
        "trickled byte by byte holds its request slot no longer; responses (SSE streams too) are not affected",
    ),
    _flag(
        "limit_concurrency",
        "server",
        _optional(int),
        "most requests in progress at once (from a complete head to the end of the answer; idle "
        "connections hold none); past it: a plain-text 503. /health is always answered (none: no cap)",
    ),
    _flag(
        "max_connections_per_client",
        "server",
        _optional(int),
        "most open connections from one client address; further ones are closed at once. 512 is above "
        "what one client can have admitted at the defaults (--max-num-seqs + --max-queued-requests: 320) "
        "plus idle pooled connections; behind a proxy every client shares its address (none: no cap)",
    ),
    _flag(
        "max_request_head_bytes",
        "server",
        _size,
        "largest request line plus headers, blank line included, however the head is split into reads "
        "(400 and the connection closed above it): bytes or with a unit",
    ),
    _flag("log_level", "server", str, f"logging level: {', '.join(LOG_LEVELS)}"),
    _flag(
        "metrics_names",
        "server",
        _one_of(*METRICS_NAMES),
        "names of the /metrics series vLLM also has: kvserve (kvserve: prefix), vllm (vLLM's exact vllm: "
        "names, read by dashboards, autoscalers and routers built for vLLM) or both (the default: kvserve's "
        "and vLLM's tooling both work with no flag, for a /metrics page about twice as long)",
    ),
    _flag(
        "playground",
        "server",
        _bool,
        "serve the browser playground at GET / and its two routes, POST /attention and GET /kv_cache "
        "(false, or --no-playground: all three are gone, 404; GET / 405, as POST / stays TEI's embed route)",
    ),
    _flag(
        "allow_special_tokens_in_content",
        "server",
        _bool,
        "chat messages (and /tokenize messages): a special token's text in a client's string is that token, "
        "as if the template wrote it (default false: it is text, and only the template's markers are tokens)",
    ),
    _flag("num_threads", "engine", _optional(int), "torch CPU threads (default: torch's choice)"),
    _flag(
        "speculative_method",
        "speculative.method",
        _optional(_one_of(*SPECULATIVE_METHODS)),
        "speculative decoding: ngram (drafts copied from the prompt and the output so far) or draft (drafts "
        "from --draft-model); none: off. Greedy output is unchanged, sampled output keeps its distribution",
    ),
    _flag(
        "num_speculative_tokens",
        "speculative",
        int,
        "with --speculative-method: most draft tokens verified per sequence and step (1 to 16)",
    ),
    _flag(
        "ngram_min",
        "speculative",
        int,
        "with --speculative-method ngram: the shortest tail of the text looked up for an earlier occurrence",
    ),
    _flag(
        "ngram_max",
        "speculative",
        int,
        "with --speculative-method ngram: the longest tail looked up first (at least --ngram-min)",
    ),
    _flag(
        "draft_model",
        "speculative",
        _optional(str),
        "with --speculative-method draft: the draft model (same forms as --model), small, with --model's tokenizer",
    ),
    _flag(
        "draft_quantization",
        "speculative",
        str,
        "with --speculative-method draft: the draft model's --quantization (a quantized copy of --model "
        "itself is a draft that reads a fraction of its bytes)",
    ),
    _scale_flag(
        "replicas",
        "replicas",
        int,
        "run this many replicas (one engine each) on a local Ray Serve instance behind one address; "
        "0: one process, no Ray. Needs pip install 'kvserve[ray]'",
    ),
    _scale_flag(
        "max_replicas",
        "max_replicas",
        _optional(int),
        "with --replicas N: autoscale between N and this many replicas on ongoing requests per replica "
        "(target: --max-num-seqs); none: exactly N",
    ),
    _scale_flag(
        "replica_routing",
        "routing",
        _one_of(*ROUTINGS),
        "with --replicas: prefix (requests sharing a prompt prefix go to one replica, so its prefix cache "
        "pays off; the least-loaded one when that replica is busy) or least-loaded",
    ),
    _scale_flag(
        "replica_metrics_port",
        "metrics_port",
        int,
        "with --replicas: port of the Prometheus endpoint carrying every replica's series, on 127.0.0.1 "
        "(0: a free port, logged at start)",
    ),
)


def _speculative_defaults() -> SimpleNamespace:
    """SpeculativeConfig's defaults, but no method: speculation is off unless --speculative-method names one."""
    defaults = {field.name: field.default for field in dataclasses.fields(SpeculativeConfig)}
    return SimpleNamespace(**{**defaults, "method": None})


def _defaults() -> dict[str, Any]:
    """flag name -> the default `kvserve serve` uses when neither the flag nor its variable is set."""
    server = ServerConfig()
    configs = {"server": server, "engine": default_engine_config(), "embedder": default_embedder_config()}
    configs["reranker"] = server.reranker  # None: no rerank model unless --rerank-model names one
    configs["speculative"] = _speculative_defaults()
    scale_out = ScaleOut()
    defaults = {}
    for flag in FLAGS:
        if flag.scale_out is not None:
            defaults[flag.name] = getattr(scale_out, flag.scale_out)
            continue
        config_name, field_name = flag.targets[0]
        config = configs[config_name]
        defaults[flag.name] = getattr(config, field_name) if config is not None else None
    return defaults


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def _default_text(value: Any) -> str:
    if isinstance(value, tuple):
        return ",".join(value) or "''"
    return "none" if value is None else str(value)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every serve flag; a flag's default comes from KVSERVE_<NAME> when that is set."""
    group = parser.add_argument_group("serve options (each also read from the environment variable shown)")
    defaults = _defaults()
    for flag in FLAGS:
        default = defaults[flag.name]
        env = env_name(flag.name)
        if env in os.environ:
            try:
                default = flag.kind(os.environ[env])
            except (ValueError, argparse.ArgumentTypeError) as exc:
                parser.error(f"{env}={os.environ[env]!r}: {exc}")
        group.add_argument(
            "--" + flag.name.replace("_", "-"),
            dest=flag.name,
            type=flag.kind,
            default=default,
            **({"action": _AddValues} if flag.repeatable else {}),
            metavar="{true,false}" if flag.kind is _bool else getattr(flag.kind, "metavar", flag.name.upper()),
            help=f"{flag.help} [env {env}; default {_default_text(defaults[flag.name])}]",
        )
    group.add_argument(
        "--no-playground", dest="playground", action="store_false", help="the same as --playground false"
    )


def _speculative_config(values: dict[str, Any]) -> SpeculativeConfig | None:
    """The engine's SpeculativeConfig, or None without --speculative-method. The other speculative flags are
    checked either way: a bad value, or a --draft-model that nothing would load, is an error, not ignored."""
    if values["method"] is not None:
        return SpeculativeConfig(**values)
    if values["draft_model"]:
        raise ValueError("--draft-model is only used with --speculative-method draft")
    SpeculativeConfig(**{**values, "method": "ngram"})  # the checks alone
    return None


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The nested ServerConfig from parsed flags (a flag `args` lacks takes its default); an empty
    --embedding-model serves no embeddings, an empty --rerank-model (the default) no reranking, no
    --speculative-method (the default) no speculative decoding.

    Raises ValueError (from the configs' own checks) on a value or combination that cannot work.
    """
    defaults = _defaults()
    values: dict[str, dict[str, Any]] = {"server": {}, "engine": {}, "embedder": {}, "reranker": {}, "speculative": {}}
    for flag in FLAGS:
        for config_name, field_name in flag.targets:
            value = getattr(args, flag.name, defaults[flag.name])
            if isinstance(value, tuple) and isinstance(values[config_name].get(field_name), tuple):
                value = values[config_name][field_name] + value  # --api-key and --api-key-file
            values[config_name][field_name] = value
    engine = EngineConfig(**values["engine"], speculative=_speculative_config(values["speculative"]))
    embedder = EmbedderConfig(**values["embedder"]) if values["embedder"]["model"] else None
    reranker = RerankerConfig(**values["reranker"]) if values["reranker"]["model"] else None
    return ServerConfig(engine=engine, embedder=embedder, reranker=reranker, **values["server"])


def scale_out_from_args(args: argparse.Namespace) -> ScaleOut:
    """The ScaleOut from parsed flags (a flag `args` lacks takes its default). Raises ValueError."""
    defaults = _defaults()
    values = {f.scale_out: getattr(args, f.name, defaults[f.name]) for f in FLAGS if f.scale_out is not None}
    return ScaleOut(**values)


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    logging.getLogger().setLevel(level.upper())


GIL_SWITCH_INTERVAL_S = 0.0005


class _StoppingServer(uvicorn.Server):
    """uvicorn, stopped the kvserve way (server/shutdown.py): drain first, then cut, then exit.

    The first SIGTERM/SIGINT starts draining (while the models still load: stops at once); the
    requests in flight get `grace` seconds; a second signal cuts them at once. The signal handler
    only counts signals: the phases move on uvicorn's 0.1 s tick, on the event loop.
    """

    def __init__(
        self,
        config: uvicorn.Config,
        state: ServerState,
        stop_requests: Callable[[ServerState], Awaitable[None]],
        grace: float,
    ) -> None:
        super().__init__(config)
        self._state = state
        self._stop_requests = stop_requests
        self._grace = grace
        self._num_signals = 0
        self._cut_at = math.inf  # monotonic
        self._exit_at = math.inf  # monotonic

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Replaces uvicorn's handler: it would close the listening socket at once (no 503 phase) and
        # re-raise the signal at exit.
        self._num_signals += 1

    async def on_tick(self, counter: int) -> bool:
        if self._num_signals and not self.should_exit:
            await self._advance_stop()
        return await super().on_tick(counter)

    async def _advance_stop(self) -> None:
        shutdown = self._state.shutdown
        if shutdown.phase == SERVING:
            if not self._state.is_ready:
                logger.info("stop requested while the models load: stopping now")
                self.should_exit = True
                return
            shutdown.begin_draining()
            self._cut_at = time.monotonic() + self._grace
            logger.info(
                "draining: new requests get 503; %d in flight get up to %.1f s to finish",
                shutdown.num_in_flight,
                self._grace,
            )
        if shutdown.phase == DRAINING and (
            shutdown.num_in_flight == 0 or time.monotonic() >= self._cut_at or self._num_signals > 1
        ):
            if shutdown.num_in_flight:
                logger.warning("stopping %d request(s) still in flight: they end with 503", shutdown.num_in_flight)
            await self._stop_requests(self._state)
            self._exit_at = time.monotonic() + FINISH_AFTER_CUT_S
        if shutdown.phase == STOPPING and (shutdown.num_in_flight == 0 or time.monotonic() >= self._exit_at):
            self.should_exit = True


def _exit_before_serving(sig: int, frame: FrameType | None) -> None:
    """A stop before the server runs (flags, imports, the app): nothing needs an orderly end yet."""
    sys.stderr.flush()
    os._exit(0)


def _ignore_signal(sig: int, frame: FrameType | None) -> None:
    """After the server has stopped: a late signal must not change how the process ends."""


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT, then stop cleanly (server/shutdown.py) and return 0.

    A stop drains: the requests in flight get --shutdown-timeout seconds while new ones get 503;
    a second signal cuts them at once. A stop while the models load (or before the server runs)
    exits at once with 0, without waiting for the load: the process ends here (os._exit), since
    the torch thread still loading cannot be interrupted or joined.

    Returns 1 if a model fails to load, 2 on a bad flag combination.
    """
    previous = {sig: signal.signal(sig, _exit_before_serving) for sig in STOP_SIGNALS}
    try:
        return _serve(args)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _serve(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
        scale_out = scale_out_from_args(args)
    except ValueError as exc:
        print(f"kvserve serve: {exc}", file=sys.stderr)
        return 2
    _setup_logging(config.log_level)
    if scale_out.is_distributed:
        from server.ray import local as ray_local

        missing = ray_local.missing_ray()
        if missing is not None:
            print(f"kvserve serve: {missing}", file=sys.stderr)
            return 2
        return ray_local.serve_replicas(config, scale_out)
    # Three threads share the GIL: the event loop, the text worker and the torch worker. A decode
    # step gives the GIL up at every native call (a torch op, a kernel) and must win it back each
    # time; under load the holder keeps it for up to the switch interval (5 ms by default), so a
    # 10 ms step could take 200 ms. A shorter interval hands it back sooner.
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    from server.app import create_app, stop_requests
    from server.state import state_of

    exit_code = 0
    server: uvicorn.Server | None = None

    def on_fatal(exc: BaseException) -> None:
        nonlocal exit_code
        exit_code = 1
        if server is not None:
            server.should_exit = True

    app = create_app(config, on_fatal=on_fatal)
    state = state_of(app)
    uvicorn_config = uvicorn.Config(
        # The request cap counts requests in progress, not connections (server/http/h11_protocol.py).
        cap_requests_in_progress(app, config.limit_concurrency),
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        access_log=False,  # the middleware writes one line per request with tokens and latency
        # Requests have drained (or been cut) before uvicorn's own shutdown starts: only stragglers are left.
        timeout_graceful_shutdown=CLOSE_CONNECTIONS_S,
        lifespan="on",
        timeout_keep_alive=config.timeout_keep_alive,
        # uvicorn's own limit counts open connections: idle sockets would refuse every request.
        limit_concurrency=None,
        # h11, not "auto": uvicorn's h11 protocol plus the head and body deadlines, the exact head-size
        # limit and the per-client connection cap (server/http/h11_protocol.py).
        http=limited_h11_protocol(
            ConnectionLimits(
                timeout_request_head=config.timeout_request_head,
                timeout_request_body=config.timeout_request_body,
                max_request_head_bytes=config.max_request_head_bytes,
                max_connections_per_client=config.max_connections_per_client,
            )
        ),
        h11_max_incomplete_event_size=config.max_request_head_bytes,
        # Not "auto": with uvloop installed, a client that hung up right after sending a
        # non-streamed request was sometimes never reported as gone, so its generation ran to
        # the end (tests/server/test_server_robustness.py failed ~40% of runs); asyncio's loop never missed it.
        loop="asyncio",
    )
    server = _StoppingServer(uvicorn_config, state, stop_requests, config.shutdown_timeout)
    server.run()
    for sig in STOP_SIGNALS:
        signal.signal(sig, _ignore_signal)
    if state.shutdown.interrupted_load or server.started:
        # The stop is done: requests answered, engine and workers stopped (or a load that cannot be joined).
        # The interpreter's own teardown of torch and the models would take another second here, out of the
        # grace an orchestrator gives before SIGKILL: end the process now, logs flushed.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code)
    if not server.started and exit_code == 0:
        return 1  # could not bind, or start-up failed
    return exit_code


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvserve serve", description="Run the kvserve HTTP server.")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
