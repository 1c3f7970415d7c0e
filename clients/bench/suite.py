"""`make bench`: kvserve, llama.cpp's llama-server and transformers on the same GGUF, same workloads, one run
(or `--rounds N`: kvserve and llama.cpp N times each, taking turns, each metric's median reported).

Each server is started as a subprocess on this machine, driven by the load generator (`clients.bench`), and
stopped before the next one starts (they never compete for the CPU). The transformers baseline
(`engine.bench.hf_baseline`) and the machine's physical limits for the model (`engine.bench.machine_limits`,
reported first) run as subprocesses too, their results read back as JSON. Results: a side-by-side Markdown
table with ratios on stdout and in bench-results/ (JSON + Markdown + server logs).

Usage: python -m clients.bench.suite [--only kvserve,llamacpp,transformers,limits] [--quick] [--workloads a,b,c,d]
                                     [--rounds N] [--isa native|avx2] [-- FLAGS FOR KVSERVE SERVE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from clients.bench.load import run_benchmark
from clients.bench.processes import (
    ISAS,
    KVSERVE_ISA_ENV,
    ROOT,
    ensure_llama_server,
    free_port,
    kvserve_command,
    llama_server_command,
    python_env,
    resolve_gguf,
    run_json_program,
    server_process,
    split_serve_args,
)
from clients.bench.results import BenchResult, RequestRecord, format_value, markdown_table, summarize
from clients.bench.workload import Workload, build_requests, draw_lengths
from clients.logging_setup import configure_logging

logger = logging.getLogger(__name__)

SYSTEMS = ("kvserve", "llamacpp", "transformers", "limits")


# --------------------------------------------------------------------------- workloads


@dataclass(frozen=True)
class SuiteWorkload:
    key: str
    workload: Workload
    hf_requests: int  # requests for the (slow, sequential) transformers baseline; 0 = not run there


def suite_workloads(quick: bool) -> list[SuiteWorkload]:
    """One stream, 32 streams (same lengths), TTFT of a 512-token prompt, and 8 streams (for larger models)."""
    return [
        SuiteWorkload(
            "a",
            Workload(
                name="1 stream, p110 o128",
                num_requests=3 if quick else 8,
                concurrency=1,
                prompt_len=110,
                output_len=128,
                seed=1,
            ),
            1 if quick else 3,
        ),
        SuiteWorkload(
            "b",
            Workload(
                name="32 streams, p110 o128",
                num_requests=32 if quick else 64,
                concurrency=32,
                prompt_len=110,
                output_len=128,
                seed=2,
            ),
            0,
        ),
        SuiteWorkload(
            "c",
            Workload(
                name="1 stream, p512 o8 (TTFT)",
                num_requests=2 if quick else 4,
                concurrency=1,
                prompt_len=512,
                output_len=8,
                seed=3,
            ),
            1 if quick else 2,
        ),
        SuiteWorkload(
            "d",
            Workload(
                name="8 streams, p110 o128",
                num_requests=8 if quick else 16,
                concurrency=8,
                prompt_len=110,
                output_len=128,
                seed=4,
            ),
            0,
        ),
    ]


# --------------------------------------------------------------------------- running


def bench_server(
    label: str,
    cmd: list[str],
    port: int,
    model: str,
    workloads: list[SuiteWorkload],
    out_dir: Path,
    progress: bool,
    env: dict[str, str] | None = None,
) -> list[BenchResult]:
    """Each workload against the server `cmd` starts; `env`: variables added to its environment."""
    results = []
    with server_process(cmd, port, out_dir / "logs" / f"{label}.log", env={**python_env(), **(env or {})}) as proc:
        for sw in workloads:
            logger.info("%s: workload %s (%s)", label, sw.key, sw.workload.name)
            result = asyncio.run(
                run_benchmark(
                    f"http://127.0.0.1:{port}",
                    model,
                    sw.workload,
                    server_label=label,
                    server_pid=proc.pid,
                    progress=progress,
                )
            )
            result.extra["command"] = " ".join([*(f"{k}={v}" for k, v in (env or {}).items()), *cmd])
            result.extra["workload_key"] = sw.key
            results.append(result)
            print(markdown_table([result]), flush=True)
    return results


def baseline_requests(workload: Workload) -> list[dict[str, Any]]:
    """The workload's seeded prompts for the transformers baseline, which cuts each to its token count.

    Without a tokenizer here each prompt is its target length in words; a word is at least one token.
    """
    specs = build_requests(workload, None)
    return [
        {"prompt": spec.prompt, "prompt_tokens": prompt_len, "max_tokens": spec.max_tokens}
        for spec, (prompt_len, _) in zip(specs, draw_lengths(workload))
    ]


def baseline_result(run: dict[str, Any], workload: Workload, model: str, peak_memory_mib: float | None) -> BenchResult:
    """A BenchResult from `engine.bench.hf_baseline --json` output."""
    records = [
        RequestRecord(
            start=r["start"],
            end=r["end"],
            chunk_times=list(r["token_times"]),
            output_tokens=r["output_tokens"],
            prompt_tokens=r["prompt_tokens"],
            ok=True,
        )
        for r in run["requests"]
    ]
    result = summarize(
        records,
        run["duration_s"],
        server="transformers",
        model=model,
        workload=workload,
        peak_memory_mib=peak_memory_mib,
        peak_memory_hwm_mib=run.get("peak_rss_mib"),
    )
    result.extra["note"] = "sequential, float32, in one process with the model; memory includes the model load"
    result.extra["torch_threads"] = run["torch_threads"]
    return result


def bench_transformers(
    gguf: Path, model: str, workloads: list[SuiteWorkload], out_dir: Path, progress: bool
) -> list[BenchResult]:
    results = []
    for sw in workloads:
        if sw.hf_requests == 0:
            continue
        wl = replace(sw.workload, num_requests=sw.hf_requests, concurrency=1)
        logger.info("transformers: workload %s (%s), %d requests", sw.key, wl.name, wl.num_requests)
        requests_path = out_dir / f"transformers-requests-{sw.key}.json"
        requests_path.write_text(json.dumps(baseline_requests(wl), indent=2) + "\n")
        args = ["--gguf", str(gguf), "--requests", str(requests_path), "--warmup", str(wl.warmup_requests), "--json"]
        if not progress:
            args.append("--no-progress")
        run, peak_mib = run_json_program("engine.bench.hf_baseline", args, sample_memory=True)
        result = baseline_result(run, wl, model, peak_mib)
        result.extra["workload_key"] = sw.key
        results.append(result)
        print(markdown_table([result]), flush=True)
    return results


# --------------------------------------------------------------------------- side-by-side report

# (label, attribute, format, True when higher is better)
_METRICS: tuple[tuple[str, str, str, bool], ...] = (
    ("output tok/s (total)", "output_tokens_per_s", "{:.1f}", True),
    ("output tok/s per request", "output_tokens_per_s_per_request", "{:.1f}", True),
    ("TTFT p50 (ms)", "ttft_p50_ms", "{:.0f}", False),
    ("TTFT p99 (ms)", "ttft_p99_ms", "{:.0f}", False),
    ("ITL p50 (ms)", "itl_p50_ms", "{:.2f}", False),
    ("ITL p99 (ms)", "itl_p99_ms", "{:.2f}", False),
    ("time per output token p50 (ms)", "tpot_p50_ms", "{:.2f}", False),
    ("requests/s", "requests_per_s", "{:.3f}", True),
    ("peak memory (MiB)", "peak_memory_mib", "{:.0f}", False),
    ("requests (failed)", "num_requests", "{:d}", True),
)


def median_of_rounds(results: Sequence[BenchResult]) -> list[BenchResult]:
    """One result per (server, workload): each metric's median over the rounds that ran it (the servers take turns
    round by round, so a slow minute of a shared machine falls on one round of each rather than on one server);
    request counts are summed, and `extra["rounds"]` keeps each round's output tok/s in round order."""
    grouped: dict[tuple[str, Any], list[BenchResult]] = {}
    for result in results:
        grouped.setdefault((result.server, result.extra.get("workload_key")), []).append(result)
    merged = []
    for rounds in grouped.values():
        if len(rounds) == 1:
            merged.append(rounds[0])
            continue
        medians = {}
        for _, attr, _, _ in _METRICS:
            if attr == "num_requests":  # summed below
                continue
            values = [getattr(r, attr) for r in rounds if getattr(r, attr) is not None]
            medians[attr] = statistics.median(values) if values else None
        merged.append(
            replace(
                rounds[0],
                **medians,
                num_requests=sum(r.num_requests for r in rounds),
                num_failed=sum(r.num_failed for r in rounds),
                extra={**rounds[0].extra, "rounds": [r.output_tokens_per_s for r in rounds]},
            )
        )
    return merged


def _round_ratios(kvserve: BenchResult | None, other: BenchResult | None) -> str | None:
    """Round by round, kvserve's output tok/s over the other server's (each pair ran minutes apart)."""
    if kvserve is None or other is None or "rounds" not in kvserve.extra or "rounds" not in other.extra:
        return None
    return ", ".join(_ratio(a, b) for a, b in zip(kvserve.extra["rounds"], other.extra["rounds"]))


def _ratio(a: Any, b: Any) -> str:
    if a is None or b is None or not b:
        return "—"
    return f"{a / b:.2f}×"


def comparison_table(results: Sequence[BenchResult], workloads: Sequence[SuiteWorkload]) -> str:
    """Per workload: one row per metric, one column per system, then kvserve/llama.cpp and kvserve/transformers."""
    systems = [s for s in ("kvserve", "llamacpp", "transformers") if any(r.server == s for r in results)]
    ratio_cols = [s for s in ("llamacpp", "transformers") if "kvserve" in systems and s in systems]
    out = []
    for sw in workloads:
        by_system = {r.server: r for r in results if r.extra.get("workload_key") == sw.key}
        if not by_system:
            continue
        wl = sw.workload
        out.append(
            f"### ({sw.key}) {wl.name}: {wl.concurrency} in flight (transformers: 1), prompt {wl.prompt_len} "
            f"tokens, {wl.output_len} output tokens, EOS ignored; request counts in the last row"
        )
        out.append("")
        headers = ["metric", *systems, *(f"kvserve / {s}" for s in ratio_cols)]
        out.append("| " + " | ".join(headers) + " |")
        out.append("|" + "|".join(" --- " for _ in headers) + "|")
        for label, attr, fmt, higher_better in _METRICS:
            cells = [f"{label} {'↑' if higher_better else '↓'}"]
            for s in systems:
                r = by_system.get(s)
                if r is None:
                    cells.append("—")
                elif attr == "num_requests":
                    cells.append(f"{r.num_requests} ({r.num_failed})")
                else:
                    cells.append(format_value(getattr(r, attr), fmt))
            if attr != "num_requests":
                kv = by_system.get("kvserve")
                for s in ratio_cols:
                    other = by_system.get(s)
                    cells.append(_ratio(getattr(kv, attr) if kv else None, getattr(other, attr) if other else None))
            else:
                cells.extend("" for _ in ratio_cols)
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
        for s in ratio_cols:
            per_round = _round_ratios(by_system.get("kvserve"), by_system.get(s))
            if per_round:
                rounds = len(by_system["kvserve"].extra["rounds"])
                out.append(f"Medians of {rounds} rounds; kvserve / {s} output tok/s by round: {per_round}")
                out.append("")
    return "\n".join(out)


# --------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m clients.bench.suite", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    parser.add_argument(
        "--workloads", default="a,b,c", help="comma-separated subset of a,b,c,d (d: 8 streams, for larger models)"
    )
    parser.add_argument("--quick", action="store_true", help="fewer requests per workload")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run kvserve and llama.cpp this many times, taking turns; report each metric's median and the "
        "ratio round by round (for a machine whose speed drifts between minutes)",
    )
    parser.add_argument(
        "--isa",
        choices=ISAS,
        default="native",
        help="instruction sets both servers use: native (all this CPU has) or avx2 (an AVX2-only CPU's: kvserve's "
        "AVX2 kernels with torch capped at AVX2, and llama.cpp's AVX2 build, made if missing)",
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--gguf", type=Path, default=None, help="GGUF for llama.cpp and transformers")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "bench-results")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    args.only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(args.only) - set(SYSTEMS)
    if unknown:
        parser.error(f"unknown systems: {sorted(unknown)}")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    configure_logging()
    argv, serve_args = split_serve_args(argv)
    args = parse_args(argv)
    keys = {k.strip() for k in args.workloads.split(",")}
    workloads = [sw for sw in suite_workloads(args.quick) if sw.key in keys]
    progress = not args.no_progress
    out_dir: Path = args.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)

    gguf = args.gguf or resolve_gguf(args.model)
    report: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "model": args.model,
        "gguf": str(gguf),
        "cpu_count": os.cpu_count(),
        "isa": args.isa,
        "skipped": {},
    }
    results: list[BenchResult] = []
    limits_md = ""

    if "limits" in args.only:
        logger.info("measuring machine limits")
        try:
            limits, _ = run_json_program("engine.bench.machine_limits", ["--gguf", str(gguf), "--json"])
        except RuntimeError as exc:
            logger.error("machine limits failed: %s", exc)
            report["skipped"]["limits"] = str(exc)
        else:
            report["machine_limits"] = limits
            limits_md = limits["markdown"]
            print(limits_md, flush=True)

    binary = ensure_llama_server(args.isa) if "llamacpp" in args.only else None
    if "llamacpp" in args.only and binary is None:
        report["skipped"]["llamacpp"] = "llama-server not built (cmake missing or build failed)"
    servers = []
    if "kvserve" in args.only:
        servers.append(
            ("kvserve", lambda port: kvserve_command(args.model, port, serve_args), KVSERVE_ISA_ENV[args.isa])
        )
    if binary is not None:
        servers.append(("llamacpp", lambda port: llama_server_command(binary, gguf, port), {}))
    for round_index in range(args.rounds):
        for label, command, env in servers:
            if label in report["skipped"]:
                continue
            if args.rounds > 1:
                logger.info("round %d of %d: %s", round_index + 1, args.rounds, label)
            port = free_port()
            try:
                results += bench_server(label, command(port), port, args.model, workloads, out_dir, progress, env)
            except RuntimeError as exc:
                logger.error("%s run failed: %s", label, exc)
                report["skipped"][label] = str(exc)[:2000]

    if "transformers" in args.only:
        try:
            results += bench_transformers(gguf, args.model, workloads, out_dir, progress)
        except RuntimeError as exc:
            logger.error("transformers run failed: %s", exc)
            report["skipped"]["transformers"] = str(exc)

    table = comparison_table(median_of_rounds(results), workloads)
    markdown = "\n".join(
        part
        for part in (
            f"## kvserve benchmark ({report['started']}, {os.cpu_count()} CPUs, model {args.model}"
            + (f", instruction sets held to {args.isa}" if args.isa != "native" else "")
            + ")",
            table,
            "### Machine limits for this model" if limits_md else "",
            limits_md,
            "### Commands",
            "\n".join(
                f"- {r.server}: `{r.extra['command']}`"
                for r in results
                if "command" in r.extra and r.extra.get("workload_key") == workloads[0].key
            ),
        )
        if part
    )
    print("\n" + markdown, flush=True)
    report["results"] = [r.to_dict() for r in results]
    (out_dir / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    (out_dir / "results.md").write_text(markdown + "\n")
    logger.info("wrote %s and %s", out_dir / "results.json", out_dir / "results.md")
    failed = any(r.num_failed for r in results)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
