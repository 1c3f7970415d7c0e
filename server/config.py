"""ServerConfig: what `kvserve serve` runs, frozen and validated once.

It holds the generation model's `EngineConfig`, the embedding model's `EmbedderConfig` and the
rerank model's `RerankerConfig` (engine/config.py validates those) plus the server's own settings
(network, auth, limits). server/cli/args.py builds them all from the flags.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from engine import DEFAULT_EMBEDDING_MODEL, DEFAULT_GENERATION_MODEL
from engine.config import EmbedderConfig, EngineConfig, RerankerConfig
from server.catalogue.entries import FOREVER, ModelEntry
from server.http.access import PREFIX_CACHE_SCOPES, parse_keys

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
# The names /metrics exports its series under (server/metrics/server_metrics.py): kvserve's own, vLLM's, or both.
METRICS_NAMES = ("kvserve", "vllm", "both")
# --reasoning-parser: one family (<think>...</think>), under the names vLLM users know it by too.
REASONING_PARSERS = ("none", "think", "qwen3", "deepseek_r1")


def default_engine_config() -> EngineConfig:
    """The generation model `kvserve serve` runs when told nothing: the default model, quantization auto."""
    return EngineConfig(model=DEFAULT_GENERATION_MODEL, quantization="auto")


def default_embedder_config() -> EmbedderConfig:
    return EmbedderConfig(model=DEFAULT_EMBEDDING_MODEL)


_BYTE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "ki": 1024,
    "kib": 1024,
    "mi": 1024**2,
    "mib": 1024**2,
    "gi": 1024**3,
    "gib": 1024**3,
    "ti": 1024**4,
    "tib": 1024**4,
}
_BYTES_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: str | int) -> int:
    """'512MiB' -> 536870912, '2GB' -> 2000000000, '1024' or 1024 -> 1024."""
    if isinstance(value, bool):
        raise TypeError(f"not a size: {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must be non-negative, got {value}")
        return value
    match = _BYTES_RE.match(str(value))
    if not match or match.group(2).lower() not in _BYTE_UNITS:
        raise ValueError(f"not a size: {value!r} (examples: 1048576, 512MiB, 2GB)")
    return int(float(match.group(1)) * _BYTE_UNITS[match.group(2).lower()])


@dataclass(frozen=True)
class ServerConfig:
    """Everything `kvserve serve` can be told.

    engine: the generation model and its engine settings.
    embedder: the embedding model; None serves no embeddings.
    reranker: the rerank model (a cross-encoder); None (the default) serves no reranking.
    served_model_name: the names clients use for the generation model, the first one in every answer's
        `model` field (empty: `engine.model`; a string: a comma-separated list).
    request_timeout: seconds a generation or embedding request may live (None: no limit).
    max_client_batch_size: most prompts or inputs in one completions or embeddings request.
    timeout_keep_alive: seconds an idle keep-alive connection is held open after a response.
    timeout_request_head: seconds a connection gets to deliver a complete request head, counted
        from its opening or, kept alive, from its previous response; then it is closed (a 408
        first if part of a head came). A request whose head is in (slow body, long stream) is
        never cut by it. Bounds slowloris-style clients and silent connections.
    timeout_request_body: seconds a request's whole body gets to arrive once its head is in; then
        408 and the connection closed. A response (an SSE stream too) is never cut by it.
    limit_concurrency: most requests in progress, from a complete head to the end of the answer;
        past it, a plain-text 503 (None: no cap). Idle connections hold no slot; /health is always
        answered.
    max_connections_per_client: most open connections from one peer address; further ones are
        closed at once (None: no cap). Bounds the file descriptors idle sockets can take.
    max_request_head_bytes: largest request line plus headers, blank line included, however the
        head is split into reads; a longer head gets 400 and its connection closed.
    max_request_cost: most tokens one completions or chat request may hold: prompts x n x
        (prompt tokens + max_tokens), see server/openai/params.py; above it, 400 request_too_large.
        None: the KV cache's capacity in tokens, but at least 8 x max_model_len (a request that
        alone could fill the cache would evict or hold back every other request until it ends).
    max_request_logprobs: most logprob entries (a listed token or alternative, about 30-60 bytes of
        JSON each) one generation request may return, see server/openai/params.py; above it, 400
        request_too_large. Each entry is a row of logits reduced to a top-k on the torch worker and
        an object in the answer: a request asking for millions would hold the engine and the event
        loop for minutes.
    default_max_tokens: the max_tokens of a generation request that sets none. None (the default):
        chat and responses run to the context limit (OpenAI's and vLLM's behaviour), completions
        stop at 16 tokens (OpenAI's default for that route).
    metrics_names: which names /metrics exports the series vLLM also has under: "kvserve"
        (`kvserve:` only), "vllm" (vLLM's exact `vllm:` names only) or "both" (each twice, so
        kvserve dashboards and vLLM-built dashboards, autoscalers and routers all read it).
    playground: serve the browser playground at GET / with its two routes, POST /attention and
        GET /kv_cache (False: all three are gone).
    allow_special_tokens_in_content: encode chat messages as the rendered text's whole, so a special
        token's text in a message is that token (False, the default: what a client sends is text,
        and only the chat template's own markers are control tokens).
    api_keys: every key the server accepts as `Authorization: Bearer KEY` or `x-api-key: KEY` (admin keys included; a
        string: a comma-separated list); empty: the server is open and everyone is an admin.
    admin_api_keys: the keys that also read what tells one client about another's requests (the
        prefix-cache counters of /metrics, /kv_cache's per-block and per-sequence detail); with none,
        the one key of a server with just one is an admin (server/http/access.py).
    reasoning_parser: "think" (or its other names, "qwen3" and "deepseek_r1"): a reasoning model's
        `<think>...</think>` is split from its answer (server/openai/reasoning.py); "none": all content.
    default_chat_template_kwargs: chat template variables every chat request gets (its own
        `chat_template_kwargs` override them), e.g. {"enable_thinking": False}.
    models: the models served besides the three defaults (`engine`, `embedder`, `reranker`), each loaded
        on its first request unless it says preload (server/catalogue/sources.py reads them from flags,
        a models directory and a models file).
    keep_alive: seconds a model loaded on demand stays loaded once idle (FOREVER: until evicted); the
        default models stay loaded unless a request's keep_alive or an unload says otherwise.
    max_loaded_models: most models loaded at once (None: no limit); past it the least recently used idle
        one is unloaded to make room.
    memory_budget: bytes the loaded models may hold, weights plus KV cache (an int), or that fraction of
        the machine's memory (a float in (0, 1]: RAM, or the GPU's memory for models on CUDA); None: no
        budget.
    only_model: the name of the one catalogue model this server serves (None: all of them). It loads at
        start and stays loaded until told otherwise, as a default model does: a Ray Serve deployment of one
        model (server/ray/model_routes.py) is such a server.
    prefix_cache_scope: "api-key": each key's requests share cached prefixes only among themselves
        (a cached prefix answers much faster, so sharing across keys would tell one client what
        another sent); "shared": across all keys, split by the request's cache_salt alone.
    """

    engine: EngineConfig = field(default_factory=default_engine_config)
    embedder: EmbedderConfig | None = field(default_factory=default_embedder_config)
    reranker: RerankerConfig | None = None
    served_model_name: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = 8000
    max_queued_requests: int = 256
    api_keys: tuple[str, ...] = ()
    admin_api_keys: tuple[str, ...] = ()
    prefix_cache_scope: str = "api-key"
    allowed_origins: tuple[str, ...] = ()
    request_timeout: float | None = 600.0
    max_request_bytes: int = 2 * 1024**2
    # Seconds requests in flight get after SIGTERM; with the ~1 s the stop itself takes, within
    # Docker's default 10 s before SIGKILL.
    shutdown_timeout: float = 8.0
    max_client_batch_size: int = 64
    max_request_cost: int | None = None
    max_request_logprobs: int = 262_144
    timeout_keep_alive: float = 5.0
    timeout_request_head: float = 10.0
    timeout_request_body: float = 60.0
    limit_concurrency: int | None = 1024
    max_connections_per_client: int | None = 512
    max_request_head_bytes: int = 64 * 1024
    log_level: str = "info"
    metrics_names: str = "both"
    default_max_tokens: int | None = None
    playground: bool = True
    allow_special_tokens_in_content: bool = False
    reasoning_parser: str = "none"
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    models: tuple[ModelEntry, ...] = ()
    keep_alive: float = 300.0
    max_loaded_models: int | None = None
    memory_budget: int | float | None = None
    only_model: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "models", tuple(self.models))
        if not self.keep_alive >= 0:
            raise ValueError(f"keep_alive must be non-negative seconds (or FOREVER), got {self.keep_alive}")
        if self.max_loaded_models is not None and self.max_loaded_models < 1:
            raise ValueError(f"max_loaded_models must be at least 1, got {self.max_loaded_models}")
        _check_memory_budget(self.memory_budget)
        _check_unique_names(self._whole_catalogue())
        if self.only_model is not None and self._only_entry() is None:
            names = ", ".join(entry.name for entry in self._whole_catalogue())
            raise ValueError(f"only_model {self.only_model!r} is not in the catalogue ({names})")
        object.__setattr__(self, "max_request_bytes", parse_bytes(self.max_request_bytes))
        if isinstance(self.allowed_origins, str):
            origins = tuple(o.strip() for o in self.allowed_origins.split(",") if o.strip())
            object.__setattr__(self, "allowed_origins", origins)
        else:
            object.__setattr__(self, "allowed_origins", tuple(self.allowed_origins))
        object.__setattr__(self, "served_model_name", _keys(self.served_model_name))
        admin_keys = _keys(self.admin_api_keys)
        object.__setattr__(self, "admin_api_keys", admin_keys)
        # An admin key is a key: it opens the server too.
        object.__setattr__(self, "api_keys", tuple(dict.fromkeys(_keys(self.api_keys) + admin_keys)))
        object.__setattr__(self, "prefix_cache_scope", self.prefix_cache_scope.lower())
        if self.request_timeout is not None and self.request_timeout <= 0:
            object.__setattr__(self, "request_timeout", None)
        object.__setattr__(self, "log_level", self.log_level.lower())
        object.__setattr__(self, "metrics_names", self.metrics_names.lower())
        object.__setattr__(self, "max_request_head_bytes", parse_bytes(self.max_request_head_bytes))

        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be at least 1, got {self.max_queued_requests}")
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be positive, got {self.max_request_bytes}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be non-negative, got {self.shutdown_timeout}")
        if self.max_client_batch_size < 1:
            raise ValueError(f"max_client_batch_size must be positive, got {self.max_client_batch_size}")
        if self.default_max_tokens is not None and self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be positive, got {self.default_max_tokens}")
        if self.max_request_cost is not None and self.max_request_cost < 1:
            raise ValueError(f"max_request_cost must be positive, got {self.max_request_cost}")
        if self.max_request_logprobs < 1:
            raise ValueError(f"max_request_logprobs must be positive, got {self.max_request_logprobs}")
        if self.timeout_keep_alive <= 0:
            raise ValueError(f"timeout_keep_alive must be positive, got {self.timeout_keep_alive}")
        if not self.timeout_request_head > 0:  # NaN too: a timer that never fires
            raise ValueError(f"timeout_request_head must be positive, got {self.timeout_request_head}")
        if not self.timeout_request_body > 0:
            raise ValueError(f"timeout_request_body must be positive, got {self.timeout_request_body}")
        if self.limit_concurrency is not None and self.limit_concurrency < 1:
            raise ValueError(f"limit_concurrency must be positive, got {self.limit_concurrency}")
        if self.max_connections_per_client is not None and self.max_connections_per_client < 1:
            raise ValueError(f"max_connections_per_client must be positive, got {self.max_connections_per_client}")
        if self.max_request_head_bytes < 1024:
            raise ValueError(f"max_request_head_bytes must be at least 1024, got {self.max_request_head_bytes}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {LOG_LEVELS}, got {self.log_level!r}")
        if self.metrics_names not in METRICS_NAMES:
            raise ValueError(f"metrics_names must be one of {METRICS_NAMES}, got {self.metrics_names!r}")
        object.__setattr__(self, "reasoning_parser", self.reasoning_parser.lower())
        if self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {REASONING_PARSERS}, got {self.reasoning_parser!r}")
        if not isinstance(self.default_chat_template_kwargs, dict):
            raise ValueError("default_chat_template_kwargs must be a mapping of template variable names to values")
        if self.prefix_cache_scope not in PREFIX_CACHE_SCOPES:
            raise ValueError(
                f"prefix_cache_scope must be one of {PREFIX_CACHE_SCOPES}, got {self.prefix_cache_scope!r}"
            )

    @property
    def model_name(self) -> str:
        """The generation model's name in answers: its first served name."""
        return self.model_names[0]

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name clients may use for the generation model (each is listed by /v1/models)."""
        return self.served_model_name or (self.engine.model,)

    @property
    def catalogue(self) -> tuple[ModelEntry, ...]:
        """Every model this server serves: the default of each task first (loaded at start, kept until
        told otherwise), then `models`; with only_model, that one model alone, loaded at start."""
        if self.only_model is None:
            return self._whole_catalogue()
        entry = self._only_entry()
        assert entry is not None  # checked at construction
        if isinstance(entry.config, EngineConfig) and entry.config.num_threads is None:
            # The server's thread count (its replica's share of the machine), which only the default engine's
            # config carries, and which this model's load would otherwise not set.
            entry = dataclasses.replace(
                entry, config=dataclasses.replace(entry.config, num_threads=self.engine.num_threads)
            )
        return (dataclasses.replace(entry, keep_alive=FOREVER, preload=True),)

    def _only_entry(self) -> ModelEntry | None:
        return next((entry for entry in self._whole_catalogue() if self.only_model in entry.names), None)

    def _whole_catalogue(self) -> tuple[ModelEntry, ...]:
        defaults = [ModelEntry(self.model_names, "generate", self.engine, FOREVER, preload=True)]
        if self.embedder is not None:
            defaults.append(ModelEntry((self.embedder.model,), "embed", self.embedder, FOREVER, preload=True))
        if self.reranker is not None:
            defaults.append(ModelEntry((self.reranker.model,), "rerank", self.reranker, FOREVER, preload=True))
        return (*defaults, *self.models)

    @property
    def api_key(self) -> str | None:
        """The first key (None: an open server); for code that only asks whether a key is required."""
        return self.api_keys[0] if self.api_keys else None


def _check_memory_budget(budget: int | float | None) -> None:
    if budget is None:
        return
    if isinstance(budget, bool) or not isinstance(budget, int | float):
        raise ValueError(f"memory_budget must be bytes or a fraction of memory, got {budget!r}")
    if isinstance(budget, float) and not 0 < budget <= 1:
        raise ValueError(f"memory_budget as a fraction must be in (0, 1], got {budget}")
    if isinstance(budget, int) and budget < 1:
        raise ValueError(f"memory_budget must be positive bytes, got {budget}")


def _check_unique_names(entries: tuple[ModelEntry, ...]) -> None:
    """A name (or a path, which requests may use too) names one model only."""
    owner: dict[str, int] = {}
    for number, entry in enumerate(entries):
        for name in dict.fromkeys((*entry.names, entry.config.model)):
            if owner.setdefault(name, number) != number:
                other = entries[owner[name]].config.model
                raise ValueError(
                    f"two models are named {name!r} ({other!r} and {entry.config.model!r}); give each its own name"
                )


def parse_memory_budget(text: str) -> int | float:
    """'0.5' -> 0.5 of memory, '16GiB' or '8000000000' -> bytes."""
    try:
        value = float(text)
    except ValueError:
        return parse_bytes(text)
    return value if 0 < value <= 1 and not text.strip().isdigit() else parse_bytes(text)


def _keys(value: str | tuple[str, ...] | list[str] | None) -> tuple[str, ...]:
    """Keys without surrounding blanks (a bearer token is read stripped), empty ones and repeats dropped."""
    if value is None:
        return ()
    if isinstance(value, str):
        return parse_keys(value)
    return tuple(dict.fromkeys(key.strip() for key in value if key.strip()))
