"""Every replica's engine gauges and counters on Ray's Prometheus endpoint, labelled by replica.

Behind Ray Serve, a scrape of the application's /metrics reaches one replica chosen by the router, so
it cannot see the others. Each KVServe replica therefore mirrors the series of server/metrics/engine.py
(the same values its own /metrics shows) into Ray's metrics, which every Ray node exports for all the
processes on it at its metrics export port (`kvserve serve --replicas` logs the address; on a Ray
cluster, the port Ray was started with). Ray prefixes each name with `ray_` and Serve adds the tags
`deployment`, `replica` and `application`: e.g. `ray_kvserve_prefix_cache_hits{replica="..."}`.
Sum over `replica` for the whole application. The labelled series (vLLM's prompt_tokens_by_source, the
speculative per-position counts) are not mirrored; the speculative counters are, once the engine speculates.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from ray.serve import metrics

from engine.outputs import EngineStats
from server.metrics.engine import ENGINE_SERIES

logger = logging.getLogger(__name__)

MIRROR_PERIOD_S = 1.0  # Ray exports on its own period (seconds); mirroring more often adds nothing
NAME_PREFIX = "kvserve_"


class MetricsMirror:
    """Copies the engine's stats snapshot into Ray Serve metrics every MIRROR_PERIOD_S."""

    def __init__(self, model_name: str, get_stats: Callable[[], EngineStats | None]) -> None:
        self._get_stats = get_stats
        self._series = []  # (series, its Ray name, its Ray metric)
        for series in ENGINE_SERIES:
            # vLLM-only series (no kvserve name) keep vLLM's name: the values are the same either way.
            name = NAME_PREFIX + (series.kvserve or series.vllm[0])
            kind = metrics.Counter if series.is_counter else metrics.Gauge
            metric = kind(name, description=series.doc, tag_keys=("model_name",))
            metric.set_default_tags({"model_name": model_name})
            self._series.append((series, name, metric))
        self._counted: dict[str, float] = {}  # counter name -> the value already added to Ray's counter

    def update(self) -> None:
        """One copy of the current snapshot (nothing while the model loads)."""
        stats = self._get_stats()
        if stats is None:
            return
        for series, name, metric in self._series:
            if not series.is_exported(stats):
                continue  # the speculative counters, on an engine that does not speculate
            value = float(series.value(stats))
            if not series.is_counter:
                metric.set(value)
                continue
            # Ray counters only count up: add what the engine counted since the last copy.
            delta = value - self._counted.get(name, 0.0)
            if delta > 0:
                metric.inc(delta)
                self._counted[name] = value

    async def run(self) -> None:
        """update() every MIRROR_PERIOD_S until cancelled; an error is logged, not raised (metrics are
        no reason to stop a replica)."""
        while True:
            try:
                self.update()
            except Exception:
                logger.exception("mirroring engine metrics into Ray failed")
            await asyncio.sleep(MIRROR_PERIOD_S)
