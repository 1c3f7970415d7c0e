"""`make soak`: a bounded mixed workload against a kvserve server, then a check for what it leaked.

The workload, seeded: completions and chat, streamed and not, some with n > 1, embeddings (when the server
serves an embedding model), some clients abandoning their stream after the first event (the connection
closed), some malformed requests. Bounded by a request count and a wall-clock limit. Afterwards it reads
/metrics and /health: KV blocks in use and running/waiting requests must return to 0, no answer may be a
5xx, every stream read to its end must end with `[DONE]`; the server's RSS is sampled over the run (psutil)
and its slope after the first quarter (warm-up) reported. It prints a table and exits 1 on a leak, a 5xx
or a failed request.

Usage: python -m clients.bench.soak [--requests N] [--duration S] [--base-url URL --server-pid PID] [-- SERVE FLAGS]
Without --base-url it starts `python -m server serve SERVE FLAGS` on a free port and stops it at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import logging
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from clients.bench.processes import kvserve_server, split_serve_args
from clients.bench.soak_plan import SoakPlan, SoakRequest, build_plan
from clients.logging_setup import configure_logging
from clients.sse import SSEDecoder, is_done

logger = logging.getLogger(__name__)

MIB = 1024 * 1024
# `--long`: enough requests that a leak of a few KiB per request shows above the allocator's noise.
LONG_SOAK_REQUESTS = 10_000
LONG_SOAK_S = 2 * 3600.0


@dataclass
class SoakOutcome:
    kind: str
    status: int | None = None  # None: no HTTP answer (transport error)
    abandoned: bool = False
    saw_done: bool = False
    error: str | None = None

    @property
    def is_stream(self) -> bool:
        return self.kind.endswith("_stream")


@dataclass
class SoakReport:
    requests: int
    not_sent: int  # planned requests the time limit stopped
    abandoned: int
    status_2xx: int
    status_4xx: int
    status_5xx: int
    transport_errors: int
    failures: list[str]  # requests that did not get the answer they should have
    leaks: list[str]  # what was still held once the load had stopped
    rss_start_mib: float | None
    rss_end_mib: float | None
    rss_slope_mib_per_min: float | None
    duration_s: float
    # MiB of RSS per 1,000 requests answered, after warm-up: the number that says whether a long run leaks.
    rss_slope_mib_per_1k_requests: float | None = None
    gauges_after: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.failures and not self.leaks and self.status_5xx == 0 and self.transport_errors == 0


async def _send(client: httpx.AsyncClient, request: SoakRequest) -> SoakOutcome:
    outcome = SoakOutcome(request.kind)
    if isinstance(request.body, str):
        kwargs = {"content": request.body, "headers": {"Content-Type": "application/json"}}
    else:
        kwargs = {"json": request.body}
    try:
        async with client.stream("POST", request.path, **kwargs) as response:
            outcome.status = response.status_code
            if not request.kind.endswith("_stream") or response.status_code != 200:
                await response.aread()
                if response.status_code >= 300 and request.kind != "malformed":
                    outcome.error = f"HTTP {response.status_code}: {response.text[:200]}"
                return outcome
            decoder = SSEDecoder()
            async for line in response.aiter_lines():
                payload = decoder.feed(line)
                if payload is None:
                    continue
                if request.abandon:
                    outcome.abandoned = True
                    return outcome  # leaving the block closes the connection mid-stream
                if is_done(payload):
                    outcome.saw_done = True
                elif '"error"' in payload and json.loads(payload).get("error"):
                    outcome.error = f"SSE error event: {payload[:200]}"
    except httpx.HTTPError as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
    return outcome


def _judge(outcome: SoakOutcome) -> str | None:
    """Why this outcome is wrong, or None."""
    if outcome.status is None:
        return f"{outcome.kind}: no answer ({outcome.error})"
    if outcome.kind == "malformed":
        return None if 400 <= outcome.status < 500 else f"malformed request answered {outcome.status}"
    if outcome.error:
        return f"{outcome.kind}: {outcome.error}"
    if outcome.is_stream and not outcome.abandoned and not outcome.saw_done:
        return f"{outcome.kind}: stream ended without [DONE]"
    return None


class RssSampler:
    """The RSS of one process, sampled in a thread: (seconds since start, bytes) pairs."""

    def __init__(self, pid: int | None, interval_s: float = 0.5) -> None:
        self.pid = pid
        self.interval_s = interval_s
        self.samples: list[tuple[float, int]] = []
        self.start = time.monotonic()  # what the samples' seconds count from
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rss-sampler", daemon=True)

    def _loop(self) -> None:
        import psutil

        process = psutil.Process(self.pid)
        while not self._stop.is_set():
            try:
                self.samples.append((time.monotonic() - self.start, process.memory_info().rss))
            except psutil.Error:
                return
            self._stop.wait(self.interval_s)

    def __enter__(self) -> RssSampler:  # noqa: PYI034 - keeps Python 3.10 working
        self.start = time.monotonic()
        if self.pid is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)


def rss_slope(samples: Sequence[tuple[float, int]]) -> float | None:
    """Least-squares slope of RSS over time, in MiB per minute (None under 2 samples)."""
    slope = _slope([t for t, _ in samples], [rss / MIB for _, rss in samples])
    return None if slope is None else 60.0 * slope


def rss_slope_per_requests(samples: Sequence[tuple[float, int]], done_at: Sequence[float]) -> float | None:
    """Least-squares slope of RSS over the count of requests answered, in MiB per 1,000 requests.

    samples: (seconds, RSS bytes); done_at: when each request was answered, on the same clock. Unlike
    a slope over time, this one does not change with how fast the machine served the run."""
    finished = sorted(done_at)
    counts = [float(bisect.bisect_right(finished, t)) for t, _ in samples]
    slope = _slope(counts, [rss / MIB for _, rss in samples])
    return None if slope is None else 1000.0 * slope


def _slope(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    if len(xs) < 2:
        return None
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    if spread == 0:
        return None
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / spread


def parse_gauges(metrics_text: str) -> dict[str, float]:
    """`name -> value` for every unlabelled or single-model sample of a Prometheus text exposition."""
    values: dict[str, float] = {}
    for line in metrics_text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_part, _, value = line.rpartition(" ")
        name = name_part.split("{", 1)[0]
        try:
            values[name] = values.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return values


LEAK_GAUGES = ("kvserve:num_requests_running", "kvserve:num_requests_waiting", "kvserve:kv_cache_usage_perc")


async def _settle(client: httpx.AsyncClient, timeout_s: float) -> tuple[dict[str, float], list[str]]:
    """Wait until the engine holds nothing; returns the last gauges and what is still held after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        leaks = []
        gauges = parse_gauges((await client.get("/metrics")).text)
        for name in LEAK_GAUGES:
            if name not in gauges:
                leaks.append(f"{name} missing from /metrics")
            elif gauges[name] != 0:
                leaks.append(f"{name} = {gauges[name]:g} after the load stopped")
        health = await client.get("/health")
        if health.status_code != 200:
            leaks.append(f"/health answered {health.status_code}")
        if not leaks or time.monotonic() >= deadline:
            return gauges, leaks
        await asyncio.sleep(0.2)


async def _discover_models(client: httpx.AsyncClient) -> tuple[str, str | None]:
    """The generation model and the embedding model (None when not served), from /v1/models."""
    cards = (await client.get("/v1/models")).json()["data"]
    generation = next(c["id"] for c in cards if c.get("task", "generate") == "generate")
    embedding = next((c["id"] for c in cards if c.get("task") == "embed"), None)
    return generation, embedding


async def run_soak(
    base_url: str,
    plan: SoakPlan,
    *,
    server_pid: int | None = None,
    api_key: str | None = None,
    settle_s: float = 15.0,
    progress: bool = True,
) -> SoakReport:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=plan.concurrency + 2)
    timeout = httpx.Timeout(120.0, connect=10.0)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout, limits=limits) as client:
        model, embedding_model = await _discover_models(client)
        requests = build_plan(plan, model, embedding_model)
        outcomes: list[SoakOutcome] = []
        queue: asyncio.Queue[SoakRequest] = asyncio.Queue()
        for request in requests:
            queue.put_nowait(request)
        start = time.monotonic()
        stop_at = start + plan.duration_s
        done_at: list[float] = []  # seconds on the RSS sampler's clock

        async def worker() -> None:
            while not queue.empty() and time.monotonic() < stop_at:
                outcomes.append(await _send(client, queue.get_nowait()))
                done_at.append(time.monotonic() - sampler.start)
                if progress and len(outcomes) % 50 == 0:
                    logger.info("%d / %d requests", len(outcomes), len(requests))

        with RssSampler(server_pid) as sampler:
            await asyncio.gather(*(worker() for _ in range(plan.concurrency)))
            duration = time.monotonic() - start
            gauges, leaks = await _settle(client, settle_s)
    if not queue.empty():
        logger.warning("time limit reached: %d planned requests not sent", queue.qsize())
    failures = [reason for outcome in outcomes if (reason := _judge(outcome))]
    statuses = [o.status for o in outcomes if o.status is not None]
    samples = sampler.samples
    return SoakReport(
        requests=len(outcomes),
        not_sent=queue.qsize(),
        abandoned=sum(o.abandoned for o in outcomes),
        status_2xx=sum(200 <= s < 300 for s in statuses),
        status_4xx=sum(400 <= s < 500 for s in statuses),
        status_5xx=sum(s >= 500 for s in statuses),
        transport_errors=sum(o.status is None for o in outcomes),
        failures=failures,
        leaks=leaks,
        rss_start_mib=samples[0][1] / MIB if samples else None,
        rss_end_mib=samples[-1][1] / MIB if samples else None,
        # The first quarter is warm-up (allocator pools, first batches of each shape), not a leak.
        rss_slope_mib_per_min=rss_slope(samples[len(samples) // 4 :]),
        duration_s=duration,
        rss_slope_mib_per_1k_requests=rss_slope_per_requests(samples[len(samples) // 4 :], done_at),
        gauges_after={name: gauges.get(name, float("nan")) for name in LEAK_GAUGES},
    )


def format_report(report: SoakReport) -> str:
    def mib(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.1f}"

    rows = [
        ("requests", str(report.requests)),
        ("not sent (time limit)", str(report.not_sent)),
        ("duration (s)", f"{report.duration_s:.1f}"),
        ("abandoned streams", str(report.abandoned)),
        ("2xx / 4xx / 5xx", f"{report.status_2xx} / {report.status_4xx} / {report.status_5xx}"),
        ("no answer", str(report.transport_errors)),
        ("failed requests", str(len(report.failures))),
        ("leaks", str(len(report.leaks))),
        ("RSS start / end (MiB)", f"{mib(report.rss_start_mib)} / {mib(report.rss_end_mib)}"),
        (
            "RSS slope (MiB/min)",
            "n/a" if report.rss_slope_mib_per_min is None else f"{report.rss_slope_mib_per_min:+.2f}",
        ),
        (
            "RSS slope (MiB per 1,000 requests)",
            "n/a" if report.rss_slope_mib_per_1k_requests is None else f"{report.rss_slope_mib_per_1k_requests:+.2f}",
        ),
    ]
    lines = ["| soak | |", "| --- | --- |", *(f"| {name} | {value} |" for name, value in rows)]
    lines += [f"failure: {reason}" for reason in report.failures[:20]]
    lines += [f"leak: {reason}" for reason in report.leaks]
    lines.append("result: " + ("OK" if report.ok else "FAILED"))
    return "\n".join(lines)


def _parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[str]]:
    argv, serve_args = split_serve_args(argv)
    defaults = SoakPlan()
    parser = argparse.ArgumentParser(
        prog="python -m clients.bench.soak",
        description=__doc__.split("\n\n")[0],
        epilog="Flags after `--` go to the `kvserve serve` it starts (without --base-url).",
    )
    parser.add_argument(
        "--long",
        action="store_true",
        help=f"the long soak: {LONG_SOAK_REQUESTS} requests within {LONG_SOAK_S / 3600:g} h "
        "(--requests and --duration given too win), for the RSS slope per 1,000 requests",
    )
    parser.add_argument("--base-url", help="soak this running server instead of starting one")
    parser.add_argument("--server-pid", type=int, help="with --base-url: the server's pid, for its RSS")
    parser.add_argument("--api-key", help="bearer token, when the server needs one")
    parser.add_argument("--requests", type=int, help=f"requests planned (default {defaults.num_requests})")
    parser.add_argument("--concurrency", type=int, default=defaults.concurrency, help="requests in flight")
    parser.add_argument(
        "--duration", type=float, help=f"stop sending after S seconds (default {defaults.duration_s:g})"
    )
    parser.add_argument(
        "--abandon-fraction",
        type=float,
        default=defaults.abandon_fraction,
        help="of the streams: closed after their first event",
    )
    parser.add_argument(
        "--malformed-fraction", type=float, default=defaults.malformed_fraction, help="of all requests: must get a 4xx"
    )
    parser.add_argument("--max-tokens", type=int, default=defaults.max_tokens, help="most tokens per sample")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--settle", type=float, default=15.0, help="seconds the server gets to release everything")
    parser.add_argument("--json", type=Path, help="also write the report here as JSON")
    args = parser.parse_args(argv)
    if args.requests is None:
        args.requests = LONG_SOAK_REQUESTS if args.long else defaults.num_requests
    if args.duration is None:
        args.duration = LONG_SOAK_S if args.long else defaults.duration_s
    return args, serve_args


def main(argv: Sequence[str] | None = None) -> int:
    configure_logging()
    args, serve_args = _parse_args(argv)
    plan = SoakPlan(
        num_requests=args.requests,
        concurrency=args.concurrency,
        duration_s=args.duration,
        abandon_fraction=args.abandon_fraction,
        malformed_fraction=args.malformed_fraction,
        max_tokens=args.max_tokens,
        seed=args.seed,
    )
    soak_kwargs = {"api_key": args.api_key, "settle_s": args.settle}
    if args.base_url:
        report = asyncio.run(run_soak(args.base_url, plan, server_pid=args.server_pid, **soak_kwargs))
    else:
        with kvserve_server(serve_args, "kvserve-soak-") as (base_url, pid):
            report = asyncio.run(run_soak(base_url, plan, server_pid=pid, **soak_kwargs))
    print(format_report(report), flush=True)
    if args.json:
        args.json.write_text(json.dumps(asdict(report), indent=2))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
