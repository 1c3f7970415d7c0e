"""Scale-out benchmark: `kvserve serve --replicas N` (Ray Serve) with 1 and 2 replicas, and with prefix-affine
and least-loaded routing, on one fixed chat workload whose requests share a few long system prompts.

For each setup it starts the server as a subprocess on a free local port, sends a warm-up, then the workload
(streamed chat completions, C in flight), and stops the server with SIGTERM. It reports requests/s, the
median time to first token, how many requests each replica answered (the X-KVServe-Replica header), and
the prefix-cache hit rate over the workload: prompt tokens found in the prefix cache over prompt tokens
looked up, from each replica's own /metrics (kvserve:prefix_cache_hits / kvserve:prefix_cache_queries,
scraped through the Serve address until every replica has answered, before and after the workload).

Usage: python -m clients.bench.replicas [--requests 48] [--concurrency 4] [--system-prompts 8]
                                        [--max-tokens 16] [-- FLAGS FOR KVSERVE SERVE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from clients.bench.processes import free_port, split_serve_args
from clients.bench.workload import WORDS
from clients.logging_setup import configure_logging

logger = logging.getLogger(__name__)

REPLICA_HEADER = "x-kvserve-replica"
# (label, replicas, routing)
SETUPS = (
    ("1 replica", 1, "prefix"),
    ("2 replicas, least-loaded", 2, "least-loaded"),
    ("2 replicas, prefix-affine", 2, "prefix"),
)
SYSTEM_PROMPT_WORDS = 220  # about 250 tokens: what a cached prefix saves is worth measuring
START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Result:
    label: str
    replicas: int
    routing: str
    requests_per_s: float
    ttft_p50_ms: float
    hit_rate: float
    per_replica: tuple[int, ...]


def workload(num_requests: int, num_system_prompts: int, seed: int = 0) -> list[list[dict]]:
    """The chat messages of every request: each has one of `num_system_prompts` system prompts (in a
    seeded random order) and a question of its own."""
    rng = random.Random(seed)
    prompts = [
        f"You are assistant number {k}. " + " ".join(rng.choice(WORDS) for _ in range(SYSTEM_PROMPT_WORDS))
        for k in range(num_system_prompts)
    ]
    order = [i % num_system_prompts for i in range(num_requests)]
    rng.shuffle(order)
    return [
        [
            {"role": "system", "content": prompts[k]},
            {"role": "user", "content": f"Question {i}: what about the {rng.choice(WORDS)} {rng.choice(WORDS)}?"},
        ]
        for i, k in enumerate(order)
    ]


@contextlib.contextmanager
def serving(replicas: int, routing: str, extra: Sequence[str], log_path: Path) -> Iterator[str]:
    """`kvserve serve --replicas N` on a free local port, until SIGTERM at the end; yields its base URL."""
    port = free_port()
    command = [sys.executable, "-m", "server", "serve", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--replicas", str(replicas), "--replica-routing", routing, "--embedding-model", "none", *extra]
    with open(log_path, "wb") as log:
        # Its own session: a Ctrl-C here reaches this program only, which then stops the server properly.
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        base_url = f"http://127.0.0.1:{port}"
        try:
            _wait_ready(base_url, process, log_path)
            yield base_url
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                logger.error("the server did not stop within %.0f s: killing its process group", STOP_TIMEOUT_S)
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def _wait_ready(base_url: str, process: subprocess.Popen, log_path: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}:\n{log_path.read_text()[-3000:]}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.25)
    raise TimeoutError(f"the server was not ready within {START_TIMEOUT_S:.0f} s; its log: {log_path}")


def prefix_cache_counters(base_url: str, replicas: int) -> tuple[float, float]:
    """(hits, queries) summed over every replica, each replica's from its own /metrics."""
    found: dict[str, tuple[float, float]] = {}
    for _ in range(200):
        response = httpx.get(f"{base_url}/metrics", timeout=10)
        found[response.headers[REPLICA_HEADER]] = (
            _counter(response.text, "kvserve:prefix_cache_hits_total"),
            _counter(response.text, "kvserve:prefix_cache_queries_total"),
        )
        if len(found) == replicas:
            break
    if len(found) != replicas:
        raise RuntimeError(f"/metrics reached {len(found)} of {replicas} replicas")
    return sum(hits for hits, _ in found.values()), sum(queries for _, queries in found.values())


def _counter(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


async def run_workload(
    base_url: str, requests: list[list[dict]], concurrency: int, max_tokens: int
) -> tuple[float, list[float], Counter]:
    """(wall seconds, each request's time to first token, requests answered per replica)."""
    semaphore = asyncio.Semaphore(concurrency)
    ttfts: list[float] = []
    per_replica: Counter = Counter()

    async def one(client: httpx.AsyncClient, messages: list[dict]) -> None:
        body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
        async with semaphore:
            start = time.monotonic()
            async with client.stream("POST", f"{base_url}/v1/chat/completions", json=body) as response:
                response.raise_for_status()
                per_replica[response.headers[REPLICA_HEADER]] += 1
                first = None
                async for line in response.aiter_lines():
                    if first is None and line.startswith("data: "):
                        first = time.monotonic() - start
                if first is not None:
                    ttfts.append(first)

    async with httpx.AsyncClient(timeout=600) as client:
        start = time.monotonic()
        await asyncio.gather(*(one(client, messages) for messages in requests))
        return time.monotonic() - start, ttfts, per_replica


def bench_setup(
    label: str, replicas: int, routing: str, args: argparse.Namespace, extra: Sequence[str], log_dir: Path
) -> Result:
    requests = workload(args.requests, args.system_prompts)
    warmup = [[{"role": "user", "content": f"Warm-up {i}: say hello."}] for i in range(2 * replicas)]
    log_path = log_dir / f"{label.replace(' ', '_').replace(',', '')}.log"
    logger.info("%s: starting the server (log: %s)", label, log_path)
    with serving(replicas, routing, extra, log_path) as base_url:
        asyncio.run(run_workload(base_url, warmup, concurrency=replicas, max_tokens=4))
        hits_before, queries_before = prefix_cache_counters(base_url, replicas)
        wall, ttfts, per_replica = asyncio.run(run_workload(base_url, requests, args.concurrency, args.max_tokens))
        hits_after, queries_after = prefix_cache_counters(base_url, replicas)
    queries = queries_after - queries_before
    return Result(
        label=label,
        replicas=replicas,
        routing=routing,
        requests_per_s=len(requests) / wall,
        ttft_p50_ms=statistics.median(ttfts) * 1000,
        hit_rate=(hits_after - hits_before) / queries if queries else 0.0,
        per_replica=tuple(sorted(per_replica.values(), reverse=True)),
    )


def markdown(results: Sequence[Result]) -> str:
    lines = [
        "| setup | requests/s | TTFT p50 (ms) | prefix-cache hit rate | requests per replica |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    for r in results:
        split = " / ".join(str(n) for n in r.per_replica)
        lines.append(f"| {r.label} | {r.requests_per_s:.2f} | {r.ttft_p50_ms:.0f} | {r.hit_rate:.1%} | {split} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv, extra = split_serve_args(argv)
    parser = argparse.ArgumentParser(prog="python -m clients.bench.replicas", description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=48, help="requests in the workload")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight at once")
    parser.add_argument("--system-prompts", type=int, default=8, help="distinct system prompts the requests share")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens generated per request")
    parser.add_argument("--only", default="", help="comma-separated setup numbers to run (1-3; default: all)")
    args = parser.parse_args(argv)
    configure_logging()
    chosen = {int(n) for n in args.only.split(",") if n} or set(range(1, len(SETUPS) + 1))
    log_dir = Path(tempfile.mkdtemp(prefix="kvserve-bench-replicas-"))  # kept: the servers' logs
    results = []
    for number, (label, replicas, routing) in enumerate(SETUPS, start=1):
        if number in chosen:
            results.append(bench_setup(label, replicas, routing, args, extra, log_dir))
    print(
        f"\n{args.requests} streamed chat requests, {args.concurrency} in flight, {args.system_prompts} shared "
        f"system prompts of ~{SYSTEM_PROMPT_WORDS} words, {args.max_tokens} output tokens; "
        f"{os.cpu_count()} CPU cores shared by all replicas; server logs in {log_dir}\n"
    )
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
