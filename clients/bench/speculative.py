"""Speculative decoding benchmark: each setup's server with speculation on, against the same server with
every request opting out (`"speculative": false`), in one run.

Workloads (`kvserve bench` tasks, greedy, EOS ignored):
- rewrite, 1 stream and 8 streams: "Rewrite the following text, correcting the spelling" over seeded
  ~300-token passages with misspelled words, 256 output tokens: the answer copies its input;
- chat, 1 stream: free-form questions, 128 output tokens: nothing to copy.

For every kvserve setup it starts `kvserve serve` with that setup's flags, then runs each workload four
times: every request opting out, speculating, speculating, opting out (tokens/s pooled per side), and
reads the server's spec_decode counters around them: acceptance = accepted / draft tokens, and tokens
kept per verification = accepted / drafts. With `--llamacpp` (and llama.cpp's server built, see
scripts/build_llama_cpp.sh) it runs llama.cpp's server on the same GGUF without and with its own
prompt-lookup speculation (`--spec-type ngram-simple`) on the rewrite workloads and reports that ratio too.

Usage: python -m clients.bench.speculative [--quick] [--only SETUP,...] [--llamacpp] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import re
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from clients.bench.load import run_benchmark
from clients.bench.processes import (
    ensure_llama_server,
    free_port,
    kvserve_server,
    llama_server_command,
    resolve_gguf,
    server_process,
)
from clients.bench.results import BenchResult
from clients.bench.workload import Workload
from clients.logging_setup import configure_logging

logger = logging.getLogger(__name__)

MODEL = "smollm2-135m-instruct"
# (key, description, `kvserve serve` flags). The default model is a Q4_1 GGUF: `auto` quantization runs its
# blocks natively (compute-bound matrix products on a CPU), `none` runs it dequantized to float32
# (memory-bound: a forward over a few more positions costs little more than over one).
SETUPS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    (
        "ngram-gguf",
        "ngram, k=3, Q4_1 blocks (the default quantization)",
        ("--speculative-method", "ngram"),
    ),
    (
        "ngram-f32",
        "ngram, k=4, float32",
        ("--quantization", "none", "--speculative-method", "ngram", "--num-speculative-tokens", "4"),
    ),
    (
        "draft-q4",
        "draft = the same model in its Q4_1 blocks, k=3, float32 target",
        (
            "--quantization",
            "none",
            "--speculative-method",
            "draft",
            "--draft-model",
            MODEL,
            "--draft-quantization",
            "gguf",
        ),
    ),
)
_COUNTER = re.compile(r"^kvserve:(spec_decode_num_(?:drafts|draft_tokens|accepted_tokens))(?:_total)?\{[^}]*\} (\S+)$")


def workloads(quick: bool) -> list[Workload]:
    """rewrite at 1 and 8 streams, chat at 1 stream; --quick sends fewer requests."""
    rewrite = Workload(
        name="rewrite, 1 stream",
        task="rewrite",
        num_requests=2 if quick else 4,
        concurrency=1,
        prompt_len=300,
        output_len=256,
        seed=11,
    )
    return [
        rewrite,
        dataclasses.replace(rewrite, name="rewrite, 8 streams", num_requests=8 if quick else 16, concurrency=8),
        Workload(
            name="chat, 1 stream",
            task="chat",
            num_requests=2 if quick else 4,
            concurrency=1,
            prompt_len=1,
            output_len=128,
            seed=12,
        ),
    ]


@dataclass
class Comparison:
    """One workload on one server: without and with speculation."""

    setup: str
    workload: str
    off_tokens_per_s: float
    on_tokens_per_s: float
    acceptance: float | None  # accepted / draft tokens over the speculating pass (None: no counters)
    accepted_per_draft: float | None  # accepted tokens per verification
    off: BenchResult  # the first pass of each side
    on: BenchResult

    @property
    def ratio(self) -> float:
        return self.on_tokens_per_s / self.off_tokens_per_s if self.off_tokens_per_s else 0.0


def spec_counters(base_url: str) -> dict[str, float]:
    """The kvserve:spec_decode_* counters from /metrics (empty when the server does not speculate)."""
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    counters: dict[str, float] = {}
    for line in text.splitlines():
        match = _COUNTER.match(line)
        if match:
            counters[match.group(1)] = float(match.group(2))
    return counters


def _acceptance(before: dict[str, float], after: dict[str, float]) -> tuple[float | None, float | None]:
    if not after:
        return None, None
    drafts = after["spec_decode_num_drafts"] - before.get("spec_decode_num_drafts", 0.0)
    draft_tokens = after["spec_decode_num_draft_tokens"] - before.get("spec_decode_num_draft_tokens", 0.0)
    accepted = after["spec_decode_num_accepted_tokens"] - before.get("spec_decode_num_accepted_tokens", 0.0)
    return (accepted / draft_tokens if draft_tokens else None), (accepted / drafts if drafts else None)


def _pooled(results: Sequence[BenchResult]) -> float:
    """Output tokens/s over several passes: all their tokens over all their time."""
    duration = sum(r.duration_s for r in results)
    return sum(r.total_output_tokens for r in results) / duration if duration else 0.0


# Setups that skip the 8-stream workload: a float32 target with a draft model runs it for many minutes.
ONE_STREAM_ONLY = ("draft-q4",)


def bench_kvserve(key: str, serve_args: Sequence[str], loads: list[Workload], progress: bool) -> list[Comparison]:
    """One server with speculation on. Each workload runs four passes, opted out / speculating /
    speculating / opted out, so a drift of the machine's speed over the run weighs on both sides alike."""
    flags = ["--model", MODEL, "--embedding-model", "", *serve_args]
    comparisons = []
    with kvserve_server(flags, f"kvserve-spec-{key}-") as (base_url, pid):
        for workload in loads:
            passes: dict[bool, list[BenchResult]] = {False: [], True: []}
            before = spec_counters(base_url)
            for speculative in (False, True, True, False):
                label = f"{key} {'on' if speculative else 'off'}"
                load = workload if speculative else dataclasses.replace(workload, speculative=False)
                result = asyncio.run(
                    run_benchmark(base_url, MODEL, load, server_label=label, server_pid=pid, progress=progress)
                )
                passes[speculative].append(result)
            # Opted-out requests add nothing to the counters: the difference is the speculating passes'.
            acceptance, per_draft = _acceptance(before, spec_counters(base_url))
            off, on = passes[False], passes[True]
            comparisons.append(
                Comparison(key, workload.name, _pooled(off), _pooled(on), acceptance, per_draft, off[0], on[0])
            )
            logger.info("%s / %s: %.2fx", key, workload.name, comparisons[-1].ratio)
    return comparisons


def bench_llamacpp(loads: list[Workload], progress: bool) -> list[Comparison]:
    """llama.cpp's server on the same GGUF, without and with `--spec-type ngram-simple` (two servers)."""
    binary = ensure_llama_server()
    if binary is None:
        return []
    gguf = resolve_gguf(MODEL)
    results: dict[str, list[BenchResult]] = {}
    logs = Path(tempfile.mkdtemp(prefix="llamacpp-spec-"))
    for label, extra in (("off", []), ("on", ["--spec-type", "ngram-simple"])):
        port = free_port()
        cmd = [*llama_server_command(binary, gguf, port, parallel=8), *extra]
        with server_process(cmd, port, logs / f"{label}.log") as proc:
            results[label] = [
                asyncio.run(
                    run_benchmark(
                        f"http://127.0.0.1:{port}",
                        MODEL,
                        w,
                        server_label=f"llama.cpp {label}",
                        server_pid=proc.pid,
                        progress=progress,
                    )
                )
                for w in loads
            ]
    return [
        Comparison(
            "llama.cpp ngram-simple", w.name, off.output_tokens_per_s, on.output_tokens_per_s, None, None, off, on
        )
        for w, off, on in zip(loads, results["off"], results["on"])
    ]


def _fmt(value: float | None, pattern: str) -> str:
    return "—" if value is None else pattern.format(value)


def comparison_table(comparisons: Sequence[Comparison]) -> str:
    header = "| setup | workload | off tok/s | on tok/s | on / off | acceptance | kept per verification |"
    lines = [header, "|---|---|---:|---:|---:|---:|---:|"]
    for c in comparisons:
        lines.append(
            f"| {c.setup} | {c.workload} | {c.off_tokens_per_s:.1f} | {c.on_tokens_per_s:.1f} | {c.ratio:.2f}x | "
            f"{_fmt(c.acceptance, '{:.0%}')} | {_fmt(c.accepted_per_draft, '{:.2f}')} |"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m clients.bench.speculative",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    keys = [key for key, _, _ in SETUPS]
    parser.add_argument("--only", default=",".join(keys), help=f"kvserve setups to run, from {','.join(keys)}")
    parser.add_argument("--llamacpp", action="store_true", help="also run llama.cpp's server without and with ngram")
    parser.add_argument("--quick", action="store_true", help="fewer requests per workload")
    parser.add_argument("--workloads", default="", help="comma-separated workload names to keep (default: all)")
    parser.add_argument("--json", type=Path, default=None, help="write every result here")
    parser.add_argument("--no-progress", action="store_true")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    configure_logging(os.environ.get("KVSERVE_LOG_LEVEL", "info").upper())
    args = parse_args(argv)
    loads = workloads(args.quick)
    if args.workloads:
        wanted = {name.strip() for name in args.workloads.split(",")}
        loads = [w for w in loads if w.name in wanted]
    chosen = [s for s in SETUPS if s[0] in set(args.only.split(","))]
    comparisons: list[Comparison] = []
    for key, description, serve_args in chosen:
        logger.info("setup %s: %s", key, description)
        setup_loads = [w for w in loads if w.concurrency == 1] if key in ONE_STREAM_ONLY else loads
        comparisons.extend(bench_kvserve(key, serve_args, setup_loads, not args.no_progress))
    if args.llamacpp:
        comparisons.extend(bench_llamacpp([w for w in loads if w.task == "rewrite"], not args.no_progress))
    print(comparison_table(comparisons))
    print()
    for key, description, serve_args in chosen:
        print(f"- {key}: {description} (`kvserve serve --model {MODEL} {' '.join(serve_args)}`)")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        rows = [{**dataclasses.asdict(c), "ratio": c.ratio} for c in comparisons]
        args.json.write_text(json.dumps(rows, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
