"""`kvserve bench`: a streaming load generator for any OpenAI-compatible completions server.

It drives kvserve, llama.cpp's `llama-server` or vLLM with the same workload: N requests with C in flight,
prompts of a given token length built from a seeded word list (sized with the server's own `/tokenize`, so
every server sees the same token counts), a given number of output tokens with EOS ignored. It measures
time to first token, inter-token latency, output tokens/s and the server's peak memory, and writes JSON
plus a Markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from clients.bench.memory import MemorySampler
from clients.bench.results import BenchResult, RequestRecord, markdown_table, summarize, write_results
from clients.bench.server_api import TokenCounter, completion_body, root_url, stream_one
from clients.bench.workload import STRUCTURED_SCHEMA, TASKS, WORDS, RequestSpec, Workload, build_requests
from clients.logging_setup import configure_logging

logger = logging.getLogger(__name__)


async def run_benchmark(
    base_url: str,
    model: str,
    workload: Workload,
    *,
    server_label: str = "server",
    server_pid: int | None = None,
    progress: bool = True,
    timeout_s: float = 600.0,
) -> BenchResult:
    """Run `workload` against the OpenAI-compatible server at `base_url` (with or without /v1)."""
    tokenizer = TokenCounter(base_url, model)
    try:
        has_tokenize = await asyncio.to_thread(tokenizer.available)
        if not has_tokenize:
            logger.warning("%s has no /tokenize: prompt lengths are estimated from word counts", base_url)
        count = tokenizer.count if has_tokenize else None
        specs = await asyncio.to_thread(build_requests, workload, count)
    finally:
        tokenizer.close()

    limits = httpx.Limits(max_connections=workload.concurrency + 2, max_keepalive_connections=workload.concurrency + 2)
    async with httpx.AsyncClient(base_url=root_url(base_url), timeout=timeout_s, limits=limits) as client:
        # Warm-up: first-request costs (lazy init, allocation) are not part of steady-state serving.
        if workload.warmup_requests:
            warm_spec = RequestSpec(prompt=" ".join(WORDS[:16]), prompt_tokens=-1, max_tokens=4)
            for _ in range(workload.warmup_requests):
                rec = await stream_one(client, completion_body(model, warm_spec, workload), time.perf_counter())
                if not rec.ok:
                    raise RuntimeError(f"warm-up request to {base_url} failed: {rec.error}")

        queue: asyncio.Queue[RequestSpec] = asyncio.Queue()
        for spec in specs:
            queue.put_nowait(spec)
        records: list[RequestRecord] = []
        bar = _progress_bar(len(specs), f"{server_label}/{workload.name}", progress)

        async def worker(t0: float) -> None:
            while True:
                try:
                    spec = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                records.append(await stream_one(client, completion_body(model, spec, workload), t0))
                if bar is not None:
                    bar.update(1)

        load_before = os.getloadavg()[0]
        with MemorySampler(server_pid) as sampler:
            t0 = time.perf_counter()
            await asyncio.gather(*(worker(t0) for _ in range(min(workload.concurrency, len(specs)))))
            duration = time.perf_counter() - t0
        if bar is not None:
            bar.close()

    load_after = os.getloadavg()[0]
    result = summarize(
        records,
        duration,
        server=server_label,
        model=model,
        workload=workload,
        peak_memory_mib=sampler.peak_rss_mib,
        peak_memory_hwm_mib=sampler.vm_hwm_mib(),
    )
    sized = [s.prompt_tokens for s in specs if s.prompt_tokens >= 0]
    result.extra["prompt_tokens_by_tokenize_mean"] = statistics.fmean(sized) if sized else None
    # Other processes on the machine skew every number: keep the 1-minute load average next to them.
    result.extra["load_avg_1m"] = {"before": load_before, "after": load_after}
    if result.num_failed:
        logger.warning("%d of %d requests failed: %s", result.num_failed, result.num_requests, result.errors)
    return result


def _progress_bar(total: int, desc: str, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", leave=False)


# --------------------------------------------------------------------------- command line


def _length_range(text: str) -> tuple[int, int | None]:
    """'110' -> (110, None); '80-140' -> (80, 140): uniform draw per request."""
    if "-" in text:
        lo, hi = text.split("-", 1)
        return int(lo), int(hi)
    return int(text), None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (or .../v1)")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="model name sent in each request")
    parser.add_argument("--server-label", default="server", help="name of the server in the report")
    parser.add_argument("--num-requests", "-n", type=int, default=16)
    parser.add_argument("--concurrency", "-c", type=int, default=1, help="requests in flight")
    parser.add_argument("--prompt-len", default="110", help="prompt tokens: N, or LO-HI drawn per request")
    parser.add_argument("--output-len", default="128", help="output tokens: N, or LO-HI drawn per request")
    parser.add_argument("--no-ignore-eos", action="store_true", help="let the model stop at EOS")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=1, help="warm-up requests before timing")
    parser.add_argument(
        "--json-schema",
        nargs="?",
        const=STRUCTURED_SCHEMA,
        default=None,
        help="every output must match this JSON schema (JSON text; without a value: an object holding one "
        "free string, so outputs can run to --output-len)",
    )
    parser.add_argument(
        "--task",
        choices=TASKS,
        default="words",
        help="words: completion prompts of seeded words; rewrite: chat requests to correct the spelling of a "
        "seeded ~--prompt-len-token passage (the answer copies its input); chat: free-form chat questions",
    )
    parser.add_argument(
        "--no-speculative", action="store_true", help="ask each request to opt out of speculative decoding"
    )
    parser.add_argument("--server-pid", type=int, default=None, help="server PID for peak-memory sampling")
    parser.add_argument("--json", type=Path, default=None, help="write the result as JSON here")
    parser.add_argument("--markdown", type=Path, default=None, help="write the Markdown table here")
    parser.add_argument("--no-progress", action="store_true")


def workload_from_args(args: argparse.Namespace) -> Workload:
    prompt_len, prompt_max = _length_range(args.prompt_len)
    output_len, output_max = _length_range(args.output_len)
    return Workload(
        name=f"n{args.num_requests}-c{args.concurrency}-p{args.prompt_len}-o{args.output_len}"
        + ("-json" if args.json_schema else "")
        + (f"-{args.task}" if args.task != "words" else "")
        + ("-nospec" if args.no_speculative else ""),
        num_requests=args.num_requests,
        concurrency=args.concurrency,
        prompt_len=prompt_len,
        prompt_len_max=prompt_max,
        output_len=output_len,
        output_len_max=output_max,
        ignore_eos=not args.no_ignore_eos,
        temperature=args.temperature,
        seed=args.seed,
        warmup_requests=args.warmup,
        json_schema=args.json_schema,
        task=args.task,
        speculative=False if args.no_speculative else None,
    )


def run(args: argparse.Namespace) -> int:
    try:
        workload = workload_from_args(args)
    except ValueError as exc:
        logger.error("bad workload: %s", exc)
        return 2
    try:
        result = asyncio.run(
            run_benchmark(
                args.base_url,
                args.model,
                workload,
                server_label=args.server_label,
                server_pid=args.server_pid,
                progress=not args.no_progress,
            )
        )
    except (httpx.HTTPError, RuntimeError) as exc:
        logger.error("benchmark failed: %s", exc)
        return 1
    print(markdown_table([result]))
    write_results([result], args.json, args.markdown)
    return 0 if result.num_failed == 0 else 1


def main(argv: Sequence[str] | None = None) -> int:
    configure_logging(os.environ.get("KVSERVE_LOG_LEVEL", "info").upper())
    parser = argparse.ArgumentParser(prog="kvserve bench", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
