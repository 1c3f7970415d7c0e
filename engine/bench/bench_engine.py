"""Offline engine benchmark: kvserve's LLMEngine beside transformers, same model, dtype and run.

    python -m engine.bench.bench_engine [--model smollm2-135m-instruct] [--dtype float32|bfloat16]

Prints a Markdown table: prefill tokens/s for a 512-token prompt and decode
tokens/s at batch 1, 8 and 32, with the ratio kvserve / transformers; then the
micro-benchmarks that find a regression by part (one decode step, paged vs
dense attention, the sampler, and every linear layer of a step in float32
beside the int8 kernel at M = 1, 8, 32, 48, 64 rows). Ratios, not absolute times, are the point:
both sides run in this process on this machine.
"""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from engine.config import EngineConfig
from engine.engine_core import LLMEngine
from engine.hub.models_hub import DEFAULT_GENERATION_MODEL, resolve_model
from engine.llm import LLM
from engine.params import SamplingParams

logger = logging.getLogger(__name__)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class EngineBenchRow:
    name: str
    kvserve: float
    transformers: float | None
    unit: str

    @property
    def ratio(self) -> str:
        return f"{self.kvserve / self.transformers:.2f}x" if self.transformers else "—"


def _prompt(engine: LLMEngine, num_tokens: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    # Ordinary vocabulary ids (skip the first few hundred: special and byte tokens).
    return torch.randint(300, engine.model_config.vocab_size, (num_tokens,), generator=generator).tolist()


def kvserve_prefill(engine: LLMEngine, prompt: list[int]) -> float:
    started = time.perf_counter()
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    return len(prompt) / (time.perf_counter() - started)


def kvserve_decode(engine: LLMEngine, prompts: list[list[int]], num_steps: int) -> float:
    """Output tokens/s over num_steps decode steps with len(prompts) sequences running."""
    params = SamplingParams(temperature=0, max_tokens=num_steps + 1, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, params)
    while any(seq.num_generated_tokens == 0 for seq in engine.scheduler.running + list(engine.scheduler.waiting)):
        engine.step()  # prefill every prompt first
    started = time.perf_counter()
    generated = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            generated += sum(len(c.token_ids) for c in out.outputs)
    return generated / (time.perf_counter() - started)


def hf_prefill(model, prompt: list[int]) -> float:
    ids = torch.tensor([prompt])
    started = time.perf_counter()
    with torch.inference_mode():
        model(ids).logits[:, -1].argmax(-1)
    return len(prompt) / (time.perf_counter() - started)


def hf_decode(model, prompts: list[list[int]], num_steps: int) -> float:
    ids = torch.tensor(prompts)  # equal lengths: no padding
    mask = torch.ones_like(ids)
    kwargs = dict(attention_mask=mask, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        started = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
        prefill = time.perf_counter() - started
        started = time.perf_counter()
        model.generate(ids, max_new_tokens=num_steps + 1, min_new_tokens=num_steps + 1, **kwargs)
        total = time.perf_counter() - started
    return len(prompts) * num_steps / max(total - prefill, 1e-9)


def _timed_ms(fn, repeats: int) -> float:
    """Mean milliseconds per call over `repeats` calls, after one warm-up call."""
    fn()
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - started) / repeats * 1e3


def micro_benchmarks(engine: LLMEngine, repeats: int = 20) -> list[tuple[str, float]]:
    """Per-part timings in milliseconds at batch 32 (decode shapes of the real model)."""
    from engine.attention.metadata import build_attention_metadata
    from engine.attention.paged import paged_attention
    from engine.attention.reference import dense_reference_attention
    from engine.runner.sampler import SamplingRow, sample

    cfg = engine.model_config
    key_cache, value_cache = engine.runner.kv_caches[0]
    block_size = engine.config.block_size
    num_seqs, context = 32, 256
    blocks_per_seq = context // block_size
    tables = [list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq)) for i in range(num_seqs)]
    meta = build_attention_metadata(
        [context - 1] * num_seqs, [1] * num_seqs, tables, block_size, None, 0, engine.runner.device
    )
    query = torch.randn(num_seqs, cfg.num_heads, cfg.head_dim, dtype=key_cache.dtype)
    scale = cfg.head_dim**-0.5

    def timed(fn) -> float:
        return _timed_ms(fn, repeats)

    keys = key_cache.view(-1, cfg.num_kv_heads, cfg.head_dim)[:context]
    values = value_cache.view(-1, cfg.num_kv_heads, cfg.head_dim)[:context]
    positions = torch.arange(context)

    def dense_all():
        for i in range(num_seqs):
            dense_reference_attention(query[i : i + 1], keys, values, positions[-1:], positions, scale)

    # Flat random logits: the nucleus spills past the candidate set (the full-sort worst case);
    # peaked logits (scaled) look like a trained model's and stay inside the candidates.
    logits = torch.randn(num_seqs, cfg.vocab_size)
    peaked = logits * 8
    rows = [SamplingRow(SamplingParams(temperature=0.8, top_p=0.9), [1, 2, 3], 2, (2,), None) for _ in range(num_seqs)]
    return [
        (
            "paged attention, 1 layer, 32 seqs x 256 ctx (ms)",
            timed(lambda: paged_attention(query, key_cache, value_cache, meta, scale)),
        ),
        ("dense reference attention, same (ms)", timed(dense_all)),
        ("sampler, 32 rows, top-p 0.9, flat logits: worst case (ms)", timed(lambda: sample(logits, rows))),
        ("sampler, 32 rows, top-p 0.9, peaked logits (ms)", timed(lambda: sample(peaked, rows))),
        (
            "attention metadata build, 32 seqs (ms)",
            timed(
                lambda: build_attention_metadata(
                    [context - 1] * num_seqs, [1] * num_seqs, tables, block_size, None, 0, engine.runner.device
                )
            ),
        ),
    ]


def int8_micro_benchmarks(engine: LLMEngine, row_counts: list[int], repeats: int = 5) -> list[tuple[int, float, float]]:
    """(rows, float32 ms, int8 kernel ms) for all linear layers of one step of the engine's model."""
    from engine.ops.int8_linear import available, int8_linear_native
    from engine.quantization.int8 import Int8Linear

    if not available():
        return []
    linears = [m for m in engine.runner.model.modules() if isinstance(m, torch.nn.Linear)]
    if not linears:  # the engine itself runs int8: time its layers' float copies
        quantized = [m for m in engine.runner.model.modules() if isinstance(m, Int8Linear)]
        floats = [(q.dequantized, q.bias) for q in quantized]
    else:
        quantized = [Int8Linear(m) for m in linears]
        floats = [(m.weight, m.bias) for m in linears]

    def timed(fn) -> float:
        return _timed_ms(fn, repeats)

    results = []
    for rows in row_counts:
        inputs = {q.in_features: torch.randn(rows, q.in_features) for q in quantized}
        float_ms = timed(lambda x=inputs: [torch.nn.functional.linear(x[w.shape[1]], w, b) for w, b in floats])
        int8_ms = timed(
            lambda x=inputs: [int8_linear_native(x[q.in_features], q.quantized, q.scale, q.bias) for q in quantized]
        )
        results.append((rows, float_ms, int8_ms))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_GENERATION_MODEL)
    parser.add_argument("--dtype", default="float32", choices=sorted(_DTYPES))
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--quantization", default="none", choices=("none", "int8", "auto"))
    parser.add_argument("--int8-rows", default="1,8,32,48,64", help="rows for the int8 kernel micro-benchmark")
    parser.add_argument("--skip-transformers", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    config = EngineConfig(
        model=args.model, dtype=args.dtype, max_num_batched_tokens=4096, quantization=args.quantization
    )
    engine = LLM.from_config(config).engine
    hf_model = None
    if not args.skip_transformers:
        from transformers import AutoModelForCausalLM

        path = resolve_model(args.model)
        kwargs = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
        location = str(path.parent) if path.suffix == ".gguf" else str(path)
        hf_model = AutoModelForCausalLM.from_pretrained(location, dtype=_DTYPES[args.dtype], **kwargs).eval()

    batches = [int(b) for b in args.batches.split(",")]
    rows: list[EngineBenchRow] = []
    with tqdm(total=1 + len(batches), desc="benchmark", unit="case") as bar:
        prompt = _prompt(engine, args.prefill_tokens, seed=0)
        kvserve_prefill(engine, prompt[:64])  # warm-up
        ours = kvserve_prefill(engine, _prompt(engine, args.prefill_tokens, seed=1))
        theirs = hf_prefill(hf_model, prompt) if hf_model is not None else None
        rows.append(EngineBenchRow(f"prefill, {args.prefill_tokens}-token prompt", ours, theirs, "tokens/s"))
        bar.update()
        for batch in batches:
            prompts = [_prompt(engine, 32, seed=100 + i) for i in range(batch)]
            ours = kvserve_decode(engine, prompts, args.decode_steps)
            theirs = hf_decode(hf_model, prompts, args.decode_steps) if hf_model is not None else None
            rows.append(EngineBenchRow(f"decode, batch {batch}", ours, theirs, "tokens/s"))
            bar.update()

    threads = torch.get_num_threads()
    mode = engine.config.quantization
    print(f"\nkvserve engine ({mode}) vs transformers: {args.model}, {args.dtype}, {threads} threads\n")
    print("| case | kvserve | transformers | ratio |")
    print("| --- | ---: | ---: | ---: |")
    for row in rows:
        theirs = f"{row.transformers:.1f}" if row.transformers else "—"
        print(f"| {row.name} ({row.unit}) | {row.kvserve:.1f} | {theirs} | {row.ratio} |")
    print("\n| part | ms |\n| --- | ---: |")
    for name, ms in micro_benchmarks(engine):
        print(f"| {name} | {ms:.3f} |")
    int8_rows = int8_micro_benchmarks(engine, [int(r) for r in args.int8_rows.split(",")])
    if int8_rows:
        print("\nAll linear layers of one step: float32 F.linear vs the int8 kernel\n")
        print("| rows | float32 ms | int8 kernel ms | speed-up |\n| ---: | ---: | ---: | ---: |")
        for rows, float_ms, int8_ms in int8_rows:
            print(f"| {rows} | {float_ms:.1f} | {int8_ms:.1f} | {float_ms / int8_ms:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
