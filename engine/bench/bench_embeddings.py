"""Embedding throughput: kvserve's Embedder / AsyncEncoder beside sentence-transformers, same process.

1,000 sentences of 10 to 60 words drawn from a seeded word list are embedded
  - by sentence-transformers `encode(batch_size=32)` (the reference rate) and one sentence at a time,
  - by kvserve's AsyncEncoder as one request of every sentence (split by its token budget),
  - by kvserve's AsyncEncoder as 1,000 single-input requests with 32 in flight (dynamic batching),
  - optionally over HTTP (`--url`): 1,000 single-input POST /embed requests, 32 in flight,
and a table of embeddings/s with the ratio to sentence-transformers' batched rate is printed,
plus how far kvserve's vectors are from sentence-transformers' (max abs difference, min cosine).
Each measurement is repeated `--repeats` times, interleaved, and the best run is kept: the
machine may be shared, and the best run is the least disturbed one.

    python -m engine.bench.bench_embeddings [--model all-minilm-l6-v2] [--num-sentences 1000] [--url URL]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from engine.hub.models_hub import DEFAULT_EMBEDDING_MODEL
from engine.serving.torch_worker import RequestLimits, TorchWorker

_WORD_TEXT = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but have an they "
    "you were her she there been one all we their its has more when would who will no if out so said what up about "
    "into than them can only other new some could these two may first then do any like my now over such our man me "
    "even most made after also did many before must through back years where much your way well down should because "
    "each just those people how too little state good very make world still own see men work long get here between "
    "both life being under never day same another know while last might us great old year off come since against go "
    "came right used take three house river music table window garden morning winter engine server cache token "
    "vector model question answer language computer science history market village mountain ocean friend teacher "
    "student doctor city country family water energy light paper story game picture kitchen bridge island forest "
    "quickly slowly happy bright quiet strange simple careful early modern ancient famous heavy gentle"
)
WORDS = _WORD_TEXT.split()


def make_sentences(num_sentences: int, seed: int, min_words: int = 10, max_words: int = 60) -> list[str]:
    rng = random.Random(seed)
    sentences = []
    for _ in range(num_sentences):
        words = [rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words))]
        sentences.append(" ".join(words).capitalize() + ".")
    return sentences


@dataclass
class EmbeddingBenchRow:
    name: str
    seconds: float
    vectors: torch.Tensor | None = None
    num_sentences: int | None = None  # None: all of them


def _timed(fn: Callable[[], torch.Tensor | None]) -> tuple[float, torch.Tensor | None]:
    start = time.perf_counter()
    vectors = fn()
    return time.perf_counter() - start, vectors


async def _async_single_requests(async_embedder, sentences: list[str], concurrency: int, desc: str) -> torch.Tensor:
    out: list[torch.Tensor | None] = [None] * len(sentences)
    next_index = 0
    bar = tqdm(total=len(sentences), desc=desc, leave=False, file=sys.stderr)

    async def client() -> None:
        nonlocal next_index
        while next_index < len(sentences):
            i = next_index
            next_index += 1
            out[i] = (await async_embedder.embed([sentences[i]])).vectors[0]
            bar.update(1)

    await asyncio.gather(*(client() for _ in range(concurrency)))
    bar.close()
    return torch.stack(out)  # type: ignore[arg-type]


async def _http_single_requests(url: str, sentences: list[str], concurrency: int) -> torch.Tensor:
    import httpx

    out: list[list[float] | None] = [None] * len(sentences)
    next_index = 0
    bar = tqdm(total=len(sentences), desc="http /embed x1", leave=False, file=sys.stderr)
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=300) as http:

        async def client() -> None:
            nonlocal next_index
            while next_index < len(sentences):
                i = next_index
                next_index += 1
                response = await http.post("/embed", json={"inputs": sentences[i]})
                response.raise_for_status()
                out[i] = response.json()[0]
                bar.update(1)

        await asyncio.gather(*(client() for _ in range(concurrency)))
    bar.close()
    return torch.tensor(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_EMBEDDING_MODEL, help="alias or local HF directory")
    parser.add_argument("--num-sentences", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight for the single-input runs")
    parser.add_argument("--batch-size", type=int, default=32, help="sentence-transformers encode batch size")
    parser.add_argument("--max-batch-tokens", type=int, default=8192)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--repeats", type=int, default=2, help="interleaved repeats; the best run is reported")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-st-single", action="store_true", help="skip sentence-transformers one at a time")
    parser.add_argument(
        "--st-single-limit", type=int, default=None, help="time sentence-transformers one at a time on the first N only"
    )
    parser.add_argument("--url", default=None, help="also POST /embed single-input requests to a running server")
    args = parser.parse_args(argv)

    from sentence_transformers import SentenceTransformer

    from engine.config import EmbedderConfig
    from engine.hub.models_hub import resolve_model
    from engine.pooling.embedder import Embedder
    from engine.serving.async_encoder import AsyncEncoder

    sentences = make_sentences(args.num_sentences, args.seed)
    model_dir = str(resolve_model(args.model))
    # All torch work (loading, encoding, kvserve's forwards) on one thread, as in the server:
    # a second thread doing torch work would slow both down (engine/serving/torch_worker.py).
    worker = TorchWorker()

    def on_torch(fn: Callable[[], Any]) -> Any:
        return worker.run_blocking(fn)

    config = EmbedderConfig(model=model_dir, dtype=args.dtype, max_batch_tokens=args.max_batch_tokens)
    embedder = on_torch(lambda: Embedder(config))
    st = on_torch(lambda: SentenceTransformer(model_dir, device="cpu"))
    num_tokens = sum(len(ids) for ids in embedder.tokenize(sentences))
    print(
        f"{len(sentences)} sentences, {num_tokens} tokens ({num_tokens / len(sentences):.1f}/sentence); "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, kvserve dtype {args.dtype}",
        flush=True,
    )
    # warm-up: first calls allocate and pick kernels
    on_torch(lambda: st.encode(sentences[:64], batch_size=args.batch_size))
    on_torch(lambda: embedder.embed(sentences[:64]))

    def st_batched() -> torch.Tensor:
        return on_torch(
            lambda: st.encode(sentences, batch_size=args.batch_size, convert_to_tensor=True, show_progress_bar=False)
        )

    single_sentences = sentences[: args.st_single_limit]

    def st_single() -> torch.Tensor:
        def encode_each() -> torch.Tensor:
            bar = tqdm(single_sentences, desc="st x1", leave=False)
            return torch.stack([st.encode([s], convert_to_tensor=True)[0] for s in bar])

        return on_torch(encode_each)

    # The server's batcher, as the server runs it: one request of every sentence, or one request each.
    limits = RequestLimits(max_queued_requests=len(sentences) + 1)

    def kv_batch() -> torch.Tensor:
        async def run() -> torch.Tensor:
            async_embedder = AsyncEncoder(embedder, limits=limits)
            await async_embedder.start(worker)
            try:
                return (await async_embedder.embed(sentences)).vectors
            finally:
                await async_embedder.stop()

        return asyncio.run(run())

    def kv_async_single() -> torch.Tensor:
        async def run() -> torch.Tensor:
            async_embedder = AsyncEncoder(embedder, limits=limits)
            await async_embedder.start(worker)
            try:
                return await _async_single_requests(async_embedder, sentences, args.concurrency, "kvserve x1")
            finally:
                await async_embedder.stop()

        return asyncio.run(run())

    runs: list[tuple[str, Callable[[], torch.Tensor]]] = [
        (f"sentence-transformers encode(batch_size={args.batch_size})", st_batched),
        ("kvserve AsyncEncoder, one request of all", kv_batch),
        (f"kvserve AsyncEncoder, 1-input requests x{args.concurrency} in flight", kv_async_single),
    ]
    if args.url:
        runs.append(
            (
                f"kvserve HTTP /embed, 1-input requests x{args.concurrency} in flight",
                lambda: asyncio.run(_http_single_requests(args.url, sentences, args.concurrency)),
            )
        )
    best: dict[str, EmbeddingBenchRow] = {}
    for _ in tqdm(range(args.repeats), desc="repeats", file=sys.stderr):
        for name, fn in runs:
            seconds, vectors = _timed(fn)
            if name not in best or seconds < best[name].seconds:
                best[name] = EmbeddingBenchRow(name, seconds, vectors.cpu().float() if vectors is not None else None)
    if not args.skip_st_single:  # slow: once
        seconds, vectors = _timed(st_single)
        best["st1"] = EmbeddingBenchRow(
            "sentence-transformers, one sentence at a time", seconds, vectors.cpu(), len(single_sentences)
        )

    reference = best[runs[0][0]]
    ref_rate = len(sentences) / reference.seconds
    print()
    print(f"| {'method':<60} | {'seconds':>8} | {'emb/s':>7} | {'vs ST batched':>13} | {'max |diff|':>10} |")
    print(f"|{'-' * 62}|{'-' * 10}|{'-' * 9}|{'-' * 15}|{'-' * 12}|")
    for row in best.values():
        n = row.num_sentences or len(sentences)
        rate = n / row.seconds
        diff = (row.vectors - reference.vectors[:n]).abs().max().item() if row.vectors is not None else float("nan")
        print(f"| {row.name:<60} | {row.seconds:8.2f} | {rate:7.1f} | {rate / ref_rate:12.2f}x | {diff:10.2e} |")
    kv = best[runs[1][0]].vectors
    cosine = torch.nn.functional.cosine_similarity(kv, reference.vectors).min().item()
    print(f"\nkvserve vs sentence-transformers: min cosine {cosine:.7f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
