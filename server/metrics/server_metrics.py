"""Prometheus metrics: kvserve's `kvserve:` series and, by --metrics-names, vLLM's exact `vllm:` names.

server/metrics/names.py says which names each series goes out under; engine gauges and counters are
read from the AsyncEngine's stats snapshot at scrape time (server/metrics/engine.py). Per-request
histograms are observed here, through `RequestTimer`: server/serving.py feeds it the request's
parameters, each output and, at the end, the `TokenCounts` its usage is made from. A "request" is
one HTTP request: its prompts and their n samples are observed together.

Each app gets its own CollectorRegistry (tests build several apps in one process). The page a
non-admin key reads leaves out the private prefix-cache series (server/metrics/engine.py).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import Metric

from engine.outputs import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, EngineStats, RequestOutput
from engine.params import SamplingParams
from server.metrics import names
from server.metrics.engine import EngineStatsCollector, private_series_names
from server.metrics.names import HistogramSpec, Naming

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _Observed:
    """One per-request histogram under each of its exported names: an observation reaches them all."""

    def __init__(self, registry: CollectorRegistry, naming: Naming, spec: HistogramSpec) -> None:
        self._default_model = naming.model_name
        self._parts: list[tuple[Histogram, tuple[str, ...]]] = []  # (histogram, its labels: the model's first)
        for target in naming.targets(spec.kvserve, spec.vllm):
            buckets = spec.vllm_buckets if target.is_vllm else spec.buckets
            histogram = Histogram(target.name, spec.doc, target.labelnames, buckets=buckets, registry=registry)
            self._parts.append((histogram, target.labelvalues))
        self._children: dict[str, list[Histogram]] = {}  # model name -> each name's series, its labels bound
        self._bound(self._default_model)  # now, so the series is on the page (at 0) before the first request

    def _bound(self, model_name: str) -> list[Histogram]:
        children = self._children.get(model_name)
        if children is None:
            children = [h.labels(model_name, *labels[1:]) for h, labels in self._parts]
            self._children[model_name] = children
        return children

    def observe(self, value: float, model_name: str | None = None) -> None:
        """model_name: the served model the request used (None: the default generation model)."""
        for child in self._bound(model_name or self._default_model):
            child.observe(value)


class _FinishedRequests:
    """Finished requests by finish reason, under each exported name of request_success."""

    REASONS = (FINISH_STOP, FINISH_LENGTH, FINISH_ABORT)  # on the page (at 0) from the start

    def __init__(self, registry: CollectorRegistry, naming: Naming) -> None:
        self._default_model = naming.model_name
        self._parts: list[tuple[Counter, tuple[str, ...]]] = []  # (counter, its model labels)
        for target in naming.targets("request_success", ("request_success",)):
            counter = Counter(
                target.name,
                "Finished requests, by finish reason.",
                (*target.labelnames, "finished_reason"),
                registry=registry,
            )
            for reason in self.REASONS:
                counter.labels(*target.labelvalues, reason)
            self._parts.append((counter, target.labelvalues))

    def inc(self, finish_reason: str, model_name: str | None = None) -> None:
        for counter, labelvalues in self._parts:
            counter.labels(model_name or self._default_model, *labelvalues[1:], finish_reason).inc()


class _WithoutSeries:
    """A registry's metrics but the named families: what generate_latest reads for a non-admin page."""

    def __init__(self, registry: CollectorRegistry, left_out: frozenset[str]) -> None:
        self._registry = registry
        self._left_out = left_out

    def collect(self) -> Iterator[Metric]:
        return (metric for metric in self._registry.collect() if metric.name not in self._left_out)


class ServerMetrics:
    """/metrics of one app: per-request histograms, engine gauges and counters, embedding series."""

    def __init__(
        self,
        model_name: str,
        get_stats: Callable[[], EngineStats | None],
        metrics_names: str = "both",
        embedding_model_name: str | None = None,
        more_stats: Callable[[], list[tuple[str, EngineStats]]] | None = None,
    ) -> None:
        """model_name: the generation model as clients name it (the `model_name` label).
        get_stats: the engine's stats snapshot (None while it loads), read at scrape time.
        metrics_names: "kvserve", "vllm" or "both" (server/metrics/names.py).
        embedding_model_name: the embedding model's name, for embedding requests that name none.
        more_stats: (name, stats) of every other loaded generation model, at scrape time.
        """
        self.model_name = model_name
        self.embedding_model_name = embedding_model_name
        self.registry = CollectorRegistry(auto_describe=True)
        naming = Naming.of(metrics_names, model_name)
        observed = functools.partial(_Observed, self.registry, naming)
        self.time_to_first_token = observed(names.TIME_TO_FIRST_TOKEN)
        self.inter_token_latency = observed(names.INTER_TOKEN_LATENCY)
        self.request_time_per_output_token = observed(names.REQUEST_TIME_PER_OUTPUT_TOKEN)
        self.e2e_request_latency = observed(names.E2E_REQUEST_LATENCY)
        self.request_queue_time = observed(names.REQUEST_QUEUE_TIME)
        self.request_prefill_time = observed(names.REQUEST_PREFILL_TIME)
        self.request_decode_time = observed(names.REQUEST_DECODE_TIME)
        self.request_inference_time = observed(names.REQUEST_INFERENCE_TIME)
        self.request_prompt_tokens = observed(names.REQUEST_PROMPT_TOKENS)
        self.request_generation_tokens = observed(names.REQUEST_GENERATION_TOKENS)
        self.request_max_num_generation_tokens = observed(names.REQUEST_MAX_NUM_GENERATION_TOKENS)
        self.request_params_max_tokens = observed(names.REQUEST_PARAMS_MAX_TOKENS)
        self.request_params_n = observed(names.REQUEST_PARAMS_N)
        self.request_success = _FinishedRequests(self.registry, naming)
        self.registry.register(EngineStatsCollector(naming, get_stats, more_stats))
        self._public = _WithoutSeries(self.registry, private_series_names(naming))
        # Embeddings (server/routes/embeddings.py): vLLM has no such series, so always kvserve's names.
        labels = ["model_name", "endpoint"]
        self.embedding_request_latency = Histogram(
            "kvserve:embedding_request_latency_seconds",
            "Time to answer an embedding request.",
            labels,
            buckets=names.E2E_REQUEST_LATENCY.buckets,
            registry=self.registry,
        )
        self.embedding_inputs = Counter("kvserve:embedding_inputs", "Texts embedded.", labels, registry=self.registry)
        self.embedding_prompt_tokens = Counter(
            "kvserve:embedding_prompt_tokens", "Tokens run through the embedding model.", labels, registry=self.registry
        )

    def observe_embedding_request(
        self,
        *,
        endpoint: str,
        num_inputs: int,
        num_prompt_tokens: int,
        latency_seconds: float,
        model_name: str | None = None,
    ) -> None:
        """One embedding request answered. model_name: the served model that answered it, as clients
        name it (the `model_name` label); None: the embedding model the server was started with."""
        labels = (model_name or self.embedding_model_name or "", endpoint)
        self.embedding_request_latency.labels(*labels).observe(latency_seconds)
        self.embedding_inputs.labels(*labels).inc(num_inputs)
        self.embedding_prompt_tokens.labels(*labels).inc(num_prompt_tokens)

    def render(self, private: bool = True) -> bytes:
        """The /metrics page (Prometheus text format); private: with the prefix-cache series (an admin's)."""
        return generate_latest(self.registry if private else self._public)

    def start_request(self, model_name: str | None = None) -> RequestTimer:
        """The timer of one generation request, started now (its arrival). model_name: the served model it
        uses, its `model_name` label (None: the default generation model's)."""
        return RequestTimer(self, model_name)


class TokenCounts:
    """One HTTP request's tokens as its outputs arrive: each prompt's, and each sample's generated so far.

    Keys: the prompt's index in the request (one engine request each) and the sample's index. The
    request's usage and its per-request token histograms both read it.
    """

    def __init__(self) -> None:
        self.prompt_tokens: dict[int, int] = {}
        self.generated_tokens: dict[tuple[int, int], int] = {}

    def add(self, prompt_index: int, output: RequestOutput) -> None:
        self.prompt_tokens[prompt_index] = output.num_prompt_tokens
        for sample in output.outputs:
            key = (prompt_index, sample.index)
            previous = self.generated_tokens.get(key, 0)
            self.generated_tokens[key] = sample.num_generated_tokens or (previous + len(sample.token_ids))

    @property
    def num_prompt_tokens(self) -> int:
        return sum(self.prompt_tokens.values())

    @property
    def num_generated_tokens(self) -> int:
        return sum(self.generated_tokens.values())


class RequestTimer:
    """Observes one request's latencies as its outputs arrive, and its sizes and phases when it ends."""

    def __init__(self, metrics: ServerMetrics, model_name: str | None = None) -> None:
        self._metrics = metrics
        self._model = model_name
        self._start = time.monotonic()
        self._first_scheduled_time: float | None = None  # the engine's clock: time.monotonic() too
        self._first_token_time: float | None = None
        self._last_token_time: float | None = None
        self._params: SamplingParams | None = None
        self._is_done = False

    @property
    def first_token_time(self) -> float | None:
        """When the first token arrived (time.monotonic()); None before it."""
        return self._first_token_time

    def on_submit(self, params: SamplingParams) -> None:
        """The request's sampling parameters, for the max_tokens and n histograms at its end."""
        self._params = params

    def on_output(self, output: RequestOutput) -> None:
        now = time.monotonic()
        num_new_tokens = sum(len(sample.token_ids) for sample in output.outputs)
        scheduled = output.first_scheduled_time
        if scheduled is not None and (self._first_scheduled_time is None or scheduled < self._first_scheduled_time):
            self._first_scheduled_time = scheduled
        if num_new_tokens == 0:
            return
        metrics = self._metrics
        if self._last_token_time is None:
            self._first_token_time = now
            metrics.time_to_first_token.observe(now - self._start, self._model)
            if scheduled is not None and output.arrival_time:
                metrics.request_queue_time.observe(max(scheduled - output.arrival_time, 0.0), self._model)
        else:
            # One observation per step that brought tokens: a step brings one token per
            # sample, or several when speculative decoding accepted drafts (they all arrive together).
            metrics.inter_token_latency.observe(now - self._last_token_time, self._model)
        self._last_token_time = now

    def finish(self, finish_reason: str, tokens: TokenCounts) -> None:
        """The request was answered whole: observe its end-to-end latency, sizes and phases (once).
        tokens: the request's token counts (its Generation keeps them for its usage)."""
        if self._is_done:
            return
        self._is_done = True
        metrics = self._metrics
        metrics.e2e_request_latency.observe(time.monotonic() - self._start, self._model)
        metrics.request_success.inc(finish_reason, self._model)
        metrics.request_prompt_tokens.observe(tokens.num_prompt_tokens, self._model)
        metrics.request_generation_tokens.observe(tokens.num_generated_tokens, self._model)
        longest = max(tokens.generated_tokens.values(), default=0)
        metrics.request_max_num_generation_tokens.observe(longest, self._model)
        if self._params is not None:
            metrics.request_params_n.observe(self._params.n, self._model)
            if self._params.max_tokens is not None:
                metrics.request_params_max_tokens.observe(self._params.max_tokens, self._model)
        first, last = self._first_token_time, self._last_token_time
        if first is None or last is None:
            return
        metrics.request_decode_time.observe(last - first, self._model)
        if self._first_scheduled_time is not None:
            metrics.request_prefill_time.observe(max(first - self._first_scheduled_time, 0.0), self._model)
            metrics.request_inference_time.observe(max(last - self._first_scheduled_time, 0.0), self._model)
        if longest > 1:
            # Samples decode side by side, so the longest one paces the request.
            metrics.request_time_per_output_token.observe((last - first) / (longest - 1), self._model)
