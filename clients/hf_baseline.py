"""The plain-`transformers` baseline: the benchmark's requests generated one at a time with `generate`.

The model is the same GGUF, dequantized to float32 by transformers; prompts are the same seeded texts
(sized with the model's own tokenizer) and each request greedily generates exactly its output length
(EOS ignored through `min_new_tokens`). A streamer timestamps every new token, so TTFT (prefill + first
token) and inter-token latency come out in the same BenchResult shape as the HTTP benchmark.

Usage: python -m clients.hf_baseline [--gguf PATH] [-n 4] [--prompt-len 110] [--output-len 128]
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from pathlib import Path
from typing import Any

from clients.bench import (
    BenchResult,
    MemorySampler,
    RequestRecord,
    Workload,
    build_requests,
    markdown_table,
    summarize,
    write_results,
)

logger = logging.getLogger(__name__)


class _TokenClock:
    """A `generate` streamer that records when each new token is produced (the first put is the prompt)."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.times: list[float] = []
        self._seen_prompt = False

    def put(self, value: Any) -> None:
        if not self._seen_prompt:
            self._seen_prompt = True
            return
        self.times.append(time.perf_counter() - self.t0)

    def end(self) -> None:
        pass


def load_model(gguf_path: Path) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    model.eval()
    return tokenizer, model


def run_hf_baseline(
    gguf_path: Path, workload: Workload, *, model_name: str | None = None, progress: bool = True
) -> BenchResult:
    """Load the GGUF with transformers (float32) and generate the workload's requests one at a time."""
    logger.info("loading %s with transformers (float32)", gguf_path)
    tokenizer, model = load_model(gguf_path)
    return generate_workload(model, tokenizer, workload, model_name=model_name or gguf_path.name, progress=progress)


def generate_workload(
    model: Any, tokenizer: Any, workload: Workload, *, model_name: str, progress: bool = True
) -> BenchResult:
    """Generate the workload's requests sequentially (concurrency is 1 whatever the workload says)."""
    import torch

    def count_tokens(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    specs = build_requests(workload, count_tokens)
    pad_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0

    def generate(prompt: str, max_tokens: int, streamer: Any = None) -> int:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        kwargs: dict[str, Any] = {"min_new_tokens": max_tokens} if workload.ignore_eos else {}
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_tokens,
            do_sample=False,
            streamer=streamer,
            pad_token_id=pad_id,
            **kwargs,
        )
        return out.shape[1] - ids.shape[1]

    with torch.inference_mode():
        for _ in range(workload.warmup_requests):
            generate(specs[0].prompt, 4)

        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(specs), desc=f"transformers/{workload.name}", unit="req", leave=False)
        records = []
        with MemorySampler(os.getpid()) as sampler:
            t0 = time.perf_counter()
            for spec in specs:
                clock = _TokenClock(t0)
                record = RequestRecord(start=time.perf_counter() - t0, prompt_tokens=spec.prompt_tokens)
                record.output_tokens = generate(spec.prompt, spec.max_tokens, clock)
                record.end = time.perf_counter() - t0
                record.chunk_times = clock.times
                record.ok = True
                records.append(record)
                if bar is not None:
                    bar.update(1)
            duration = time.perf_counter() - t0
        if bar is not None:
            bar.close()

    result = summarize(
        records,
        duration,
        server="transformers",
        model=model_name,
        workload=workload,
        peak_memory_mib=sampler.peak_rss_mib,
        peak_memory_hwm_mib=sampler.vm_hwm_mib(),
    )
    result.extra["note"] = "in-process, sequential, float32, memory is the benchmark process"
    result.extra["torch_threads"] = torch.get_num_threads()
    return result


def main(argv: list[str] | None = None) -> int:
    from clients.machine_limits import default_gguf_path

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, default=None)
    parser.add_argument("--num-requests", "-n", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=110)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    workload = Workload(
        name=f"n{args.num_requests}-c1-p{args.prompt_len}-o{args.output_len}",
        num_requests=args.num_requests,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        seed=args.seed,
    )
    result = run_hf_baseline(args.gguf or default_gguf_path(), workload)
    print(markdown_table([result]))
    write_results([result], args.json, None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
