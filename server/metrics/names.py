"""The names /metrics exports each series under, chosen by --metrics-names (kvserve, vllm or both).

kvserve's own names carry the `kvserve:` prefix and the label `model_name`. A series that means
what a vLLM series means is also (or instead) exported under vLLM's exact name: the same type and
unit, vLLM's label names (`model_name`, and `engine`: the index of the engine core, always "0"
here) and, for histograms, vLLM's bucket bounds, so that queries and alert rules written against
vLLM find the same series and the same `le` values. Where vLLM has two names for one quantity (an
older one that dashboards and routers still read beside its successor) both are exported.
Series vLLM has no counterpart of (embeddings) keep their `kvserve:` name whatever the choice.

This module only names; server/metrics/server_metrics.py and server/metrics/engine.py export.
"""

from __future__ import annotations

from dataclasses import dataclass

from server.config import METRICS_NAMES

KVSERVE_PREFIX = "kvserve:"
VLLM_PREFIX = "vllm:"
KVSERVE_LABELS = ("model_name",)
VLLM_LABELS = ("model_name", "engine")
VLLM_ENGINE_INDEX = "0"  # kvserve runs one engine core


@dataclass(frozen=True)
class Target:
    """One exported name of a series: full name, label names, and the values of those labels."""

    name: str
    labelnames: tuple[str, ...]
    labelvalues: tuple[str, ...]
    is_vllm: bool


@dataclass(frozen=True)
class Naming:
    """Which name families /metrics exports, for one served model."""

    model_name: str
    kvserve: bool
    vllm: bool

    @classmethod
    def of(cls, metrics_names: str, model_name: str) -> Naming:
        """metrics_names: "kvserve", "vllm" or "both" (ServerConfig.metrics_names)."""
        if metrics_names not in METRICS_NAMES:
            raise ValueError(f"metrics_names must be one of {METRICS_NAMES}, got {metrics_names!r}")
        return cls(model_name, kvserve=metrics_names != "vllm", vllm=metrics_names != "kvserve")

    def targets(self, kvserve_name: str | None, vllm_names: tuple[str, ...]) -> list[Target]:
        """Every name a series goes out under: `kvserve_name` (None: a vLLM alias only) and `vllm_names`; a series
        with no vLLM name keeps its kvserve name whatever the choice."""
        targets = []
        if kvserve_name is not None and (self.kvserve or not vllm_names):
            targets.append(Target(KVSERVE_PREFIX + kvserve_name, KVSERVE_LABELS, (self.model_name,), False))
        if self.vllm:
            values = (self.model_name, VLLM_ENGINE_INDEX)
            targets.extend(Target(VLLM_PREFIX + name, VLLM_LABELS, values, True) for name in vllm_names)
        return targets


# ---- histogram bounds ----

_LATENCY_BUCKETS = (
    *(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75),
    *(1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0),
)
_TOKEN_LATENCY_BUCKETS = (
    *(0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1),
    *(0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0),
)
_VLLM_TTFT_BUCKETS = (*_LATENCY_BUCKETS, 2560.0)
_VLLM_TOKEN_LATENCY_BUCKETS = (
    *(0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5),
    *(0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0),
)
_VLLM_REQUEST_LATENCY_BUCKETS = (
    *(0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0),
    *(30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0),
)
# Token counts: 1, 2, 5, 10, 20, 50, ... up to a million. vLLM stops at the model's context length,
# which is unknown until the model loads; the bounds they share are the same.
_TOKEN_COUNT_BUCKETS = tuple(float(m * 10**e) for e in range(7) for m in (1, 2, 5) if m * 10**e <= 10**6)
_N_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0)


@dataclass(frozen=True)
class HistogramSpec:
    """A per-request histogram: its kvserve name, its vLLM names, and each family's bounds."""

    kvserve: str | None
    vllm: tuple[str, ...]
    doc: str
    buckets: tuple[float, ...]
    vllm_buckets: tuple[float, ...]


def _latency(name: str, doc: str, vllm_buckets: tuple[float, ...] = _VLLM_REQUEST_LATENCY_BUCKETS) -> HistogramSpec:
    return HistogramSpec(name, (name,), doc, _LATENCY_BUCKETS, vllm_buckets)


def _count(name: str, doc: str, buckets: tuple[float, ...] = _TOKEN_COUNT_BUCKETS) -> HistogramSpec:
    return HistogramSpec(name, (name,), doc, buckets, buckets)


TIME_TO_FIRST_TOKEN = _latency(
    "time_to_first_token_seconds", "Time from arrival to the first generated token.", _VLLM_TTFT_BUCKETS
)
# One observation per step that brought new tokens; vLLM exports it under two names.
INTER_TOKEN_LATENCY = HistogramSpec(
    "inter_token_latency_seconds",
    ("inter_token_latency_seconds", "time_per_output_token_seconds"),
    "Time between consecutive generated tokens.",
    _TOKEN_LATENCY_BUCKETS,
    _VLLM_TOKEN_LATENCY_BUCKETS,
)
REQUEST_TIME_PER_OUTPUT_TOKEN = HistogramSpec(
    "request_time_per_output_token_seconds",
    ("request_time_per_output_token_seconds",),
    "A request's decode time over its longest sample's tokens after the first.",
    _TOKEN_LATENCY_BUCKETS,
    _VLLM_TOKEN_LATENCY_BUCKETS,
)
E2E_REQUEST_LATENCY = _latency("e2e_request_latency_seconds", "Time from arrival to the last token.")
REQUEST_QUEUE_TIME = _latency("request_queue_time_seconds", "Time a request waited before it was first scheduled.")
REQUEST_PREFILL_TIME = _latency("request_prefill_time_seconds", "Time from first scheduled to the first token.")
REQUEST_DECODE_TIME = _latency("request_decode_time_seconds", "Time from the first token to the last.")
REQUEST_INFERENCE_TIME = _latency("request_inference_time_seconds", "Time from first scheduled to the last token.")
REQUEST_PROMPT_TOKENS = _count("request_prompt_tokens", "Prompt tokens of a request (cached ones included).")
REQUEST_GENERATION_TOKENS = _count("request_generation_tokens", "Tokens a request generated (all its samples).")
REQUEST_MAX_NUM_GENERATION_TOKENS = _count(
    "request_max_num_generation_tokens", "Tokens the longest sample of a request generated."
)
REQUEST_PARAMS_MAX_TOKENS = _count("request_params_max_tokens", "The max_tokens a request asked for.")
REQUEST_PARAMS_N = _count("request_params_n", "The n (samples per prompt) a request asked for.", _N_BUCKETS)
