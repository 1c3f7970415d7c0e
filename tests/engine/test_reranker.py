"""Reranker (engine/pooling/reranker.py) on tiny random cross-encoders, exact against transformers.

Two checkpoints are built here with transformers: a `BertForSequenceClassification` with the
all-MiniLM-L6-v2 tokenizer files (WordPiece, segment ids 0/1) and an
`XLMRobertaForSequenceClassification` with a small Unigram tokenizer made offline (one segment,
positions offset by pad_token_id + 1). Their scores must equal transformers' logits in float32 for
pairs of different lengths in one batch, with and without truncation, and through the AsyncEncoder
batching the server uses.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
import torch

from engine.config import RerankerConfig
from engine.errors import InvalidRequestError, ModelLoadError
from engine.models.bert import EncoderBatch
from engine.models.cross_encoder import load_cross_encoder
from engine.pooling.reranker import PairTokenIds, Reranker, sigmoid
from engine.serving.async_encoder import AsyncEncoder
from tests.engine.test_embedder import minilm_dir  # noqa: F401 - the session fixture, used by name

MAX_POSITIONS = 64  # a small position table: over-long pairs are cheap to make
# The BERT checkpoint's tokenizer: the default embedding model's own files.
BERT_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")
XLMR_WORDS = (
    "the a of to and in is what capital france paris city river berlin germany cat dog model cache "
    "block token query document kv paged attention"
).split()

QUERY = "what is the capital of france"
DOCUMENTS = [
    "paris is the capital of france",
    "berlin",
    "the river in the city of paris is the seine and it is long",
    "a cat",
    "dog " * 20,
    "",  # an empty document is a valid pair: query and special tokens only
    "paged attention stores the kv cache in blocks of tokens",
]


# ---- tiny checkpoints ----


def _xlmr_tokenizer():
    """An XLM-R style fast tokenizer built offline: Unigram pieces over a few words and characters,
    `<s> A </s></s> B </s>` for pairs."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import XLMRobertaTokenizerFast

    pieces = {"▁" + w for w in XLMR_WORDS}
    for c in "abcdefghijklmnopqrstuvwxyz0123456789.,?!'[]":
        pieces.update((c, "▁" + c))
    vocab = [("<s>", 0.0), ("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    vocab += [(p, -1.0 - (i % 5)) for i, p in enumerate(sorted(pieces))]
    vocab.append(("<mask>", 0.0))
    backend = Tokenizer(models.Unigram(vocab, unk_id=3, byte_fallback=False))
    # the pipeline transformers' XLMRobertaTokenizer rebuilds on load, so the saved file and it agree
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")]
    )
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)]
    )
    special = {"bos_token": "<s>", "eos_token": "</s>", "sep_token": "</s>", "cls_token": "<s>"}
    return XLMRobertaTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>", mask_token="<mask>", **special
    )


def make_tiny_cross_encoder(
    path: Path,
    arch: str,
    minilm_dir: str,  # noqa: F811 - a directory, not the fixture
    *,
    num_labels: int = 1,
    st_activation: str | None = None,
    safetensors: bool = True,
) -> Path:
    """A random `BertForSequenceClassification` ("bert") or `XLMRobertaForSequenceClassification` ("xlm-roberta")
    with its tokenizer, saved in `path`. st_activation: a sentence-transformers activation class path to
    record in config.json (what CrossEncoder applies to the logit)."""
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        XLMRobertaConfig,
        XLMRobertaForSequenceClassification,
    )

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    # initializer_range 0.2 (not 0.02): pairs get clearly different scores, so orderings are meaningful
    sizes = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64}
    torch.manual_seed(1234 + num_labels)
    if arch == "bert":
        for name in BERT_TOKENIZER_FILES:
            shutil.copy(Path(minilm_dir) / name, path / name)
        config = BertConfig(
            vocab_size=30522,
            max_position_embeddings=MAX_POSITIONS,
            num_labels=num_labels,
            initializer_range=0.2,
            **sizes,
        )
        model = BertForSequenceClassification(config)
    elif arch == "xlm-roberta":
        tokenizer = _xlmr_tokenizer()
        tokenizer.save_pretrained(path)
        config = XLMRobertaConfig(
            vocab_size=len(tokenizer),
            max_position_embeddings=MAX_POSITIONS + 2,  # the first pad_token_id + 1 = 2 positions are never used
            type_vocab_size=1,
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=2,
            num_labels=num_labels,
            initializer_range=0.2,
            **sizes,
        )
        model = XLMRobertaForSequenceClassification(config)
    else:
        raise ValueError(arch)
    if safetensors:
        model.save_pretrained(path)
    else:
        model.config.save_pretrained(path)
        torch.save(model.state_dict(), path / "pytorch_model.bin")
    if st_activation is not None:
        raw = json.loads((path / "config.json").read_text())
        raw["sentence_transformers"] = {"activation_fn": st_activation}
        (path / "config.json").write_text(json.dumps(raw))
    return path


@pytest.fixture(scope="session")
def cross_encoder_dirs(tmp_path_factory, minilm_dir) -> dict[str, Path]:  # noqa: F811
    return {
        arch: make_tiny_cross_encoder(tmp_path_factory.mktemp(f"tiny-ce-{arch}"), arch, minilm_dir)
        for arch in ("bert", "xlm-roberta")
    }


@pytest.fixture(scope="session")
def rerankers(cross_encoder_dirs) -> dict[str, Reranker]:
    return {arch: Reranker(RerankerConfig(model=str(path))) for arch, path in cross_encoder_dirs.items()}


# ---- the transformers reference ----


def _hf(model_dir: Path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForSequenceClassification.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return tokenizer, model


@torch.inference_mode()
def hf_logits(model_dir: Path, pairs: list[tuple[str, str]], max_length: int | None = None, side: str = "right"):
    """transformers' logits [n, num_labels], one padded batch; truncation to max_length when given."""
    tokenizer, model = _hf(model_dir)
    tokenizer.truncation_side = side
    encoded = tokenizer(
        [q for q, _ in pairs],
        [d for _, d in pairs],
        padding=True,
        truncation=max_length is not None,
        max_length=max_length,
        return_tensors="pt",
    )
    return model(**encoded).logits


def _assert_exact(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() <= 1e-5, (ours, ref)


# ---- scores ----


@pytest.mark.parametrize("arch", ["bert", "xlm-roberta"])
def test_scores_equal_transformers_for_pairs_of_different_lengths(arch, rerankers, cross_encoder_dirs):
    reranker = rerankers[arch]
    pairs = [(QUERY, d) for d in DOCUMENTS] + [("a [SEP] in the query", "paris"), ("cat", QUERY)]
    result = reranker.score(pairs)
    _assert_exact(result.logits, hf_logits(cross_encoder_dirs[arch], pairs)[:, 0])
    assert result.num_prompt_tokens == sum(len(ids) for ids in reranker.tokenize(pairs))
    assert len(set(result.logits.tolist())) == len(pairs)  # random weights, yet every pair scores differently
    # one pair alone scores what it scores in the batch
    _assert_exact(reranker.score(pairs[2:3]).logits, result.logits[2:3])


def test_bert_pairs_carry_segment_ids_and_xlmr_pairs_none(rerankers):
    bert = rerankers["bert"].tokenize([("a [SEP] cat", "dog")])[0]
    assert bert[0] == 101 and bert[-1] == 102
    # a [SEP] typed into the query is still segment 0: segment ids come from the encoding, not from the ids
    assert list(bert) == [101, 1037, 102, 4937, 102, 3899, 102]  # [CLS] a [SEP] cat [SEP] dog [SEP]
    assert bert.type_ids == [0] * 5 + [1] * 2
    xlmr = rerankers["xlm-roberta"].tokenize([("cat", "dog")])[0]
    assert xlmr.type_ids is None and xlmr[0] == 0 and xlmr[-1] == 2
    assert list(xlmr).count(2) == 3  # <s> cat </s></s> dog </s>


@pytest.mark.parametrize("arch", ["bert", "xlm-roberta"])
def test_over_long_pairs_are_refused_unless_truncated(arch, rerankers, cross_encoder_dirs):
    reranker = rerankers[arch]
    assert reranker.max_model_len == MAX_POSITIONS
    long_doc = "the capital of france is paris " * 20
    pairs = [(QUERY, "paris"), (QUERY, long_doc), (long_doc, "berlin")]
    with pytest.raises(InvalidRequestError, match=rf"pair 1 .* more than this model's maximum of {MAX_POSITIONS}") as e:
        reranker.tokenize(pairs)
    assert e.value.param == "documents"
    for side in ("right", "left"):
        result = reranker.score(pairs, truncate=True, truncation_direction=side)
        assert all(len(ids) <= MAX_POSITIONS for ids in reranker.tokenize(pairs, True, side))
        ref = hf_logits(cross_encoder_dirs[arch], pairs, max_length=MAX_POSITIONS, side=side)[:, 0]
        _assert_exact(result.logits, ref)
    assert reranker.score(pairs[:1], truncate=True).logits.item() == pytest.approx(
        reranker.score(pairs[:1]).logits.item(), abs=1e-6
    )  # a pair that fits is not cut
    with pytest.raises(InvalidRequestError, match="truncation_direction"):
        reranker.tokenize(pairs, True, "middle")


def test_bad_input_is_refused(rerankers):
    reranker = rerankers["bert"]
    with pytest.raises(InvalidRequestError, match="must not be empty"):
        reranker.tokenize([])
    with pytest.raises(InvalidRequestError, match="pair 1 cannot be tokenized: document 1 is not valid Unicode") as e:
        reranker.tokenize([("q", "fine"), ("q", "bad \ud800")])
    assert e.value.param == "documents"
    with pytest.raises(InvalidRequestError, match="its query is not valid Unicode") as e:
        reranker.tokenize([("bad \udfff", "d")])
    assert e.value.param == "query"
    with pytest.raises(InvalidRequestError, match="dimensions"):
        reranker.check_dimensions(8)


def test_multi_label_heads_equal_transformers_but_are_not_rerankers(tmp_path, minilm_dir):  # noqa: F811
    pairs = [(QUERY, d) for d in DOCUMENTS[:4]]
    for arch in ("bert", "xlm-roberta"):
        path = make_tiny_cross_encoder(tmp_path / arch, arch, minilm_dir, num_labels=3)
        model = load_cross_encoder(path)
        assert model.num_labels == 3
        reranker_tokens = _tokenize_pairs(path, pairs)
        lens = [len(ids) for ids in reranker_tokens]
        flat = torch.tensor([t for ids in reranker_tokens for t in ids])
        types = torch.tensor([t for ids in reranker_tokens for t in ids.type_ids]) if arch == "bert" else None
        with torch.inference_mode():
            logits = model(flat, EncoderBatch.from_seq_lens(lens), types)
        _assert_exact(logits, hf_logits(path, pairs))
        with pytest.raises(ModelLoadError, match="has 3 labels"):
            Reranker(RerankerConfig(model=str(path)))


def _tokenize_pairs(model_dir: Path, pairs: list[tuple[str, str]]) -> list[PairTokenIds]:
    """Pairs tokenized with the model's own tokenizer.json, segment ids kept."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return [PairTokenIds(e.ids, e.type_ids) for e in tokenizer.encode_batch(pairs)]


def test_pytorch_model_bin_loads_the_same(tmp_path, minilm_dir, rerankers):  # noqa: F811
    path = make_tiny_cross_encoder(tmp_path / "bin", "bert", minilm_dir, safetensors=False)
    assert not list(path.glob("*.safetensors"))
    pairs = [(QUERY, d) for d in DOCUMENTS]
    from_bin = Reranker(RerankerConfig(model=str(path))).score(pairs).logits
    _assert_exact(from_bin, rerankers["bert"].score(pairs).logits)  # same seed, same weights


def test_not_a_cross_encoder_is_refused(tmp_path, minilm_dir):  # noqa: F811
    with pytest.raises(ModelLoadError, match="not a cross-encoder"):
        Reranker(RerankerConfig(model=minilm_dir))  # a plain BertModel: no classification head
    with pytest.raises(ModelLoadError, match="no config.json"):
        Reranker(RerankerConfig(model=str(tmp_path)))


@pytest.mark.slow
def test_activation_follows_the_models_sentence_transformers_settings(tmp_path, minilm_dir, cross_encoder_dirs):  # noqa: F811
    """activate(logit) is what sentence-transformers' CrossEncoder.predict answers for the pair."""
    from sentence_transformers import CrossEncoder

    pairs = [(QUERY, d) for d in DOCUMENTS[:4]]
    identity = make_tiny_cross_encoder(
        tmp_path / "identity", "bert", minilm_dir, st_activation="torch.nn.modules.linear.Identity"
    )
    for path, activation in ((cross_encoder_dirs["bert"], "sigmoid"), (identity, "identity")):
        reranker = Reranker(RerankerConfig(model=str(path)))
        assert reranker.activation == activation
        ours = torch.tensor([reranker.activate(x) for x in reranker.score(pairs).logits.tolist()])
        ref = torch.as_tensor(CrossEncoder(str(path), device="cpu").predict(pairs, batch_size=8))
        assert (ours - ref).abs().max().item() <= 1e-5


def test_sigmoid_is_stable():
    assert sigmoid(0.0) == 0.5
    assert sigmoid(1000.0) == 1.0 and sigmoid(-1000.0) == 0.0
    assert sigmoid(2.0) == pytest.approx(torch.sigmoid(torch.tensor(2.0, dtype=torch.float64)).item())


# ---- batched as the server batches ----


def test_async_embedder_batches_rerank_requests_exactly(rerankers):
    """Concurrent requests share forwards (length-sorted across requests), and each gets its own scores
    back in its own order, equal to the reference."""
    for reranker in rerankers.values():
        requests = [[(QUERY, d) for d in DOCUMENTS], [("cat", "a dog"), ("cat", "a cat")], [(DOCUMENTS[2], QUERY)]]

        async def run(reranker=reranker, requests=requests):
            async_reranker = AsyncEncoder(reranker, what="rerank")
            await async_reranker.start()
            try:
                results = await asyncio.gather(*(async_reranker.embed(pairs) for pairs in requests))
                return results, async_reranker.num_forwards
            finally:
                await async_reranker.stop()

        # Whether requests arrive before the first forward starts depends on the text worker's timing (a loaded
        # machine can tokenize them one forward apart): a few tries, each exact, at least one sharing.
        shared = False
        for _ in range(5):
            results, num_forwards = asyncio.run(run())
            for pairs, result in zip(requests, results, strict=True):
                reference = reranker.score(pairs)
                assert result.vectors.shape == (len(pairs), 1)
                _assert_exact(result.vectors[:, 0], reference.logits)
                assert result.num_prompt_tokens == reference.num_prompt_tokens
            shared = num_forwards < len(requests)
            if shared:
                break
        assert shared  # the requests rode in shared forwards


def test_async_embedder_names_the_rerank_model_in_its_errors(rerankers):
    async def run():
        async_reranker = AsyncEncoder(rerankers["bert"], what="rerank")
        with pytest.raises(Exception, match="the rerank model is not running"):
            await async_reranker.embed([("q", "d")])
        await async_reranker.start()
        try:
            with pytest.raises(InvalidRequestError, match="dimensions"):
                await async_reranker.embed([("q", "d")], dimensions=4)
        finally:
            await async_reranker.stop()

    asyncio.run(run())
