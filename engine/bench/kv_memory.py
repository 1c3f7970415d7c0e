"""KV cache memory of one long sequence: kvserve's per-group block tables against every layer full and
against llama.cpp's server, on the same GGUF file.

    python -m engine.bench.kv_memory FILE.gguf [--contexts 4096,8192] [--llama-server BIN] [--json]

kvserve: one sequence runs through the engine (max_model_len = the largest context) to each context length,
and the blocks it holds then (`pool.num_used_blocks`) times the bytes of a block are its KV bytes; the peak
over its steps is reported too (a sliding group holds one prefill chunk past its window while it prefills).
The every-layer-full figure is the same model's layout with no window: one block table of every layer,
ceil(tokens / block_size) blocks. llama.cpp allocates its caches for the whole context at start; its log
gives each cache's size (non-SWA and SWA, f16). kvserve's CPU cache is float32, llama.cpp's f16, so the
table gives bytes and elements (K and V values) alike.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import socket
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from engine.config import KV_CACHE_DTYPES

logger = logging.getLogger(__name__)

MiB = 2**20


@dataclass(frozen=True)
class KVServeMeasure:
    context: int  # the context asked for; the sequence holds context - 1 tokens when read (see kvserve_measures)
    held_bytes: int  # used blocks * bytes per block, read after its first decode step
    peak_bytes: int  # the most over the sequence's steps
    all_full_bytes: int  # the same tokens with every layer full
    element_size: float  # bytes per cached value (float32: 4; int8: (D + 4) / D with its scale)
    kv_cache_dtype: str  # the cache's format (auto resolved)
    bytes_per_block: int
    block_size: int
    layout: str  # the start-up log's description


@dataclass(frozen=True)
class LlamaCppMeasure:
    context: int  # -c
    caches: tuple[tuple[str, int, int, float], ...]  # (kind, cells, layers, MiB) per cache its log reports
    total_bytes: int
    element_size: int  # f16: 2


def kvserve_measures(
    path: Path, contexts: list[int], seed: int = 0, kv_cache_dtype: str = "auto"
) -> list[KVServeMeasure]:
    """One sequence per context through kvserve's engine, prefix caching off so that each starts empty.

    A sliding group gives blocks back when the sequence is next scheduled, and a sequence that ends gives all
    of them back in its last step; max_model_len (the largest context) bounds prompt + max_tokens. So: a
    prompt of context - 3 random tokens and three to sample, read after the second (one decode step), when
    the sequence holds context - 1 tokens (as many blocks as `context` tokens need when the context is a
    multiple of the block size)."""
    import numpy as np

    from engine.config import EngineConfig, cdiv
    from engine.core.kv_layout import plan_kv_layout
    from engine.llm import LLM
    from engine.ops import kv_format
    from engine.params import SamplingParams
    from engine.runner.model_runner import kv_bytes_per_block

    config = EngineConfig(
        model=str(path),
        quantization="auto",
        max_model_len=max(contexts),
        max_num_seqs=1,
        enable_prefix_caching=False,
        kv_cache_dtype=kv_cache_dtype,
    )
    engine = LLM.from_config(config).engine
    model_config, layout = engine.model_config, engine.layout
    kv_cache_dtype = engine.kv_cache_dtype
    per_block = kv_bytes_per_block(model_config, layout, config.block_size, kv_cache_dtype)
    all_full = plan_kv_layout([None] * model_config.num_layers, 0)
    all_full_per_block = kv_bytes_per_block(model_config, all_full, config.block_size, kv_cache_dtype)
    element = kv_format.row_bytes(kv_cache_dtype, model_config.head_dim) / model_config.head_dim
    rng = np.random.default_rng(seed)
    results = []
    for context in contexts:
        prompt = rng.integers(100, model_config.vocab_size - 100, size=context - 3).tolist()
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        held = peak = 0
        started = time.monotonic()
        while engine.has_unfinished_requests():
            outputs = engine.step()
            used = engine.pool.num_used_blocks
            peak = max(peak, used)
            sampled = sum(c.num_generated_tokens for out in outputs for c in out.outputs)
            if sampled == 2:
                held = used
        tokens = context - 1
        logger.info("kvserve: %d tokens in %.0f s: %d blocks held", tokens, time.monotonic() - started, held)
        results.append(
            KVServeMeasure(
                context=context,
                held_bytes=held * per_block,
                peak_bytes=peak * per_block,
                all_full_bytes=cdiv(tokens, config.block_size) * all_full_per_block,
                element_size=element,
                kv_cache_dtype=kv_cache_dtype,
                bytes_per_block=per_block,
                block_size=config.block_size,
                layout=layout.describe(),
            )
        )
    return results


# llama.cpp's KV cache log line, e.g. "llama_kv_cache: size = 16.00 MiB (4096 cells, 4 layers, 1/1 seqs), ..."
_CACHE_LINE = re.compile(r"size\s*=\s*([\d.]+) MiB \(\s*(\d+) cells,\s*(\d+) layers")
_SWA_LINE = re.compile(r"creating\s+(non-SWA|SWA) KV cache")


def parse_llama_cpp_kv(log: str) -> list[tuple[str, int, int, float]]:
    """(kind, cells, layers, MiB) per KV cache in a llama.cpp log; kind from the "creating ... KV cache" line
    before it ("non-SWA" / "SWA"), or "all" for a model with one cache."""
    caches = []
    kind = "all"
    for line in log.splitlines():
        if match := _SWA_LINE.search(line):
            kind = match.group(1)
        elif match := _CACHE_LINE.search(line):
            caches.append((kind, int(match.group(2)), int(match.group(3)), float(match.group(1))))
    return caches


def llama_cpp_measure(binary: Path, path: Path, context: int, timeout_s: float = 300.0) -> LlamaCppMeasure:
    """Start llama-server with -c `context` and one slot, read its KV cache sizes from its log, stop it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # -lv 4: the KV cache lines are info messages, below llama-server's default log threshold.
    cmd = [str(binary), "-m", str(path), "-c", str(context), "-np", "1", "-lv", "4"]
    cmd += ["--host", "127.0.0.1", "--port", str(port)]
    logger.info("running: %s", " ".join(cmd))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    deadline = time.monotonic() + timeout_s
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "listening" in line or time.monotonic() > deadline:
                break
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    caches = parse_llama_cpp_kv("".join(lines))
    if not caches:
        raise RuntimeError(f"no KV cache size in llama-server's log:\n{''.join(lines[-40:])}")
    return LlamaCppMeasure(context, tuple(caches), round(sum(c[3] for c in caches) * MiB), 2)


def markdown(kvserve: list[KVServeMeasure], llama: list[LlamaCppMeasure]) -> str:
    """Bytes and elements held per context, with kvserve / llama.cpp ratios."""
    by_context = {m.context: m for m in llama}
    fmt = kvserve[0].kv_cache_dtype if kvserve else ""
    rows = [
        f"| context | kvserve held ({fmt}) | kvserve peak | every layer full ({fmt}) | llama.cpp (f16) | "
        "kvserve / llama.cpp bytes | kvserve / llama.cpp elements | every-full / kvserve |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for m in kvserve:
        other = by_context.get(m.context)
        ratio_bytes = f"{m.held_bytes / other.total_bytes:.2f}×" if other else "—"
        ratio_elements = (
            f"{(m.held_bytes / m.element_size) / (other.total_bytes / other.element_size):.2f}×" if other else "—"
        )
        llama_cell = "—"
        if other:
            detail = ", ".join(f"{kind} {cells} cells × {layers} layers" for kind, cells, layers, _ in other.caches)
            llama_cell = f"{other.total_bytes / MiB:.1f} MiB ({detail})"
        rows.append(
            f"| {m.context} | {m.held_bytes / MiB:.1f} MiB | {m.peak_bytes / MiB:.1f} MiB | "
            f"{m.all_full_bytes / MiB:.1f} MiB | {llama_cell} | {ratio_bytes} | {ratio_elements} | "
            f"{m.all_full_bytes / m.held_bytes:.2f}× |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("gguf", type=Path)
    parser.add_argument("--contexts", default="4096,8192", help="comma-separated context lengths")
    parser.add_argument("--llama-server", type=Path, default=None, help="llama-server binary (default: none)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES, help="kvserve's cache format")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the Markdown table")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    contexts = [int(c) for c in args.contexts.split(",") if c.strip()]
    llama = [llama_cpp_measure(args.llama_server, args.gguf, c) for c in contexts] if args.llama_server else []
    kvserve = kvserve_measures(args.gguf, contexts, kv_cache_dtype=args.kv_cache_dtype)
    report: dict[str, Any] = {"kvserve": [asdict(m) for m in kvserve], "llamacpp": [asdict(m) for m in llama]}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"kvserve layout: {kvserve[0].layout}\n")
        print(markdown(kvserve, llama))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
