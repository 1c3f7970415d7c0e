"""What the load generator measures: per-request timings, the statistics over them, and the Markdown table."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from clients.bench.workload import Workload


@dataclass
class RequestRecord:
    """Timings of one streamed request, all in seconds from the benchmark's start."""

    start: float
    end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk that carried text
    output_tokens: int = 0
    prompt_tokens: int | None = None  # from the server's usage, when it reports it
    ok: bool = False
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def latency(self) -> float:
        return self.end - self.start


@dataclass
class BenchResult:
    """One workload against one server. Times in milliseconds, memory in MiB."""

    server: str
    model: str
    workload: dict[str, Any]
    num_requests: int
    num_failed: int
    duration_s: float
    total_prompt_tokens: int
    total_output_tokens: int
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    itl_p50_ms: float | None  # between chunks: a chunk may carry several tokens (a greedy burst, accepted drafts)
    itl_p99_ms: float | None
    output_tokens_per_s: float  # all output tokens over the wall time of the run
    output_tokens_per_s_per_request: float | None  # mean over requests of output_tokens / latency
    decode_tokens_per_s_per_request: float | None  # mean over requests of (tokens - 1) / (last - first chunk)
    requests_per_s: float
    tpot_p50_ms: float | None = None  # per request: (last chunk - first chunk) / (tokens - 1), the p50 over requests
    peak_memory_mib: float | None = None  # peak RSS of the server process tree sampled during the run
    peak_memory_hwm_mib: float | None = None  # kernel's VmHWM of the server process (since its start)
    errors: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# --------------------------------------------------------------------------- statistics


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolation percentile (numpy's default), q in [0, 100]; None for no values."""
    if not values:
        return None
    if not 0.0 <= q <= 100.0:
        raise ValueError("q must be in [0, 100]")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _ms(value: float | None) -> float | None:
    return None if value is None else value * 1000.0


def summarize(
    records: Sequence[RequestRecord],
    duration_s: float,
    *,
    server: str,
    model: str,
    workload: Workload,
    peak_memory_mib: float | None = None,
    peak_memory_hwm_mib: float | None = None,
) -> BenchResult:
    """Turn per-request timings into the reported statistics."""
    ok = [r for r in records if r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    # Inter-token latency: gaps between consecutive text chunks of the same request (a chunk may carry several
    # tokens); time per output token: each request's decode time over the tokens after its first.
    itls = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    per_request_tps = [r.output_tokens / r.latency for r in ok if r.latency > 0]
    decode_tps = [
        (r.output_tokens - 1) / (r.chunk_times[-1] - r.chunk_times[0])
        for r in ok
        if r.output_tokens > 1 and len(r.chunk_times) > 1 and r.chunk_times[-1] > r.chunk_times[0]
    ]
    total_out = sum(r.output_tokens for r in ok)
    tpots = [1 / tps for tps in decode_tps]
    return BenchResult(
        server=server,
        model=model,
        workload=asdict(workload),
        num_requests=len(records),
        num_failed=len(records) - len(ok),
        duration_s=duration_s,
        total_prompt_tokens=sum(r.prompt_tokens or 0 for r in ok),
        total_output_tokens=total_out,
        ttft_p50_ms=_ms(percentile(ttfts, 50)),
        ttft_p99_ms=_ms(percentile(ttfts, 99)),
        itl_p50_ms=_ms(percentile(itls, 50)),
        itl_p99_ms=_ms(percentile(itls, 99)),
        output_tokens_per_s=total_out / duration_s if duration_s > 0 else 0.0,
        output_tokens_per_s_per_request=statistics.fmean(per_request_tps) if per_request_tps else None,
        decode_tokens_per_s_per_request=statistics.fmean(decode_tps) if decode_tps else None,
        requests_per_s=len(ok) / duration_s if duration_s > 0 else 0.0,
        tpot_p50_ms=_ms(percentile(tpots, 50)),
        peak_memory_mib=peak_memory_mib,
        peak_memory_hwm_mib=peak_memory_hwm_mib,
        errors=sorted({r.error for r in records if r.error})[:10],
    )


# --------------------------------------------------------------------------- reporting

_COLUMNS: tuple[tuple[str, str, str], ...] = (
    # (header, BenchResult attribute, format)
    ("requests", "num_requests", "{:d}"),
    ("failed", "num_failed", "{:d}"),
    ("TTFT p50 (ms)", "ttft_p50_ms", "{:.1f}"),
    ("TTFT p99 (ms)", "ttft_p99_ms", "{:.1f}"),
    ("ITL p50 (ms)", "itl_p50_ms", "{:.2f}"),
    ("ITL p99 (ms)", "itl_p99_ms", "{:.2f}"),
    ("TPOT p50 (ms)", "tpot_p50_ms", "{:.2f}"),
    ("output tok/s", "output_tokens_per_s", "{:.1f}"),
    ("tok/s per request", "output_tokens_per_s_per_request", "{:.1f}"),
    ("req/s", "requests_per_s", "{:.3f}"),
    ("peak mem (MiB)", "peak_memory_mib", "{:.0f}"),
)


def format_value(value: Any, fmt: str) -> str:
    if value is None:
        return "—"
    return fmt.format(value)


def markdown_table(results: Sequence[BenchResult]) -> str:
    """One row per result: server, workload and the reported statistics."""
    headers = ["server", "workload", *(h for h, _, _ in _COLUMNS)]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
    for r in results:
        cells = [r.server, str(r.workload.get("name", "")), *(format_value(getattr(r, a), f) for _, a, f in _COLUMNS)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_results(results: Sequence[BenchResult], json_path: Path | None, markdown_path: Path | None) -> None:
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps([r.to_dict() for r in results], indent=2) + "\n")
    if markdown_path is not None:
        markdown_path.parent.mkdir(parents=True, exist_ok=True)
        markdown_path.write_text(markdown_table(results) + "\n")
