"""How close a quantized GGUF runs to its float32 reference: kvserve's quantization modes and llama.cpp, one run.

    python -m clients.bench.quality [--model GGUF] [--modes gguf,int8] [--ctx 512] [--no-llama-cpp]

`engine.bench.gguf_quality` (run as a subprocess) measures next-token distributions over a fixed text
against the file dequantized to float32, for each kvserve mode and, with llama.cpp's `llama-perplexity`
built, for llama.cpp on its own float32 reference; it also returns every mode's greedy answers to 8
held-out prompts (64 tokens each). Here llama.cpp's `llama-server` answers the same prompt token ids,
and every answer is compared with the float32 one: characters shared before the first difference
(summed over the prompts) and answers identical. Prints a Markdown table with the CPU flags.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
from pathlib import Path
from typing import Any

import httpx

from clients.bench.processes import (
    LLAMA_SERVER,
    free_port,
    llama_server_command,
    resolve_gguf,
    run_json_program,
    server_process,
)
from clients.logging_setup import configure_logging

logger = logging.getLogger(__name__)

LLAMA_PERPLEXITY = LLAMA_SERVER.parent / "llama-perplexity"


def compare_answers(answers: list[str], reference: list[str]) -> tuple[int, int]:
    """(characters each answer shares with its reference before the first difference, summed; answers identical)."""
    shared = 0
    for ours, theirs in zip(answers, reference):
        length = min(len(ours), len(theirs))
        shared += next((i for i in range(length) if ours[i] != theirs[i]), length)
    return shared, sum(a == r for a, r in zip(answers, reference))


def llama_cpp_answers(model: Path, prompts: list[list[int]], max_tokens: int) -> list[str]:
    """llama-server's greedy answers to prompts given as token ids."""
    port = free_port()
    answers = []
    with tempfile.TemporaryDirectory() as tmp:
        with server_process(llama_server_command(LLAMA_SERVER, model, port, parallel=1), port, Path(tmp) / "log"):
            for prompt in prompts:
                body = {
                    "prompt": prompt,
                    "n_predict": max_tokens,
                    "temperature": 0,
                    "top_k": 1,
                    "ignore_eos": True,
                    "cache_prompt": False,
                }
                response = httpx.post(f"http://127.0.0.1:{port}/completion", json=body, timeout=600)
                response.raise_for_status()
                answers.append(response.json()["content"])
    return answers


def table(report: dict[str, Any]) -> str:
    """The report of engine.bench.gguf_quality (answers filled in for every system) as Markdown."""

    def show(value: float | int | None, spec: str) -> str:
        return "—" if value is None else format(value, spec)

    reference = report["reference"]["answers"]
    lines = [
        f"Against float32, CPU flags: {' '.join(report['cpu_flags']) or 'unknown'}; {report['ctx']}-token chunks; "
        f"{len(reference)} greedy prompts of {report['greedy_tokens']} tokens",
        "",
        "| system | mean KL divergence ↓ | mean abs Δ logprob ↓ | same top token ↑ | greedy chars shared ↑ "
        "| greedy answers identical ↑ |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for result in report["results"]:
        shared, identical = compare_answers(result["answers"], reference) if result["answers"] else (None, None)
        top = None if result["top1_agreement"] is None else 100 * result["top1_agreement"]
        lines.append(
            f"| {result['system']} | {show(result['mean_kl'], '.5f')} | "
            f"{show(result['mean_abs_logprob_diff'], '.4f')} | {show(top, '.2f')}% | {show(shared, 'd')} | "
            f"{show(identical, 'd')} / {len(reference)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m clients.bench.quality",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a GGUF file or a default-model name")
    parser.add_argument(
        "--modes",
        default="gguf,int8",
        help="kvserve modes to compare: QUANTIZATION[/PREFILL_DTYPE][@KV_CACHE_DTYPE] (gguf/bfloat16, gguf@int8)",
    )
    parser.add_argument("--ctx", type=int, default=512, help="tokens per scored chunk")
    parser.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp")
    args = parser.parse_args(argv)
    configure_logging()
    model = resolve_gguf(args.model)
    with_llama = not args.no_llama_cpp and LLAMA_SERVER.exists() and LLAMA_PERPLEXITY.exists()
    if not args.no_llama_cpp and not with_llama:
        logger.warning("llama.cpp skipped: build llama-server and llama-perplexity (scripts/build_llama_cpp.sh)")
    program_args = ["--model", str(model), "--modes", args.modes, "--ctx", str(args.ctx), "--json"]
    if with_llama:
        program_args += ["--llama-perplexity", str(LLAMA_PERPLEXITY)]
    report, _ = run_json_program("engine.bench.gguf_quality", program_args)
    if with_llama:
        llama = next(r for r in report["results"] if r["system"] == "llama.cpp")
        llama["answers"] = llama_cpp_answers(model, report["prompts"], report["greedy_tokens"])
    print(table(report), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
