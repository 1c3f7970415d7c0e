"""Reranking: (query, document) pairs -> one relevance logit each, from a BERT-style cross-encoder.

`Reranker` is synchronous and owns the model and its tokenizers, like engine/pooling/embedder.py's
`Embedder`, and it offers the same two halves, so the server's `AsyncEncoder`
(engine/serving/async_encoder.py) batches concurrent rerank requests on the one torch worker
exactly as it batches embeddings: `tokenize` runs on the text worker, `forward_pooled` on the torch
worker, here answering one row of logits per pair.

Pairs are tokenized as the model's own tokenizer encodes a text pair: `[CLS] query [SEP] document
[SEP]` for BERT, `<s> query </s></s> document </s>` for XLM-R. BERT also reads the segment ids the
tokenizer gives (0 up to the first [SEP], 1 after). RoBERTa-family models have a single segment and
their tokenizers hand the model no token_type_ids, so every token is segment 0, as in transformers.

Which limit applies: a pair, special tokens included, may be as long as the model's position table
(512 tokens for BERT and XLM-R). A longer pair is refused (400) unless the request asks to
truncate; then the longer of the two texts loses a token at a time until the pair fits ("longest
first", what transformers does for `truncation=True`), from its right or its left end.

Scores: the logit of a one-label model. A checkpoint with several labels (a text-pair classifier)
is refused at load: a ranking needs one number per pair, and sentence-transformers' CrossEncoder
ranks only with one-label models too (its `predict` returns one raw logit per label for the
others). `activation` is what the model's sentence-transformers settings in config.json apply to
that logit to make CrossEncoder.predict's score: sigmoid unless they name identity. The server's
APIs apply it, or a plain sigmoid, where they answer a probability (server/routes/rerank.py).
"""

from __future__ import annotations

import itertools
import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import TORCH_DTYPES, RerankerConfig
from engine.errors import InvalidRequestError, ModelLoadError
from engine.hub.models_hub import resolve_or_download
from engine.models.bert import EncoderBatch
from engine.models.cross_encoder import CrossEncoder, load_cross_encoder
from engine.pooling.embedder import TRUNCATION_DIRECTIONS, load_tokenizers

logger = logging.getLogger(__name__)

TextPair = tuple[str, str]
ACTIVATIONS = ("sigmoid", "identity")
# what the sentence-transformers activation class names in config.json map to
_ST_ACTIVATIONS = {"Sigmoid": "sigmoid", "Identity": "identity"}


class PairTokenIds(list[int]):
    """One tokenized pair: its token ids (the list itself) and `type_ids`, the segment id of each token
    (None for a model that reads none). A list, so the embedding batcher queues, sizes and sorts it as
    it does any token-id list."""

    __slots__ = ("type_ids",)

    def __init__(self, ids: Sequence[int], type_ids: Sequence[int] | None) -> None:
        super().__init__(ids)
        self.type_ids = list(type_ids) if type_ids is not None else None


@dataclass(frozen=True)
class RerankScores:
    """logits: [n] float32 on the CPU, one per pair in input order. num_prompt_tokens: tokens read (truncated)."""

    logits: torch.Tensor
    num_prompt_tokens: int


def sigmoid(logit: float) -> float:
    """1 / (1 + e^-x), without overflow for large |x|."""
    if logit >= 0:
        return 1.0 / (1.0 + math.exp(-logit))
    z = math.exp(logit)
    return z / (1.0 + z)


def read_activation(model_dir: Path) -> str:
    """The activation sentence-transformers applies to this cross-encoder's logit: config.json's
    `sentence_transformers.activation_fn` (or the older `sbert_ce_default_activation_function`);
    sigmoid when neither is set, or when it names a function kvserve does not reproduce (logged)."""
    try:
        raw = json.loads((model_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {model_dir / 'config.json'}: {exc}") from exc
    settings = raw.get("sentence_transformers")
    name = settings.get("activation_fn") if isinstance(settings, dict) else None
    name = name or raw.get("sbert_ce_default_activation_function")
    if not name:
        return "sigmoid"
    activation = _ST_ACTIVATIONS.get(str(name).rsplit(".", 1)[-1])
    if activation is None:
        logger.warning("%s: activation %r is not supported; scores use sigmoid", model_dir, name)
        return "sigmoid"
    return activation


class Reranker:
    """Synchronous cross-encoder: owns the model and tokenizers. Not thread-safe for concurrent forwards."""

    # AsyncEncoder reads these: scores are never normalised, and have no Matryoshka dimensions.
    normalize = False

    def __init__(self, config: RerankerConfig) -> None:
        self.config = config
        self.model_name = config.model
        model_dir = resolve_or_download(config.model)
        if not (model_dir / "config.json").exists():
            raise ModelLoadError(f"rerank model {config.model!r}: {model_dir} has no config.json")
        self.model: CrossEncoder = load_cross_encoder(model_dir, dtype=TORCH_DTYPES[config.dtype], device=config.device)
        if self.model.num_labels != 1:
            raise ModelLoadError(
                f"rerank model {config.model!r} has {self.model.num_labels} labels: it classifies text pairs, and "
                "a ranking needs a model with one label (one relevance score per pair)"
            )
        self.device = torch.device(config.device)
        encoder_config = self.model.encoder.config
        model_limit = encoder_config.max_seq_len
        if config.max_model_len is not None and config.max_model_len > model_limit:
            raise ValueError(
                f"max_model_len {config.max_model_len} exceeds the model's {model_limit} positions ({model_dir})"
            )
        self.max_model_len: int = config.max_model_len or model_limit
        self.hidden_size: int = encoder_config.hidden_size
        # Only BERT's tokenizers hand the model segment ids; a table of one row has only segment 0.
        self.uses_segments: bool = encoder_config.model_type == "bert" and encoder_config.type_vocab_size > 1
        self.activation: str = read_activation(model_dir)
        self._tokenizers = load_tokenizers(model_dir, self.max_model_len)
        logger.info(
            "reranker %s: %s, activation=%s max_model_len=%d",
            self.model_name,
            self.model.architecture,
            self.activation,
            self.max_model_len,
        )

    # ---------------------------------------------------------------- tokenize

    def tokenize(
        self, pairs: Sequence[TextPair], truncate: bool = False, truncation_direction: str = "right"
    ) -> list[PairTokenIds]:
        """(query, document) pairs -> token ids with the model's special tokens, one list per pair.

        Raises InvalidRequestError (param "query" or "documents") for no pairs, text that is not valid
        Unicode (a lone surrogate), or a pair longer than max_model_len while `truncate` is false (the
        message gives both numbers).
        """
        if truncation_direction not in TRUNCATION_DIRECTIONS:
            raise InvalidRequestError(
                f"truncation_direction must be one of {TRUNCATION_DIRECTIONS}, got {truncation_direction!r}",
                param="truncation_direction",
            )
        if len(pairs) == 0:
            raise InvalidRequestError("documents must not be empty", param="documents")
        tokenizer = self._tokenizers[truncation_direction if truncate else None]
        try:
            encodings = tokenizer.encode_batch([(query, document) for query, document in pairs])
        except (TypeError, UnicodeEncodeError) as exc:  # e.g. a lone surrogate: not valid text
            raise _invalid_text_error(pairs) from exc
        token_ids = [PairTokenIds(enc.ids, enc.type_ids if self.uses_segments else None) for enc in encodings]
        for i, ids in enumerate(token_ids):
            if len(ids) > self.max_model_len:
                raise InvalidRequestError(
                    f"pair {i} (the query and document {i}) has {len(ids)} tokens, more than this model's maximum "
                    f"of {self.max_model_len} tokens; shorten it or ask to truncate",
                    param="documents",
                )
        return token_ids

    def check_dimensions(self, dimensions: int | None) -> None:
        """AsyncEncoder's check of a request's `dimensions`: a score has none."""
        if dimensions is not None:
            raise InvalidRequestError("dimensions does not apply to a rerank model", param="dimensions")

    # ---------------------------------------------------------------- forward

    @torch.inference_mode()
    def forward_pooled(self, token_ids: Sequence[Sequence[int]]) -> torch.Tensor:
        """One packed forward over all pairs -> [B, 1] float32 logits on the CPU (the name is the
        embedding batcher's; nothing is pooled but each pair's first token).

        Pass `tokenize`'s lists, length-sorted (attention groups neighbours of similar length); the caller
        keeps the batch within its token budget."""
        lens = [len(ids) for ids in token_ids]
        flat = torch.tensor(list(itertools.chain.from_iterable(token_ids)), dtype=torch.long, device=self.device)
        segments = None
        if self.uses_segments:
            if not all(isinstance(ids, PairTokenIds) and ids.type_ids is not None for ids in token_ids):
                raise TypeError("this model reads segment ids: pass the PairTokenIds that tokenize() returns")
            types = itertools.chain.from_iterable(ids.type_ids for ids in token_ids)  # type: ignore[union-attr]
            segments = torch.tensor(list(types), dtype=torch.long, device=self.device)
        batch = EncoderBatch.from_seq_lens(lens, device=self.device)
        return self.model(flat, batch, segments).float().cpu()

    def score(
        self, pairs: Sequence[TextPair], *, truncate: bool = False, truncation_direction: str = "right"
    ) -> RerankScores:
        """Score (query, document) pairs in one forward -> one logit per pair, in input order.

        The plain reference: the server batches concurrent requests with AsyncEncoder, and the tests
        hold its scores equal to these."""
        token_ids = self.tokenize(pairs, truncate, truncation_direction)
        logits = self.forward_pooled(token_ids)[:, 0]
        return RerankScores(logits=logits.contiguous(), num_prompt_tokens=sum(len(ids) for ids in token_ids))

    def activate(self, logit: float) -> float:
        """The model's own score for a logit: what sentence-transformers' CrossEncoder.predict answers."""
        return sigmoid(logit) if self.activation == "sigmoid" else logit


def _invalid_text_error(pairs: Sequence[TextPair]) -> InvalidRequestError:
    """The 400 for pairs the tokenizer refused: names the first text that is not valid Unicode."""
    for index, pair in enumerate(pairs):
        for param, what, text in (("query", "its query", pair[0]), ("documents", f"document {index}", pair[1])):
            if not isinstance(text, str):
                return InvalidRequestError(f"pair {index}: {what} is not a string", param=param)
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                return InvalidRequestError(
                    f"pair {index} cannot be tokenized: {what} is not valid Unicode text ({exc.reason} at "
                    f"character {exc.start})",
                    param=param,
                )
    return InvalidRequestError("the pairs cannot be tokenized", param="documents")
