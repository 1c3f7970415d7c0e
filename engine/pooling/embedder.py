"""Sentence embeddings: tokenize -> packed BERT encoder forward -> pool -> normalise.

`Embedder` is synchronous and owns the model and tokenizer; `engine.serving.async_encoder.AsyncEncoder`
batches concurrent requests on top of its two halves (`tokenize` and `forward_pooled`) in token-budget forwards.

Which limit applies: an input may be as long as the model's position table
(`max_position_embeddings`, minus RoBERTa's offset; 512 tokens for all-MiniLM-L6-v2).
sentence-transformers silently truncates at `max_seq_length` from
`sentence_bert_config.json` (256 for all-MiniLM-L6-v2); kvserve does not cut silently: it embeds
the whole input up to the position limit and refuses longer ones with a 400 unless the request
asks to truncate. So vectors equal sentence-transformers' for inputs within its own limit.

To reproduce the sentence-transformers pipeline for models that carry its files, texts are
stripped (and lower-cased when `sentence_bert_config.json` says `do_lower_case`) before
tokenizing, as its `Transformer` module does.
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.config import TORCH_DTYPES, EmbedderConfig
from engine.errors import ForeignTokenIdsError, InvalidRequestError, ModelLoadError
from engine.hub.models_hub import resolve_or_download
from engine.models.bert import BertModel, EncoderBatch, load_bert

logger = logging.getLogger(__name__)

TRUNCATION_DIRECTIONS = ("right", "left")
# sentence-transformers module types kvserve reproduces; any other module (Dense, ...) would change the vectors.
_ST_MODULES = ("Transformer", "Pooling", "Normalize")
# 1_Pooling/config.json flag -> our pooling mode
_ST_POOLING_FLAGS = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_lasttoken": "last",
    "pooling_mode_max_tokens": None,
    "pooling_mode_mean_sqrt_len_tokens": None,
    "pooling_mode_weightedmean_tokens": None,
}

EmbedInputs = Sequence[str] | Sequence[Sequence[int]]
# Token-id input checked against the tokenizer (EmbedderConfig.token_ids == "check"): a left-truncated
# input may start inside a word; long inputs may skip this many leading tokens to find a clean start.
_MAX_SKIPPED_LEADING_TOKENS = 2
_MIN_TOKENS_TO_SKIP_LEADING = 16


@dataclass(frozen=True)
class EmbedResult:
    """vectors: [n, d] float32 on the CPU, in input order. num_prompt_tokens: tokens embedded (after truncation)."""

    vectors: torch.Tensor
    num_prompt_tokens: int


@dataclass(frozen=True)
class SentenceTransformerSettings:
    """What the model's sentence-transformers files say (all None/False when it has none)."""

    has_files: bool = False
    pooling: str | None = None
    normalize: bool | None = None
    max_seq_length: int | None = None
    do_lower_case: bool = False


def read_sentence_transformer_settings(model_dir: Path) -> SentenceTransformerSettings:
    """Read modules.json, 1_Pooling/config.json and sentence_bert_config.json when present."""
    modules_file = model_dir / "modules.json"
    if not modules_file.exists():
        return SentenceTransformerSettings()
    try:
        modules = json.loads(modules_file.read_text())
        st_config_file = model_dir / "sentence_bert_config.json"
        if not st_config_file.exists():  # older exports keep it beside the Transformer module's files
            st_config_file = _encoder_dir(model_dir) / "sentence_bert_config.json"
        st_config = json.loads(st_config_file.read_text()) if st_config_file.exists() else {}
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read sentence-transformers files in {model_dir}: {exc}") from exc
    kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
    unsupported = [k for k in kinds if k not in _ST_MODULES]
    if unsupported:
        raise ModelLoadError(f"{modules_file}: sentence-transformers modules {unsupported} are not supported")
    pooling = None
    for module in modules:
        if str(module.get("type", "")).endswith("Pooling"):
            pooling = _read_pooling(model_dir / module.get("path", "1_Pooling") / "config.json")
    return SentenceTransformerSettings(
        has_files=True,
        pooling=pooling,
        normalize="Normalize" in kinds,
        max_seq_length=st_config.get("max_seq_length"),
        do_lower_case=bool(st_config.get("do_lower_case", False)),
    )


def _read_pooling(path: Path) -> str | None:
    try:
        flags = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    chosen = [flag for flag in _ST_POOLING_FLAGS if flags.get(flag)]
    if len(chosen) != 1 or _ST_POOLING_FLAGS[chosen[0]] is None:
        raise ModelLoadError(f"{path}: pooling {chosen} is not supported (one of mean / cls / lasttoken)")
    return _ST_POOLING_FLAGS[chosen[0]]


def _special_token_framing(tokenizer) -> tuple[list[int], list[int]]:
    """The special token ids the tokenizer puts before and after every text: ([CLS], [SEP]) for BERT."""
    framed = tokenizer.encode("a", add_special_tokens=True).ids
    bare = tokenizer.encode("a", add_special_tokens=False).ids
    for start in range(len(framed) - len(bare) + 1):
        if framed[start : start + len(bare)] == bare:
            return framed[:start], framed[start + len(bare) :]
    return [], []


def load_tokenizers(model_dir: Path, max_len: int):
    """Three `tokenizers.Tokenizer`s from the model's own files: no truncation, truncate right, truncate left.

    Separate objects because truncation is tokenizer state and requests with different settings run
    concurrently. Truncation counts the special tokens ([CLS] ... [SEP]) inside max_len, like transformers.
    """
    from tokenizers import Tokenizer

    tokenizer_file = model_dir / "tokenizer.json"
    if tokenizer_file.exists():

        def make() -> Tokenizer:
            return Tokenizer.from_file(str(tokenizer_file))
    else:  # e.g. only vocab.txt: let transformers build the fast tokenizer once, then copy its backend
        from transformers import AutoTokenizer

        try:
            serialized = AutoTokenizer.from_pretrained(str(model_dir)).backend_tokenizer.to_str()
        except Exception as exc:
            raise ModelLoadError(f"no usable tokenizer in {model_dir}: {exc}") from exc

        def make() -> Tokenizer:
            return Tokenizer.from_str(serialized)

    result = {}
    for direction in (None, *TRUNCATION_DIRECTIONS):
        tok = make()
        tok.no_padding()
        if direction is None:
            tok.no_truncation()
        else:
            tok.enable_truncation(max_len, direction=direction)
        result[direction] = tok
    return result


def pool(hidden: torch.Tensor, batch: EncoderBatch, mode: str) -> torch.Tensor:
    """[N, H] packed hidden states -> [B, H] one vector per sequence."""
    starts, ends = batch.cu_seqlens[:-1], batch.cu_seqlens[1:]
    if mode == "cls":
        return hidden[starts]
    if mode == "last":
        return hidden[ends - 1]
    lens = ends - starts
    seq_index = torch.repeat_interleave(torch.arange(len(batch.seq_lens), device=hidden.device), lens)
    sums = torch.zeros(len(batch.seq_lens), hidden.shape[1], dtype=hidden.dtype, device=hidden.device)
    sums.index_add_(0, seq_index, hidden)
    return sums / lens[:, None].to(hidden.dtype)


def finalize(pooled: torch.Tensor, normalize: bool, dimensions: int | None) -> torch.Tensor:
    """Keep the first `dimensions` components (Matryoshka-style), then L2-normalise when asked."""
    if dimensions is not None:
        pooled = pooled[:, :dimensions]
    if normalize:
        pooled = F.normalize(pooled, p=2.0, dim=-1)
    return pooled.contiguous()


class Embedder:
    """Synchronous embedding model: owns the encoder and tokenizers. Not thread-safe for concurrent forwards."""

    def __init__(self, config: EmbedderConfig) -> None:
        self.config = config
        self.model_name = config.model
        model_dir = resolve_or_download(config.model)
        encoder_dir = _encoder_dir(model_dir)
        if not (encoder_dir / "config.json").exists():
            raise ModelLoadError(f"embedding model {config.model!r}: {encoder_dir} has no config.json")
        self.model: BertModel = load_bert(encoder_dir, dtype=TORCH_DTYPES[config.dtype], device=config.device)
        self.device = torch.device(config.device)
        model_limit = self.model.config.max_seq_len
        if config.max_model_len is not None and config.max_model_len > model_limit:
            raise ValueError(
                f"max_model_len {config.max_model_len} exceeds the model's {model_limit} positions ({model_dir})"
            )
        self.max_model_len: int = config.max_model_len or model_limit
        self.st = read_sentence_transformer_settings(model_dir)
        self.pooling: str = config.pooling or self.st.pooling or "mean"
        if config.pooling is None and self.st.pooling is None:
            logger.warning("%s has no sentence-transformers pooling config; using mean pooling", model_dir)
        if config.normalize is not None:
            self.normalize: bool = config.normalize
        else:
            self.normalize = self.st.normalize if self.st.has_files else True
        self.hidden_size: int = self.model.config.hidden_size
        self.vocab_size: int = self.model.config.vocab_size
        self._tokenizers = load_tokenizers(encoder_dir, self.max_model_len)
        self._framing = _special_token_framing(self._tokenizers[None])
        logger.info(
            "embedder %s: pooling=%s normalize=%s max_model_len=%d dims=%d",
            self.model_name,
            self.pooling,
            self.normalize,
            self.max_model_len,
            self.hidden_size,
        )

    # ---------------------------------------------------------------- tokenize

    def tokenize(
        self, inputs: EmbedInputs, truncate: bool = False, truncation_direction: str = "right"
    ) -> list[list[int]]:
        """Texts -> token ids with the model's special tokens; token-id inputs are used as given.

        Raises InvalidRequestError for an empty list, text that is not valid Unicode (a lone surrogate),
        an empty token list, an out-of-vocabulary id, or an input longer than max_model_len while
        `truncate` is false (the message gives both numbers).
        """
        if truncation_direction not in TRUNCATION_DIRECTIONS:
            raise InvalidRequestError(
                f"truncation_direction must be one of {TRUNCATION_DIRECTIONS}, got {truncation_direction!r}",
                param="truncation_direction",
            )
        if len(inputs) == 0:
            raise InvalidRequestError("input must not be empty", param="input")
        if all(isinstance(x, str) for x in inputs):
            texts = [self._prepare_text(x) for x in inputs]
            tokenizer = self._tokenizers[truncation_direction if truncate else None]
            try:
                token_ids = [enc.ids for enc in tokenizer.encode_batch(texts)]
            except (TypeError, UnicodeEncodeError) as exc:  # e.g. a lone surrogate: not valid text
                raise _invalid_text_error(texts) from exc
            if not truncate:  # a truncating tokenizer cuts at max_model_len itself
                self._check_lengths(token_ids)
        elif all(not isinstance(x, str) for x in inputs):
            token_ids = [self._check_token_ids(i, x) for i, x in enumerate(inputs)]
            if not truncate:
                self._check_lengths(token_ids)  # an over-long input is told so before anything else
            if self.config.token_ids == "check":  # on the ids as sent, before any cut
                for i, ids in enumerate(token_ids):
                    self._check_own_tokenization(i, ids)
            if truncate:
                cut = self.max_model_len
                token_ids = [ids[:cut] if truncation_direction == "right" else ids[-cut:] for ids in token_ids]
        else:
            raise InvalidRequestError("input must be all strings or all token-id lists, not a mix", param="input")
        return token_ids

    def _check_lengths(self, token_ids: list[list[int]]) -> None:
        for i, ids in enumerate(token_ids):
            if len(ids) > self.max_model_len:
                raise InvalidRequestError(
                    f"input {i} has {len(ids)} tokens, more than this model's maximum of {self.max_model_len} tokens; "
                    f"shorten it or ask to truncate",
                    param="input",
                )

    def _prepare_text(self, text: str) -> str:
        if not self.st.has_files:
            return text
        text = text.strip()
        return text.lower() if self.st.do_lower_case else text

    def _check_token_ids(self, index: int, ids: Sequence[int]) -> list[int]:
        mode = self.config.token_ids
        if mode == "reject":
            raise ForeignTokenIdsError(
                "this server embeds text only, not token ids (--embedding-token-ids reject); send the text "
                "(LangChain's OpenAIEmbeddings: check_embedding_ctx_length=False)",
                param="input",
            )
        ids = list(ids)
        if not ids:
            raise InvalidRequestError(f"input {index} is an empty token list", param="input")
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise ForeignTokenIdsError(
                    f"input {index} has token id {t!r}, outside this model's vocabulary [0, {self.vocab_size})",
                    param="input",
                )
        return ids

    def _check_own_tokenization(self, index: int, ids: list[int]) -> None:
        if not self._is_own_tokenization(ids):
            raise ForeignTokenIdsError(
                f"input {index}: these token ids are not what this model's tokenizer makes of their text (its "
                "special tokens included), so they were likely made by another tokenizer (e.g. tiktoken) and would "
                "embed as a wrong vector; send the text instead (LangChain's OpenAIEmbeddings: "
                "check_embedding_ctx_length=False), or start the server with --embedding-token-ids accept",
                param="input",
            )

    def _is_own_tokenization(self, ids: list[int]) -> bool:
        """The ids are what the model's tokenizer makes of their text, special tokens included.

        They must carry the special tokens the tokenizer puts around every text ([CLS] ... [SEP] for
        BERT), and what lies between must come back unchanged when decoded and encoded again. An
        input cut on its left (truncated from the start) may begin with the tail of a word, which
        re-encodes otherwise: from 16 tokens on, up to two leading tokens may be skipped to find a
        start that round-trips. Ids from another tokenizer (tiktoken's, sent by LangChain's
        OpenAIEmbeddings by default) lack the framing, and mostly decode to text this tokenizer
        splits differently. What passes undetected: another tokenizer's ids that happen to start
        and end with this one's special token ids and re-encode the same, which no check on the ids
        alone can tell from the real thing.
        """
        lead, trail = self._framing
        if len(ids) <= len(lead) + len(trail) or ids[: len(lead)] != lead or ids[len(ids) - len(trail) :] != trail:
            return False
        inner = ids[len(lead) : len(ids) - len(trail)]
        skippable = _MAX_SKIPPED_LEADING_TOKENS if len(inner) >= _MIN_TOKENS_TO_SKIP_LEADING else 0
        return any(self._round_trips(inner[skip:]) for skip in range(skippable + 1))

    def _round_trips(self, ids: list[int]) -> bool:
        tokenizer = self._tokenizers[None]
        text = tokenizer.decode(ids, skip_special_tokens=False)
        return tokenizer.encode(text, add_special_tokens=False).ids == ids

    # ---------------------------------------------------------------- forward

    @torch.inference_mode()
    def forward_pooled(self, token_ids: Sequence[Sequence[int]]) -> torch.Tensor:
        """One packed encoder forward over all sequences -> [B, H] float32 pooled, not normalised, CPU.

        Pass length-sorted sequences (attention groups neighbours of similar length); the caller keeps
        the batch within its token budget."""
        lens = [len(ids) for ids in token_ids]
        flat = torch.tensor(list(itertools.chain.from_iterable(token_ids)), dtype=torch.long, device=self.device)
        batch = EncoderBatch.from_seq_lens(lens, device=self.device)
        hidden = self.model(flat, batch).float()  # [N, H]
        return pool(hidden, batch, self.pooling).cpu()

    def embed(
        self,
        inputs: EmbedInputs,
        *,
        normalize: bool | None = None,
        truncate: bool = False,
        truncation_direction: str = "right",
        dimensions: int | None = None,
    ) -> EmbedResult:
        """Embed a list of texts (or token-id lists) -> vectors in input order, in one forward.

        The plain reference: the server batches concurrent requests with AsyncEncoder, and the
        tests hold its vectors equal to these."""
        self.check_dimensions(dimensions)
        token_ids = self.tokenize(inputs, truncate, truncation_direction)
        pooled = self.forward_pooled(token_ids)
        vectors = finalize(pooled, self.normalize if normalize is None else normalize, dimensions)
        return EmbedResult(vectors=vectors, num_prompt_tokens=sum(len(ids) for ids in token_ids))

    def check_dimensions(self, dimensions: int | None) -> None:
        if dimensions is not None and not 1 <= dimensions <= self.hidden_size:
            raise InvalidRequestError(
                f"dimensions must be between 1 and {self.hidden_size} for this model, got {dimensions}",
                param="dimensions",
            )


def _invalid_text_error(texts: list[str]) -> InvalidRequestError:
    """The 400 for texts the tokenizer refused: names the first input that is not valid Unicode text."""
    for index, text in enumerate(texts):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            return InvalidRequestError(
                f"input {index} cannot be tokenized: it is not valid Unicode text ({exc.reason} at character "
                f"{exc.start})",
                param="input",
            )
    return InvalidRequestError("input cannot be tokenized", param="input")


def _encoder_dir(model_dir: Path) -> Path:
    """Where config.json and the tokenizer live: the root, or the sentence-transformers Transformer
    module's folder when modules.json puts it in a subfolder (older exports use `0_Transformer/`)."""
    try:
        modules = json.loads((model_dir / "modules.json").read_text())
    except (OSError, json.JSONDecodeError):
        return model_dir
    for module in modules:
        if str(module.get("type", "")).endswith("Transformer") and module.get("path"):
            return model_dir / module["path"]
    return model_dir
