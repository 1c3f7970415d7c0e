"""The engine's gauges and counters, read from its stats snapshot at scrape time (not at each step).

Each series goes out under the names server/metrics/names.py gives it. The prompt-token counters
count as EngineStats (engine/outputs.py) says: every prompt token of every request once, cached
ones included, and separately the part found in the prefix cache.

The speculative-decoding counters (vLLM's spec_decode_* names) are exported only while the engine
speculates (--speculative-method): EngineStats then carries one accepted count per draft position
(spec_accepted_per_position, as many as --num-speculative-tokens, zeros at first); without
speculation that tuple is empty and none of the four series appears, not even as zeros.

The prefix-cache series are private (`private_series_names`): they tell a client whether a prompt
someone else sent is cached, so /metrics shows them to admin keys only (server/http/access.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.outputs import EngineStats
from server.metrics.names import KVSERVE_LABELS, KVSERVE_PREFIX, Naming


def _prefix_cache_hit_rate(stats: EngineStats) -> float:
    return stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries else 0.0


def is_speculating(stats: EngineStats) -> bool:
    """Does the engine speculate? Its per-position counts exist (one per draft position) only then."""
    return bool(stats.spec_accepted_per_position)


@dataclass(frozen=True)
class _StatSeries:
    """One gauge or counter of the snapshot: its names (server/metrics/names.py) and its value."""

    is_counter: bool
    kvserve: str | None
    vllm: tuple[str, ...]
    doc: str
    value: Callable[[EngineStats], float]
    # None: always exported; else only when it holds for the snapshot (the speculative counters)
    exported_if: Callable[[EngineStats], bool] | None = None
    is_private: bool = False  # on admin keys' /metrics only

    def is_exported(self, stats: EngineStats) -> bool:
        return self.exported_if is None or self.exported_if(stats)


def _gauge(
    kvserve: str | None,
    vllm: tuple[str, ...],
    doc: str,
    value: Callable[[EngineStats], float],
    is_private: bool = False,
) -> _StatSeries:
    return _StatSeries(False, kvserve, vllm, doc, value, is_private=is_private)


def _counter(
    name: str, vllm: tuple[str, ...], doc: str, value: Callable[[EngineStats], float], is_private: bool = False
) -> _StatSeries:
    return _StatSeries(True, name, vllm, doc, value, is_private=is_private)


def _spec_counter(name: str, doc: str, value: Callable[[EngineStats], float]) -> _StatSeries:
    """A speculative-decoding counter: vLLM's name under both prefixes, exported only while speculating."""
    return _StatSeries(True, name, (name,), doc, value, exported_if=is_speculating)


ENGINE_SERIES = (
    _gauge(
        "num_requests_running", ("num_requests_running",), "Requests in the running batch.", lambda s: s.num_running
    ),
    _gauge("num_requests_waiting", ("num_requests_waiting",), "Requests not started yet.", lambda s: s.num_waiting),
    # vLLM renamed gpu_cache_usage_perc to kv_cache_usage_perc; routers and dashboards read either.
    _gauge(
        "kv_cache_usage_perc",
        ("kv_cache_usage_perc", "gpu_cache_usage_perc"),
        "Fraction of KV-cache blocks in use (0-1).",
        lambda s: s.kv_cache_usage,
    ),
    # An older vLLM gauge that routers still read; kvserve's own names leave the ratio to the query.
    _gauge(
        None,
        ("gpu_prefix_cache_hit_rate",),
        "Prefix-cache hits over queries since start.",
        _prefix_cache_hit_rate,
        is_private=True,
    ),
    _counter(
        "prefix_cache_queries",
        ("prefix_cache_queries", "gpu_prefix_cache_queries"),
        "Prompt tokens looked up in the prefix cache (each sample's, when it is first scheduled).",
        lambda s: s.prefix_cache_queries,
        is_private=True,
    ),
    _counter(
        "prefix_cache_hits",
        ("prefix_cache_hits", "gpu_prefix_cache_hits"),
        "Prompt tokens found in the prefix cache.",
        lambda s: s.prefix_cache_hits,
        is_private=True,
    ),
    _counter(
        "num_preemptions",
        ("num_preemptions",),
        "Sequences preempted for lack of KV blocks.",
        lambda s: s.num_preemptions,
    ),
    _counter(
        "prompt_tokens",
        ("prompt_tokens",),
        "Prompt tokens of every request, once each, cached ones included.",
        lambda s: s.num_prompt_tokens,
    ),
    _counter(
        "prompt_tokens_cached",
        ("prompt_tokens_cached",),
        "Prompt tokens found in the prefix cache when their request was first scheduled.",
        lambda s: s.num_cached_prompt_tokens,
        is_private=True,
    ),
    _counter("generation_tokens", ("generation_tokens",), "Tokens generated.", lambda s: s.num_generation_tokens),
    _counter(
        "greedy_bursts",
        (),
        "Greedy bursts: native calls that ran several decode steps of a batch (--greedy-burst).",
        lambda s: s.num_greedy_bursts,
    ),
    _counter(
        "greedy_burst_tokens",
        (),
        "Tokens generated in greedy bursts (part of generation_tokens).",
        lambda s: s.num_greedy_burst_tokens,
    ),
    _spec_counter(
        "spec_decode_num_drafts",
        "Speculative verifications: steps in which a sequence had at least one draft token checked.",
        lambda s: s.num_spec_drafts,
    ),
    _spec_counter(
        "spec_decode_num_draft_tokens",
        "Draft tokens proposed and verified.",
        lambda s: s.num_spec_draft_tokens,
    ),
    _spec_counter(
        "spec_decode_num_accepted_tokens",
        "Draft tokens the target model accepted.",
        lambda s: s.num_spec_accepted_tokens,
    ),
)
# Its one sample per draft position j (label `position`, from 0) counts the verifications that accepted
# draft token j+1; exported with the counters above.
SPEC_ACCEPTED_PER_POSITION = "spec_decode_num_accepted_tokens_per_pos"
# One token's KV bytes, labelled kv_cache_dtype (the format).
KV_BYTES_PER_TOKEN = "kv_cache_bytes_per_token"
# vLLM's split of prompt tokens by source: its local_cache_hit part is prompt_tokens_cached.
PROMPT_TOKENS_BY_SOURCE = "prompt_tokens_by_source"


def private_series_names(naming: Naming) -> frozenset[str]:
    """The full names (a counter's without `_total`) of the series only admin keys see."""
    names = {
        target.name
        for series in ENGINE_SERIES
        if series.is_private
        for target in naming.targets(series.kvserve, series.vllm)
    }
    names.update(target.name for target in naming.targets(None, (PROMPT_TOKENS_BY_SOURCE,)))
    return frozenset(names)


class EngineStatsCollector(Collector):
    """Gauges and counters straight from each loaded generation model's stats snapshot, at scrape time: the
    default model's under `naming`, every other one's under its own `model_name` label."""

    def __init__(
        self,
        naming: Naming,
        get_stats: Callable[[], EngineStats | None],
        more_stats: Callable[[], list[tuple[str, EngineStats]]] | None = None,
    ) -> None:
        self._naming = naming
        self._get_stats = get_stats
        self._more_stats = more_stats or (lambda: [])

    def collect(self) -> Iterator[Metric]:
        """Nothing while no model is loaded; then every series under every name it is exported under, one
        family per name with a sample per model."""
        stats = self._get_stats()
        models = [(self._naming, stats)] if stats is not None else []
        models += [(dataclasses.replace(self._naming, model_name=name), s) for name, s in self._more_stats()]
        families: dict[str, Metric] = {}

        def family(name: str, kind: type, doc: str, labels: tuple[str, ...]) -> Metric:
            if name not in families:
                families[name] = kind(name, doc, labels=labels)
            return families[name]

        for naming, model_stats in models:
            for series in ENGINE_SERIES:
                if not series.is_exported(model_stats):
                    continue
                value = series.value(model_stats)
                for target in naming.targets(series.kvserve, series.vllm):
                    kind = CounterMetricFamily if series.is_counter else GaugeMetricFamily
                    family(target.name, kind, series.doc, target.labelnames).add_metric(target.labelvalues, value)
            _prompt_tokens_by_source(family, naming, model_stats)
            _spec_accepted_per_position(family, naming, model_stats)
            _kv_bytes_per_token(family, naming, model_stats)
        yield from families.values()


def _kv_bytes_per_token(family: Callable[..., Metric], naming: Naming, stats: EngineStats) -> None:
    """What one token costs in the KV cache, labelled with the cache's format: vLLM has no such series, so
    always kvserve's name."""
    family(
        KVSERVE_PREFIX + KV_BYTES_PER_TOKEN,
        GaugeMetricFamily,
        "Bytes one token's keys and values take in the KV cache over every layer, in its format.",
        (*KVSERVE_LABELS, "kv_cache_dtype"),
    ).add_metric((naming.model_name, stats.kv_cache_dtype), stats.kv_bytes_per_token)


def _prompt_tokens_by_source(family: Callable[..., Metric], naming: Naming, stats: EngineStats) -> None:
    """vLLM's split of the prompt-token counter: computed here, or found in the local prefix cache."""
    for target in naming.targets(None, (PROMPT_TOKENS_BY_SOURCE,)):
        metric = family(
            target.name,
            CounterMetricFamily,
            "Prompt tokens by where their KV came from.",
            (*target.labelnames, "source"),
        )
        cached = stats.num_cached_prompt_tokens
        metric.add_metric((*target.labelvalues, "local_compute"), stats.num_prompt_tokens - cached)
        metric.add_metric((*target.labelvalues, "local_cache_hit"), cached)


def _spec_accepted_per_position(family: Callable[..., Metric], naming: Naming, stats: EngineStats) -> None:
    """Per draft position (0-based, as vLLM labels it): verifications whose draft token there was accepted."""
    if not is_speculating(stats):
        return
    for target in naming.targets(SPEC_ACCEPTED_PER_POSITION, (SPEC_ACCEPTED_PER_POSITION,)):
        metric = family(
            target.name,
            CounterMetricFamily,
            "Verifications that accepted the draft token at this position (0: the first draft token).",
            (*target.labelnames, "position"),
        )
        for position, count in enumerate(stats.spec_accepted_per_position):
            metric.add_metric((*target.labelvalues, str(position)), count)
