"""A quantized GGUF's next-token distributions against its float32 reference, in process.

    python -m engine.bench.gguf_quality --model GGUF [--modes gguf,int8] [--ctx 512]
                                        [--llama-perplexity PATH] [--json]

The reference is the same file dequantized to float32 (`--quantization none`, which equals transformers
within 1e-4). A fixed text (engine/bench/quality_text.md, ~3,500 tokens) is cut into chunks of --ctx
tokens whose second halves are scored, as llama.cpp's `llama-perplexity` scores them; for each kvserve
mode (`gguf/float32`: with its --prefill-dtype; `gguf@int8`: with its --kv-cache-dtype): the mean KL
divergence from the reference,
the mean |difference| of the actual next
token's logprob, and how often the likeliest token is the reference's. Then 8 held-out prompts get 64
greedy tokens from the reference and from each mode (clients/bench/quality.py compares the answers,
llama.cpp's included). With --llama-perplexity, llama.cpp's KL divergence and top-token agreement on
the same text: `llama-perplexity --kl-divergence` against a float32 GGUF written from the same file
(its own float32 reference, on its own tokenization of the text).
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from engine.bench.gguf_file import gguf_path
from engine.config import EngineConfig
from engine.hub.models_hub import DEFAULT_GENERATION_MODEL
from engine.llm import LLM
from engine.ops.cpu_features import cpu_features
from engine.params import SamplingParams

logger = logging.getLogger(__name__)

TEXT = Path(__file__).parent / "quality_text.md"
PROMPTS = (
    "The three primary colors are",
    'def merge_sorted(a, b):\n    """Merge two sorted lists into one sorted list."""\n',
    "Question: Why is the sky blue?\nAnswer:",
    "A recipe for pancakes:\n1.",
    "The history of the printing press begins",
    "Translate to French: 'Good morning, how are you?'\n",
    "List of prime numbers below 50: 2, 3, 5,",
    "Dear hiring manager, I am writing to apply for",
)
GREEDY_TOKENS = 64


@dataclass
class Quality:
    """One system's distance from the float32 reference (None where not measured)."""

    system: str
    mean_kl: float | None = None
    mean_abs_logprob_diff: float | None = None
    top1_agreement: float | None = None  # fraction of scored positions
    scored_tokens: int | None = None
    answers: list[str] = field(default_factory=list)  # greedy answers to PROMPTS


def scored_chunks(tokens: list[int], ctx: int) -> list[list[int]]:
    """The text's whole chunks of `ctx` tokens (llama-perplexity drops the rest)."""
    return [tokens[i : i + ctx] for i in range(0, len(tokens) - ctx + 1, ctx)]


def _chunk_logprobs(llm: LLM, tokens: list[int]) -> torch.Tensor:
    """log-softmax of the logits at every position of one prefill over `tokens`: [len, vocab]."""
    request_id = llm.engine.add_request(tokens, SamplingParams(max_tokens=1))
    batch = llm.engine.scheduler.schedule()
    if batch.num_tokens != len(tokens):
        raise RuntimeError(f"the chunk did not fit one step ({batch.num_tokens} of {len(tokens)} tokens)")
    logits = llm.engine.runner.compute_logits(batch, all_positions=True)
    llm.engine.abort(request_id)
    llm.engine.step()
    return logits.float().log_softmax(dim=-1)


def _engine(model: Path, mode: str, ctx: int) -> LLM:
    """mode: QUANTIZATION[/PREFILL_DTYPE][@KV_CACHE_DTYPE], e.g. `gguf`, `gguf/bfloat16`, `none@float16`,
    `gguf@int8` (an omitted prefill dtype is float32, an omitted KV cache dtype auto)."""
    mode, _, kv_cache_dtype = mode.partition("@")
    quantization, _, prefill = mode.partition("/")
    config = EngineConfig(
        model=str(model),
        quantization=quantization,
        prefill_dtype=prefill or "float32",
        kv_cache_dtype=kv_cache_dtype or "auto",
        max_num_batched_tokens=max(2048, ctx),
    )
    return LLM.from_config(config)


def measure(model: Path, modes: list[str], ctx: int) -> tuple[Quality, list[Quality], list[list[int]]]:
    """(the reference with its answers, one Quality per mode, the prompts' token ids)."""
    reference = _engine(model, "none@float32", ctx)
    tokens = reference.tokenizer.encode(TEXT.read_text())
    chunks = scored_chunks(tokens, ctx)
    if not chunks:
        raise ValueError(f"{TEXT} has {len(tokens)} tokens, fewer than one chunk of {ctx}")
    first = ctx // 2  # score positions first .. ctx - 2, each predicting the next token
    reference_logprobs = [
        _chunk_logprobs(reference, chunk)[first:-1] for chunk in tqdm(chunks, desc="float32", unit="chunk")
    ]
    prompts = [reference.tokenizer.encode(p) for p in PROMPTS]
    greedy = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    baseline = Quality("float32", answers=[r[0].text for r in reference.generate(prompts, greedy)])
    del reference
    results = []
    for mode in modes:
        llm = _engine(model, mode, ctx)
        kl, diffs, agree, count = 0.0, 0.0, 0, 0
        for chunk, ref in zip(tqdm(chunks, desc=mode, unit="chunk"), reference_logprobs):
            ours = _chunk_logprobs(llm, chunk)[first:-1]
            kl += float((ref.exp() * (ref - ours)).sum())
            targets = torch.tensor(chunk[first + 1 :])
            rows = torch.arange(len(targets))
            diffs += float((ref[rows, targets] - ours[rows, targets]).abs().sum())
            agree += int((ref.argmax(-1) == ours.argmax(-1)).sum())
            count += len(targets)
        answers = [r[0].text for r in llm.generate(prompts, greedy)]
        results.append(Quality(f"kvserve {mode}", kl / count, diffs / count, agree / count, count, answers))
        del llm
    return baseline, results, prompts


def write_float32_gguf(source: Path, target: Path) -> Path:
    """`source` with every tensor dequantized to float32 and its metadata copied: llama.cpp's reference."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    writer = gguf.GGUFWriter(str(target), reader.fields["general.architecture"].contents())
    for name, value in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue
        value_type = value.types[0]
        if value_type == gguf.GGUFValueType.ARRAY:
            writer.add_array(name, value.contents())
        else:
            writer.add_key_value(name, value.contents(), value_type)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for tensor in tqdm(reader.tensors, desc="float32 GGUF", unit="tensor"):
        writer.add_tensor(tensor.name, gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype("float32"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=False)
    writer.close()
    return target


def parse_kl_divergence(output: str) -> tuple[float, float]:
    """(mean KL divergence, same-top-token fraction) from `llama-perplexity --kl-divergence` output."""
    kl = re.search(r"Mean\s+KLD:\s+(-?[\d.]+)", output)
    top = re.search(r"Same top p:\s+([\d.]+)\s*±", output)
    if kl is None or top is None:
        raise RuntimeError(f"no KL divergence in llama-perplexity's output:\n{output[-2000:]}")
    return float(kl.group(1)), float(top.group(1)) / 100.0


def llama_cpp_kl(binary: Path, model: Path, ctx: int) -> Quality:
    """llama.cpp's KL divergence and top-token agreement from its float32 reference on the same text."""
    with tempfile.TemporaryDirectory() as tmp:
        reference = write_float32_gguf(model, Path(tmp) / "reference-f32.gguf")
        base = Path(tmp) / "reference.kld"
        common = ["-f", str(TEXT), "-c", str(ctx), "-b", str(ctx)]
        output = ""
        for args in (
            ["-m", str(reference), "--kl-divergence-base", str(base)],
            ["-m", str(model), "--kl-divergence-base", str(base), "--kl-divergence"],
        ):
            logger.info("%s %s", binary, " ".join(args + common))
            run = subprocess.run([str(binary), *args, *common], capture_output=True, text=True, check=False)
            if run.returncode != 0:
                raise RuntimeError(f"llama-perplexity failed:\n{run.stderr[-2000:]}")
            output = run.stdout + run.stderr
    kl, top = parse_kl_divergence(output)
    return Quality("llama.cpp", mean_kl=kl, top1_agreement=top)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_GENERATION_MODEL, help="a GGUF file or a default-model name")
    parser.add_argument(
        "--modes",
        default="gguf,int8",
        help="kvserve modes to compare: QUANTIZATION[/PREFILL_DTYPE][@KV_CACHE_DTYPE] (gguf/bfloat16: with that "
        "--prefill-dtype; none@int8: float32 weights over an int8 KV cache; the KV cache dtype is auto if omitted)",
    )
    parser.add_argument("--ctx", type=int, default=512, help="tokens per scored chunk")
    parser.add_argument("--llama-perplexity", type=Path, default=None, help="llama.cpp's binary, to measure it too")
    parser.add_argument("--json", action="store_true", help="print JSON instead of lines")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    model = gguf_path(args.model)
    baseline, results, prompts = measure(model, [m.strip() for m in args.modes.split(",") if m.strip()], args.ctx)
    if args.llama_perplexity is not None:
        results.append(llama_cpp_kl(args.llama_perplexity, model, args.ctx))
    if args.json:
        report = {"reference": asdict(baseline), "results": [asdict(r) for r in results], "prompts": prompts}
        extra = {"ctx": args.ctx, "model": str(model), "greedy_tokens": GREEDY_TOKENS, "cpu_flags": cpu_features()}
        print(json.dumps({**report, **extra}))
    else:
        for result in results:
            print(
                f"{result.system}: KL {result.mean_kl}, |d logprob| {result.mean_abs_logprob_diff}, "
                f"same top token {result.top1_agreement}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
