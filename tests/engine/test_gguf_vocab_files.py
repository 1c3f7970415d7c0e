"""The tokenizer kvserve reads from a GGUF file against the models' own tokenizers, on llama.cpp's tokenizer test
set: llama.cpp ships, for each vocabulary kind, a vocabulary-only GGUF, test texts (`.inp`) and the token ids the
original Hugging Face tokenizer gives them (`.out`, no special tokens added).

Two of them differ as transformers rebuilds them, and kvserve reads them as the models' own tokenizers do: a
SentencePiece file (`llama-spm`: Llama 2, Mistral) gets its "▁" prefix on every text (15 of 47 texts differed:
those starting with a space), and a Llama 3 file (`llama-bpe`) takes a word its vocabulary holds whole ("Cửa Việt"
was five tokens, not three).

Runs where llama.cpp's source is unpacked (scripts/build_llama_cpp.sh); skipped elsewhere."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.text.tokenizer import Tokenizer

VOCABS = Path(__file__).resolve().parents[2] / "third_party" / "llama.cpp" / "models"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not VOCABS.is_dir(), reason="llama.cpp's source not unpacked (scripts/build_llama_cpp.sh)"),
]

# The vocabulary kinds of the architectures kvserve serves: Llama 2 / Mistral, Llama 3, Qwen2 / Qwen3, Phi-3, GPT-2
VOCABULARIES = ["llama-spm", "llama-bpe", "qwen2", "phi-3", "gpt-2"]


def _cases(vocab: str) -> list[tuple[str, list[int]]]:
    texts = (VOCABS / f"ggml-vocab-{vocab}.gguf.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    ids = (VOCABS / f"ggml-vocab-{vocab}.gguf.out").read_text(encoding="utf-8").split("\n")
    return [(text, [int(i) for i in line.split()]) for text, line in zip(texts, ids, strict=False)]


@pytest.mark.parametrize("vocab", VOCABULARIES)
def test_a_gguf_files_tokenizer_encodes_as_the_models_own(vocab):
    tokenizer = Tokenizer.from_path(VOCABS / f"ggml-vocab-{vocab}.gguf")
    cases = _cases(vocab)
    assert len(cases) >= 40
    differ = {text for text, expected in cases if tokenizer.encode(text, add_special_tokens=False) != expected}
    assert not differ
