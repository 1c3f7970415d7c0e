"""Incremental detokenization: whole UTF-8 deltas, stop strings across tokens."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.llm import LLM
from engine.params import SamplingParams
from engine.text.detokenizer import IncrementalDetokenizer
from engine.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir) -> Tokenizer:
    return Tokenizer.from_path(tiny_llama_dir)


def _stream(tokenizer, text: str, params: SamplingParams) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("Hello"), params)
    deltas = []
    for num_generated, token in enumerate(tokenizer.encode(text, add_special_tokens=False), start=1):
        stopped = detokenizer.add_token(token, num_generated) is not None
        deltas.append(detokenizer.take_new_text(is_finished=stopped))
        if stopped:
            break
    return deltas


def test_multibyte_characters_arrive_whole(tokenizer):
    text = " 東京は日本の首都です。 Emoji 🙂 élèves"
    deltas = _stream(tokenizer, text, SamplingParams())
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens_is_cut(tokenizer, include):
    text = " the quick brown fox jumps over the lazy dog"
    params = SamplingParams(stop=["fox jum"], include_stop_str_in_output=include)
    deltas = _stream(tokenizer, text, params)
    expected = " the quick brown fox jum" if include else " the quick brown "
    assert "".join(deltas) == expected
    # Nothing of the stop string leaked before it was recognised.
    assert all("fox" not in d for d in deltas[:-1])


def test_engine_reports_stop_reason(tiny_llama_dir):
    engine = LLM.from_config(EngineConfig(model=tiny_llama_dir))
    prompt = engine.tokenizer.encode("Hello world")
    free = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0][0]
    # A 3-character stop string from the middle of the free-running text (random weights: skip broken bytes).
    starts = [i for i in range(3, len(free.text) - 3) if "\ufffd" not in free.text[i : i + 3]]
    assert starts
    stop = free.text[starts[0] : starts[0] + 3]
    stopped = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop]))
    result = stopped[0][0]
    assert result.finish_reason == "stop"
    assert result.text == free.text[: free.text.index(stop)]


def test_stop_strings_wait_for_min_tokens(tokenizer):
    params = SamplingParams(stop=["quick"], min_tokens=100, max_tokens=200)
    deltas = _stream(tokenizer, " the quick brown fox", params)
    assert "".join(deltas) == " the quick brown fox"
