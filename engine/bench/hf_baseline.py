"""The plain-`transformers` baseline: requests generated one at a time with `generate`, in this process.

The model is a GGUF dequantized to float32 by transformers. Each prompt's token ids are cut to the
request's `prompt_tokens` (no special tokens added, so the count is exact) and greedily generate exactly
`max_tokens` tokens (EOS ignored through `min_new_tokens`). A streamer timestamps every new token; the
per-request timings are printed for the caller to summarize (`--json`), or as one line per request.

Usage: python -m engine.bench.hf_baseline --requests FILE [--model NAME | --gguf PATH] [--warmup 1] [--json]

FILE (or - for stdin) is a JSON list of {"prompt": str, "prompt_tokens": int, "max_tokens": int}.
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from engine.bench.gguf_file import gguf_path
from engine.hub.models_hub import DEFAULT_GENERATION_MODEL

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BaselineRequest:
    prompt: str  # at least `prompt_tokens` tokens long
    prompt_tokens: int
    max_tokens: int


@dataclass
class TimedRequest:
    """One generated request; times in seconds from the start of the run."""

    start: float
    end: float
    prompt_tokens: int
    output_tokens: int
    token_times: list[float] = field(default_factory=list)  # when each new token came out


@dataclass
class BaselineRun:
    requests: list[TimedRequest]
    duration_s: float
    torch_threads: int
    peak_rss_mib: float | None = None  # this process's high-water mark, model weights included

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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


def load_model(path: Path) -> tuple[Any, Any]:
    """(tokenizer, model) of a GGUF file, dequantized to float32 by transformers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    model.eval()
    return tokenizer, model


def generate_requests(
    model: Any, tokenizer: Any, requests: list[BaselineRequest], *, warmup_requests: int = 1, progress: bool = True
) -> BaselineRun:
    """Generate `requests` one after the other, timing every token."""
    import torch

    pad_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0

    def prompt_ids(request: BaselineRequest) -> torch.Tensor:
        ids = tokenizer(request.prompt, add_special_tokens=False)["input_ids"]
        if len(ids) < request.prompt_tokens:
            raise ValueError(f"prompt has {len(ids)} tokens, fewer than the {request.prompt_tokens} asked for")
        return torch.tensor([ids[: request.prompt_tokens]])  # [1, prompt_tokens]

    def generate(ids: torch.Tensor, max_tokens: int, streamer: Any = None) -> int:
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            streamer=streamer,
            pad_token_id=pad_id,
        )
        return out.shape[1] - ids.shape[1]

    inputs = [prompt_ids(r) for r in requests]
    timed = []
    with torch.inference_mode():
        for _ in range(warmup_requests):
            generate(inputs[0], 4)
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(requests), desc="transformers", unit="req", leave=False)
        t0 = time.perf_counter()
        for request, ids in zip(requests, inputs):
            clock = _TokenClock(t0)
            start = time.perf_counter() - t0
            num_generated = generate(ids, request.max_tokens, clock)
            timed.append(
                TimedRequest(start, time.perf_counter() - t0, ids.shape[1], num_generated, token_times=clock.times)
            )
            if bar is not None:
                bar.update(1)
        duration = time.perf_counter() - t0
        if bar is not None:
            bar.close()
    return BaselineRun(timed, duration, torch.get_num_threads())


def read_requests(source: str) -> list[BaselineRequest]:
    text = sys.stdin.read() if source == "-" else Path(source).read_text()
    return [BaselineRequest(str(r["prompt"]), int(r["prompt_tokens"]), int(r["max_tokens"])) for r in json.loads(text)]


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", required=True, help="JSON file of the requests, or - for stdin")
    parser.add_argument("--model", default=DEFAULT_GENERATION_MODEL, help="model name (its GGUF is loaded)")
    parser.add_argument("--gguf", type=Path, default=None, help="model GGUF (instead of --model)")
    parser.add_argument("--warmup", type=int, default=1, help="short untimed generations before the run")
    parser.add_argument("--json", action="store_true", help="print the run as JSON on stdout")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    requests = read_requests(args.requests)
    if not requests:
        parser.error("no requests")
    path = args.gguf or gguf_path(args.model)
    logger.info("loading %s with transformers (float32)", path)
    tokenizer, model = load_model(path)
    run = generate_requests(model, tokenizer, requests, warmup_requests=args.warmup, progress=not args.no_progress)
    run.peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
    if args.json:
        print(json.dumps(run.to_dict()))
        return 0
    for r in run.requests:
        ttft_ms = (r.token_times[0] - r.start) * 1000 if r.token_times else float("nan")
        print(
            f"prompt {r.prompt_tokens} tokens, {r.output_tokens} generated in {r.end - r.start:.2f} s, "
            f"first token after {ttft_ms:.0f} ms"
        )
    print(f"peak memory {run.peak_rss_mib:.0f} MiB, {run.torch_threads} torch threads")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
