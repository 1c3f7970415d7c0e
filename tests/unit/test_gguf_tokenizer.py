"""Where transformers' rebuild of a GGUF's tokenizer differs from the model's own, kvserve's reading follows the
model's (and llama.cpp's): a SentencePiece file's "▁" prefix goes on every text, even one that starts with a space;
a Llama 3 file's BPE takes a word its vocabulary holds whole. Held on llama.cpp's real vocabulary files in
tests/engine/test_gguf_vocab_files.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from engine.text.tokenizer import _prefix_every_text_as_sentencepiece, _take_whole_words

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


def _gguf_naming(path: Path, pre_tokenizer: str) -> Path:
    """A GGUF holding only its metadata, with `tokenizer.ggml.pre` set."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_string("tokenizer.ggml.pre", pre_tokenizer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(("pre_tokenizer", "expected"), [("llama-bpe", ["abc"]), ("gpt-2", ["ab", "c"])])
def test_a_llama_3_files_bpe_takes_a_word_its_vocabulary_holds_whole(tmp_path, pre_tokenizer, expected):
    """Llama 3's tokenizer takes " Việt" whole although its merges do not build it (`ignore_merges`); here "abc"."""
    tokens = ["a", "b", "c", "ab", "abc"]
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=RustTokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, [("a", "b")]))
    )
    assert [tokens[i] for i in tokenizer.encode("abc", add_special_tokens=False)] == ["ab", "c"]
    _take_whole_words(tokenizer, _gguf_naming(tmp_path / "vocab.gguf", pre_tokenizer))
    assert [tokens[i] for i in tokenizer.encode("abc", add_special_tokens=False)] == expected
