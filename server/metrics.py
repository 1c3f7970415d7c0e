"""Prometheus metrics, named after vLLM's with the `kvserve:` prefix.

Each app gets its own CollectorRegistry (tests build several apps in one process).
Latency histograms are observed through `RequestTimer` (server/serving.py feeds it each output); engine gauges
and counters are read from the AsyncEngine's stats snapshot at scrape time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.outputs import EngineStats, RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
)
_TOKEN_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
)


class _EngineStatsCollector(Collector):
    """Gauges and counters straight from the engine's stats snapshot, at scrape time."""

    def __init__(self, model_name: str, get_stats: Callable[[], EngineStats | None]) -> None:
        self._model_name = model_name
        self._get_stats = get_stats

    def collect(self) -> Iterator[Metric]:
        stats = self._get_stats()
        if stats is None:  # still loading
            return
        labels = [self._model_name]
        gauges = (
            ("num_requests_running", "Requests in the running batch.", stats.num_running),
            ("num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting),
            ("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).", stats.kv_cache_usage),
        )
        for name, doc, value in gauges:
            family = GaugeMetricFamily(f"kvserve:{name}", doc, labels=["model_name"])
            family.add_metric(labels, value)
            yield family
        counters = (
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", stats.prefix_cache_queries),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats.prefix_cache_hits),
            ("num_preemptions", "Sequences preempted for lack of KV blocks.", stats.num_preemptions),
            ("prompt_tokens", "Prompt tokens processed.", stats.num_prompt_tokens),
            ("generation_tokens", "Tokens generated.", stats.num_generation_tokens),
        )
        for name, doc, value in counters:
            family = CounterMetricFamily(f"kvserve:{name}", doc, labels=["model_name"])
            family.add_metric(labels, value)
            yield family


class ServerMetrics:
    def __init__(self, model_name: str, get_stats: Callable[[], EngineStats | None]) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        label = ["model_name"]
        self.time_to_first_token = Histogram(
            "kvserve:time_to_first_token_seconds",
            "Time from arrival to the first generated token.",
            label,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.inter_token_latency = Histogram(
            "kvserve:inter_token_latency_seconds",
            "Time between consecutive generated tokens.",
            label,
            buckets=_TOKEN_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e_request_latency = Histogram(
            "kvserve:e2e_request_latency_seconds",
            "Time from arrival to the last token.",
            label,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.request_queue_time = Histogram(
            "kvserve:request_queue_time_seconds",
            "Time a request waited before it was first scheduled.",
            label,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.request_success = Counter(
            "kvserve:request_success",
            "Finished requests, by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.registry.register(_EngineStatsCollector(model_name, get_stats))
        # Embeddings (server/routes/embeddings.py calls observe_embedding_request).
        self.embedding_request_latency = Histogram(
            "kvserve:embedding_request_latency_seconds",
            "Time to answer an embedding request.",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.embedding_inputs = Counter(
            "kvserve:embedding_inputs", "Texts embedded.", ["endpoint"], registry=self.registry
        )
        self.embedding_prompt_tokens = Counter(
            "kvserve:embedding_prompt_tokens",
            "Tokens run through the embedding model.",
            ["endpoint"],
            registry=self.registry,
        )

    def observe_embedding_request(
        self, *, endpoint: str, num_inputs: int, num_prompt_tokens: int, latency_seconds: float
    ) -> None:
        self.embedding_request_latency.labels(endpoint).observe(latency_seconds)
        self.embedding_inputs.labels(endpoint).inc(num_inputs)
        self.embedding_prompt_tokens.labels(endpoint).inc(num_prompt_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def start_request(self) -> RequestTimer:
        return RequestTimer(self)


class RequestTimer:
    """Observes one request's latencies as its outputs arrive."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics
        self._labels = (metrics.model_name,)
        self._start = time.monotonic()
        self._last_token_time: float | None = None
        self._is_done = False

    def on_output(self, output: RequestOutput) -> None:
        now = time.monotonic()
        num_new_tokens = sum(len(o.token_ids) for o in output.outputs)
        if num_new_tokens == 0:
            return
        if self._last_token_time is None:
            self._metrics.time_to_first_token.labels(*self._labels).observe(now - self._start)
            if output.first_scheduled_time is not None and output.arrival_time:
                queue_time = max(output.first_scheduled_time - output.arrival_time, 0.0)
                self._metrics.request_queue_time.labels(*self._labels).observe(queue_time)
        else:
            # One step produced `num_new_tokens` (one per sample): each token waited this long.
            self._metrics.inter_token_latency.labels(*self._labels).observe(now - self._last_token_time)
        self._last_token_time = now

    def finish(self, finish_reason: str) -> None:
        if self._is_done:
            return
        self._is_done = True
        self._metrics.e2e_request_latency.labels(*self._labels).observe(time.monotonic() - self._start)
        self._metrics.request_success.labels(self._metrics.model_name, finish_reason).inc()
