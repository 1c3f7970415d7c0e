"""Does any kind of load starve the others? Latency probes under load, each as a ratio to the same probe idle.

Two probes, each run idle first and then under load, against one server in one run:

- `/health` latency (a liveness probe), sampled every 10 ms from a separate process (so the load's
  own client work cannot delay it): idle, while 8 clients each tokenize a 2 MB text, and while
  32 streams generate.
- Generation inter-token latency (one stream, gaps between its SSE chunks): idle, and while an
  embedding flood runs (many one-input clients plus clients sending 64-input batches). The flood's
  429s are counted: a bounded queue must push back rather than queue without limit.

Usage: python -m clients.bench.fairness [--base-url URL] [-- SERVE FLAGS]
Without --base-url it starts `python -m server serve SERVE FLAGS` on a free port and stops it at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
from tqdm import tqdm

from clients.bench.processes import kvserve_server, split_serve_args
from clients.bench.results import percentile
from clients.bench.workload import WORDS
from clients.logging_setup import configure_logging
from clients.sse import SSEDecoder, is_done

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Probe:
    """Latencies (ms) of one probe in one condition."""

    name: str
    condition: str
    values_ms: list[float]
    note: str = ""

    def mean(self) -> float:
        return sum(self.values_ms) / len(self.values_ms) if self.values_ms else float("nan")

    def stat(self, q: float) -> float:
        value = percentile(self.values_ms, q)
        return float("nan") if value is None else value


async def _health_window(base_url: str, load: Callable[[], Awaitable[str]]) -> Probe:
    """/health latencies sampled from a child process for exactly as long as `load()` runs."""
    context = multiprocessing.get_context("spawn")
    results: multiprocessing.Queue = context.Queue()
    stop_file = Path(tempfile.mkstemp(prefix="kvserve-probe-")[1])
    prober = context.Process(target=_windowed_prober, args=(base_url, str(stop_file), results), daemon=True)
    prober.start()
    await asyncio.to_thread(results.get, True, 60.0)  # the child is up and has sampled once
    start = time.monotonic()
    note = await load()
    end = time.monotonic()
    stop_file.unlink()
    samples = await asyncio.to_thread(results.get, True, 60.0)
    prober.join(5)
    # CLOCK_MONOTONIC is one clock for every process on the machine: keep the samples sent in the window.
    return Probe("/health", "", [ms for sent, ms in samples if start <= sent <= end], note)


def _windowed_prober(base_url: str, stop_file: str, results: multiprocessing.Queue) -> None:
    """GET /health every 10 ms until stop_file disappears; puts "ready" after the first, then every
    (time sent, latency ms)."""
    samples = []
    with httpx.Client(base_url=base_url, timeout=60.0) as client:
        client.get("/health")
        results.put("ready")
        while os.path.exists(stop_file):
            sent = time.monotonic()
            start = time.perf_counter()
            client.get("/health")
            samples.append((sent, (time.perf_counter() - start) * 1000))
            time.sleep(0.01)
    results.put(samples)


async def _idle(seconds: float) -> str:
    await asyncio.sleep(seconds)
    return ""


async def _tokenize_load(client: httpx.AsyncClient, num_clients: int, num_chars: int) -> str:
    text = (" ".join(WORDS) + " ") * (num_chars // (len(" ".join(WORDS)) + 1) + 1)
    text = text[:num_chars]

    async def one() -> int:
        response = await client.post("/tokenize", json={"prompt": text}, timeout=300.0)
        response.raise_for_status()
        return int(response.json()["count"])

    counts = await asyncio.gather(*(one() for _ in range(num_clients)))
    return f"{num_clients} x {num_chars / 1e6:.1f} MB -> {counts[0]} tokens each"


async def _stream_tokens(client: httpx.AsyncClient, model: str, max_tokens: int) -> list[float]:
    """One streamed completion; the arrival time (s) of each chunk carrying text."""
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    arrivals = []
    decoder = SSEDecoder()
    async with client.stream("POST", "/v1/completions", json=body, timeout=300.0) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            data = decoder.feed(line)
            if data is not None and not is_done(data):
                arrivals.append(time.perf_counter())
    return arrivals


async def _streams_load(client: httpx.AsyncClient, model: str, num_streams: int, max_tokens: int) -> str:
    await asyncio.gather(*(_stream_tokens(client, model, max_tokens) for _ in range(num_streams)))
    return f"{num_streams} streams x {max_tokens} tokens"


def _stream_gaps_child(base_url: str, model: str, max_tokens: int, results: multiprocessing.Queue) -> None:
    """In a child process (its loop busy with nothing else): one stream's inter-token gaps, in ms."""

    async def main() -> list[float]:
        async with httpx.AsyncClient(base_url=base_url, timeout=300.0) as client:
            return _gaps_ms(await _stream_tokens(client, model, max_tokens))

    results.put(asyncio.run(main()))


async def _stream_gaps(base_url: str, model: str, max_tokens: int) -> list[float]:
    """One stream's inter-token gaps (ms), read by a child process so the load's client work cannot delay it."""
    context = multiprocessing.get_context("spawn")
    results: multiprocessing.Queue = context.Queue()
    child = context.Process(target=_stream_gaps_child, args=(base_url, model, max_tokens, results), daemon=True)
    child.start()
    gaps = await asyncio.to_thread(results.get, True, 600.0)
    child.join(5)
    return gaps


def _gaps_ms(arrivals: Sequence[float]) -> list[float]:
    return [(b - a) * 1000 for a, b in zip(arrivals[1:], arrivals[2:], strict=False)]  # from the 2nd token


async def _embedding_flood(
    client: httpx.AsyncClient,
    model: str,
    stop: asyncio.Event,
    num_single: int,
    num_batch: int,
    served: list[tuple[float, int]],
) -> dict[str, int]:
    """Embedding requests until `stop`; appends (time answered, inputs) of each 200 to `served`."""
    statuses: dict[str, int] = {}

    async def one(inputs: list[str]) -> None:
        while not stop.is_set():
            try:
                response = await client.post("/v1/embeddings", json={"model": model, "input": inputs}, timeout=300.0)
            except httpx.TransportError:  # e.g. a pooled connection the server closed as it was reused
                statuses["transport error"] = statuses.get("transport error", 0) + 1
                continue
            statuses[str(response.status_code)] = statuses.get(str(response.status_code), 0) + 1
            if response.status_code == 200:
                served.append((time.monotonic(), len(inputs)))
            if response.status_code == 429:
                await asyncio.sleep(0.05)

    sentence = " ".join(WORDS[:40])
    await asyncio.gather(
        *(one([f"{i} {sentence}"]) for i in range(num_single)),
        *(one([f"{i} {j} {sentence}" for j in range(64)]) for i in range(num_batch)),
    )
    return statuses


async def run(base_url: str, args: argparse.Namespace) -> list[Probe]:
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=300.0) as client:
        cards = (await client.get("/v1/models")).json()["data"]
        model = next(c["id"] for c in cards if c.get("task", "generate") == "generate")
        embedding_model = next((c["id"] for c in cards if c.get("task") == "embed"), None)
        probes = []
        num_probes = (0 if args.skip_health else 3) + (2 if embedding_model else 0)
        steps = tqdm(total=num_probes, desc="probes", unit="probe")

        if not args.skip_health:
            probe = await _health_window(base_url, lambda: _idle(args.idle_seconds))
            probes.append(Probe("/health", "idle", probe.values_ms))
            steps.update()
            tokenizing = _tokenize_load(client, args.tokenize_clients, args.tokenize_chars)
            probe = await _health_window(base_url, lambda: tokenizing)
            probes.append(Probe("/health", "tokenize", probe.values_ms, probe.note))
            steps.update()
            streaming = _streams_load(client, model, args.streams, args.max_tokens)
            probe = await _health_window(base_url, lambda: streaming)
            probes.append(Probe("/health", "streams", probe.values_ms, probe.note))
            steps.update()

        if embedding_model:
            await _stream_tokens(client, model, 8)  # warm-up
            idle_gaps = await _stream_gaps(base_url, model, args.itl_tokens)
            probes.append(Probe("generation ITL", "idle", idle_gaps))
            steps.update()
            stop = asyncio.Event()
            served: list[tuple[float, int]] = []
            flood = asyncio.create_task(
                _embedding_flood(client, embedding_model, stop, args.embed_clients, args.embed_batch_clients, served)
            )
            await asyncio.sleep(2.0)  # the flood fills the queue first
            start = time.monotonic()
            loaded_gaps = await _stream_gaps(base_url, model, args.itl_tokens)
            window = time.monotonic() - start
            stop.set()
            statuses = await flood
            inputs = sum(n for t, n in served if t >= start)
            note = (
                f"{args.embed_clients} one-input + {args.embed_batch_clients} 64-input clients; statuses {statuses}; "
                f"{inputs / window:.0f} inputs/s embedded while the stream ran"
            )
            probes.append(Probe("generation ITL", "embedding flood", loaded_gaps, note))
            steps.update()
        steps.close()
    return probes


def format_table(probes: Sequence[Probe]) -> str:
    idle = {p.name: p for p in probes if p.condition == "idle"}
    lines = [
        "| probe | condition | n | mean ms | p50 ms | p99 ms | max ms | mean / idle | p50 / idle | p99 / idle | load |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for p in probes:
        base = idle.get(p.name)
        ratio_mean = p.mean() / base.mean() if base else float("nan")
        ratio50 = p.stat(50) / base.stat(50) if base else float("nan")
        ratio99 = p.stat(99) / base.stat(99) if base else float("nan")
        lines.append(
            f"| {p.name} | {p.condition} | {len(p.values_ms)} | {p.mean():.1f} | {p.stat(50):.1f} | {p.stat(99):.1f} | "
            f"{max(p.values_ms, default=float('nan')):.1f} | {ratio_mean:.2f}x | {ratio50:.2f}x | {ratio99:.2f}x | "
            f"{p.note} |"
        )
    return "\n".join(lines)


def _parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[str]]:
    argv, serve_args = split_serve_args(argv)
    parser = argparse.ArgumentParser(
        prog="python -m clients.bench.fairness",
        description=__doc__.split("\n\n")[0],
        epilog="Flags after `--` go to the `kvserve serve` it starts (without --base-url).",
    )
    parser.add_argument("--base-url", help="probe this running server instead of starting one")
    parser.add_argument("--skip-health", action="store_true", help="only the generation ITL probes")
    parser.add_argument("--idle-seconds", type=float, default=3.0, help="length of the idle /health window")
    parser.add_argument("--tokenize-clients", type=int, default=8)
    parser.add_argument("--tokenize-chars", type=int, default=2_000_000, help="characters each client tokenizes")
    parser.add_argument("--streams", type=int, default=32, help="concurrent streams in the /health probe")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per stream")
    parser.add_argument("--itl-tokens", type=int, default=256, help="tokens of the stream whose gaps are timed")
    parser.add_argument("--embed-clients", type=int, default=300, help="clients sending one-input embeddings")
    parser.add_argument("--embed-batch-clients", type=int, default=4, help="clients sending 64-input embeddings")
    return parser.parse_args(argv), serve_args


def main(argv: Sequence[str] | None = None) -> int:
    configure_logging()
    args, serve_args = _parse_args(argv)
    if args.base_url:
        probes = asyncio.run(run(args.base_url, args))
    else:
        with kvserve_server(serve_args, "kvserve-fairness-") as (base_url, _):
            probes = asyncio.run(run(base_url, args))
    print(format_table(probes), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
