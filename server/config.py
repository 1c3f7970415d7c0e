"""ServerConfig: every `kvserve serve` flag, frozen and validated once.

`to_engine_config()` maps the generation flags onto `engine.config.EngineConfig`;
the server keeps the rest (network, auth, limits) for itself.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from engine.config import EngineConfig

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_EMBEDDING_MODEL = "all-minilm-l6-v2"
POOLING_CHOICES = ("mean", "cls", "last")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")

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
    """Everything `kvserve serve` can be told. Field names are the flag names (dashes -> underscores).

    embedding_model=None (or "") serves no embedding model. served_model_name defaults to `model`.
    request_timeout: seconds a generation request may live (None: no limit).
    max_client_batch_size: most prompts in one /v1/completions request.
    """

    model: str = DEFAULT_MODEL
    embedding_model: str | None = DEFAULT_EMBEDDING_MODEL
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    dtype: str = "float32"
    quantization: str = "auto"
    device: str = "cpu"
    max_model_len: int | None = None
    kv_cache_memory: int = 512 * 1024**2
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    sliding_window: int | None = None
    num_sink_tokens: int = 0
    enable_prefix_caching: bool = True
    max_queued_requests: int = 256
    api_key: str | None = None
    allowed_origins: tuple[str, ...] = ()
    request_timeout: float | None = 600.0
    max_request_bytes: int = 2 * 1024**2
    shutdown_timeout: float = 30.0
    max_client_batch_size: int = 64
    embedding_max_batch_tokens: int = 8192
    pooling: str | None = None
    log_level: str = "info"
    num_threads: int | None = field(default=None)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_cache_memory", parse_bytes(self.kv_cache_memory))
        object.__setattr__(self, "max_request_bytes", parse_bytes(self.max_request_bytes))
        if isinstance(self.allowed_origins, str):
            origins = tuple(o.strip() for o in self.allowed_origins.split(",") if o.strip())
            object.__setattr__(self, "allowed_origins", origins)
        else:
            object.__setattr__(self, "allowed_origins", tuple(self.allowed_origins))
        if not self.embedding_model:
            object.__setattr__(self, "embedding_model", None)
        if not self.api_key:
            object.__setattr__(self, "api_key", None)
        if self.request_timeout is not None and self.request_timeout <= 0:
            object.__setattr__(self, "request_timeout", None)
        object.__setattr__(self, "log_level", self.log_level.lower())

        if not self.model:
            raise ValueError("model must be set")
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
        if self.embedding_max_batch_tokens < 1:
            raise ValueError(f"embedding_max_batch_tokens must be positive, got {self.embedding_max_batch_tokens}")
        if self.pooling is not None and self.pooling not in POOLING_CHOICES:
            raise ValueError(f"pooling must be one of {POOLING_CHOICES}, got {self.pooling!r}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {LOG_LEVELS}, got {self.log_level!r}")
        # Fail at start-up, not at model load, on engine flags that cannot work.
        self.to_engine_config()

    @property
    def model_name(self) -> str:
        """The name clients use for the generation model."""
        return self.served_model_name or self.model

    def to_engine_config(self) -> EngineConfig:
        return EngineConfig(
            model=self.model,
            dtype=self.dtype,
            quantization=self.quantization,
            device=self.device,
            max_model_len=self.max_model_len,
            block_size=self.block_size,
            kv_cache_memory_bytes=self.kv_cache_memory,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            sliding_window=self.sliding_window,
            num_sink_tokens=self.num_sink_tokens,
            enable_prefix_caching=self.enable_prefix_caching,
            num_threads=self.num_threads,
        )
