"""A SentencePiece GGUF's tokenizer as transformers rebuilds it adds no "▁" prefix to a text that already starts
with a space; kvserve's reading prefixes every text, as SentencePiece, the models' own tokenizers and llama.cpp do
(held on llama.cpp's real vocabulary files in tests/engine/test_gguf_vocab_files.py)."""

from __future__ import annotations

from tokenizers import Tokenizer as RustTokenizer
from tokenizers import models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from engine.text.tokenizer import _prefix_every_text_as_sentencepiece

TOKENS = ["<unk>", "▁", "H", "e", "l", "o", "He", "ll", "Hell", "Hello", "▁Hello", "▁▁"]
VOCAB = {token: index for index, token in enumerate(TOKENS)}
# "▁Hello" outranks "▁▁", as in Llama 2's vocabulary: "▁▁Hello" is "▁" + "▁Hello"
MERGES = [("H", "e"), ("l", "l"), ("He", "ll"), ("Hell", "o"), ("▁", "Hello"), ("▁", "▁")]


def _rebuilt(prepend_scheme: str) -> PreTrainedTokenizerFast:
    """A tiny SentencePiece-style BPE, read the way transformers reads such a GGUF."""
    rust = RustTokenizer(models.BPE(VOCAB, MERGES, unk_token="<unk>"))
    rust.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=prepend_scheme, split=False)
    return PreTrainedTokenizerFast(tokenizer_object=rust)


def _ids(tokenizer: PreTrainedTokenizerFast, text: str) -> list[str]:
    return [TOKENS[i] for i in tokenizer.encode(text, add_special_tokens=False)]


def test_every_text_gets_the_prefix_even_one_that_starts_with_a_space():
    tokenizer = _rebuilt("first")
    assert _ids(tokenizer, " Hello") == ["▁Hello"]  # transformers' reading: the prefix is skipped
    _prefix_every_text_as_sentencepiece(tokenizer)
    assert _ids(tokenizer, " Hello") == ["▁", "▁Hello"]
    assert _ids(tokenizer, "Hello") == ["▁Hello"]
    assert _ids(tokenizer, "  Hello") == ["▁▁", "▁Hello"]
    assert isinstance(tokenizer.backend_tokenizer.normalizer, normalizers.Sequence)
    _prefix_every_text_as_sentencepiece(tokenizer)  # a second pass (a cached tokenizer) changes nothing
    assert _ids(tokenizer, " Hello") == ["▁", "▁Hello"]


def test_a_file_whose_metadata_turns_the_prefix_off_is_left_as_it_is():
    tokenizer = _rebuilt("never")
    _prefix_every_text_as_sentencepiece(tokenizer)
    assert tokenizer.backend_tokenizer.normalizer is None
    assert _ids(tokenizer, "Hello") == ["Hello"]
