"""Loading a model on demand: how long a request for a model that is not loaded waits for its first token,
what the load does to a model that keeps streaming meanwhile, and what memory the server holds before, with
and after the model (unloaded through the admin route).

It starts `kvserve serve` with the default generation model as the default and MODEL (default: the same
file under another name, `swap`) loaded on demand, then, in one run:
1. streams from the default model alone (its inter-token latency, the baseline);
2. streams from it again while a request for `swap` loads it: that request's time to first token (the
   load included), and the stream's inter-token latency during the load, as a ratio to the baseline;
3. the server's RSS before the load, with both models, and after `POST /v1/models/swap/unload`;
4. the default model's decode tokens/s after the load, as a ratio to before (its steps share the cores with
   the loader thread's leftovers);
5. a second load of `swap` (its file now in the page cache).
With --llamacpp (and llama.cpp's server built: scripts/build_llama_cpp.sh) it times llama.cpp's server from
its start to /health 200 on the same GGUF: the start-up a swap costs there.

Usage: python -m clients.bench.model_swap [--model PATH] [--tokens N] [--llamacpp] [-- SERVE_FLAGS...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
from tqdm import tqdm

from clients.bench.memory import rss_bytes
from clients.bench.processes import (
    ensure_llama_server,
    free_port,
    kvserve_server,
    llama_server_command,
    resolve_gguf,
    server_process,
    split_serve_args,
)
from clients.logging_setup import configure_logging
from clients.sse import iter_sse_data

PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."
SWAP = "swap"
DEFAULT_GENERATION_MODEL = "smollm2-135m-instruct"


def _stream(base_url: str, model: str, max_tokens: int) -> tuple[float, list[float]]:
    """(seconds to the first token, the arrival times of every token) of one streamed completion."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "temperature": 0}  # fmt: skip
    start = time.monotonic()
    arrivals: list[float] = []
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=600) as answer:
        answer.raise_for_status()
        for payload in iter_sse_data(answer.iter_lines()):
            if json.loads(payload)["choices"][0]["text"]:
                arrivals.append(time.monotonic())
    return (arrivals[0] - start if arrivals else float("nan")), arrivals


def _gaps(arrivals: list[float], since: float = 0.0, until: float = float("inf")) -> list[float]:
    return [b - a for a, b in zip(arrivals, arrivals[1:]) if since <= b <= until]


def _rss_mib(pid: int) -> float:
    return rss_bytes(pid) / 2**20


def _decode_rate(base_url: str, tokens: int) -> float:
    _, arrivals = _stream(base_url, DEFAULT_GENERATION_MODEL, tokens)
    return (len(arrivals) - 1) / (arrivals[-1] - arrivals[0])


def measure(model: str, tokens: int, serve_args: Sequence[str]) -> dict[str, float]:
    args = ["--model", DEFAULT_GENERATION_MODEL, "--model", f"{SWAP}={model}", "--embedding-model", "none",
            *serve_args]  # fmt: skip
    results: dict[str, float] = {}
    steps = tqdm(total=6, desc="model swap", unit="step")
    with kvserve_server(args, "kvserve-swap-") as (base_url, pid):
        _stream(base_url, DEFAULT_GENERATION_MODEL, 16)  # warm
        card = httpx.get(f"{base_url}/v1/models/{DEFAULT_GENERATION_MODEL}", timeout=10).json()
        print("CPU features:", " ".join((card.get("runtime") or {}).get("cpu_features") or ["unknown"]))
        results["rss_before_mib"] = _rss_mib(pid)
        results["decode_tok_s_before"] = _decode_rate(base_url, tokens)
        _, idle = _stream(base_url, DEFAULT_GENERATION_MODEL, tokens)
        results["itl_idle_ms"] = statistics.median(_gaps(idle)) * 1000
        steps.update()

        streamed: list[float] = []
        stream = threading.Thread(
            target=lambda: streamed.extend(_stream(base_url, DEFAULT_GENERATION_MODEL, 10 * tokens)[1])
        )
        stream.start()
        time.sleep(2.0)
        load_start = time.monotonic()
        results["first_load_ttft_s"], _ = _stream(base_url, SWAP, 4)
        load_end = time.monotonic()
        stream.join()
        during = _gaps(streamed, load_start, load_end)
        results["itl_during_load_ms"] = statistics.median(during) * 1000 if during else float("nan")
        results["itl_during_load_max_ms"] = max(during) * 1000 if during else float("nan")
        results["tokens_during_load"] = len(during)
        steps.update()

        results["rss_both_mib"] = _rss_mib(pid)
        results["decode_tok_s_after_load"] = _decode_rate(base_url, tokens)
        steps.update()
        httpx.post(f"{base_url}/v1/models/{SWAP}/unload", timeout=60).raise_for_status()
        time.sleep(1.0)
        results["rss_after_unload_mib"] = _rss_mib(pid)
        steps.update()
        results["second_load_ttft_s"], _ = _stream(base_url, SWAP, 4)
        steps.update()
        results["loaded_ttft_s"], _ = _stream(base_url, SWAP, 4)
        steps.update()
    steps.close()
    return results


def llama_cpp_startup_s(model: str) -> float | None:
    binary = ensure_llama_server()
    if binary is None:
        return None
    port = free_port()
    log_path = Path(tempfile.mkdtemp(prefix="llama-swap-")) / "server.log"
    start = time.monotonic()
    with server_process(llama_server_command(binary, resolve_gguf(model), port, parallel=1), port, log_path):
        return time.monotonic() - start


def main(argv: Sequence[str] | None = None) -> None:
    own, serve_args = split_serve_args(argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="the model loaded on demand (default: the default model's file)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per timed stream")
    parser.add_argument("--llamacpp", action="store_true", help="time llama.cpp's server start on the same GGUF")
    parser.add_argument("--json", type=Path, help="write the numbers here too")
    args = parser.parse_args(own)
    configure_logging()
    model = args.model or str(resolve_gguf(DEFAULT_GENERATION_MODEL))
    results = measure(model, args.tokens, serve_args)
    if args.llamacpp:
        startup = llama_cpp_startup_s(model)
        if startup is not None:
            results["llama_cpp_startup_s"] = startup
    print(f"model loaded on demand: {model}")
    for key, value in results.items():
        print(f"{key:28} {value:10.3f}")
    print(f"{'itl_load_ratio':28} {results['itl_during_load_ms'] / results['itl_idle_ms']:10.2f}  (during load / idle)")
    ratio = results["decode_tok_s_after_load"] / results["decode_tok_s_before"]
    print(f"{'decode_after_load_ratio':28} {ratio:10.2f}  (after / before)")
    if "llama_cpp_startup_s" in results:
        print(f"{'ttft_vs_llama_cpp_start':28} {results['first_load_ttft_s'] / results['llama_cpp_startup_s']:10.2f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
