"""Incremental detokenization: whole UTF-8 deltas, stop strings across tokens."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.core.sequence import Sequence
from engine.params import SamplingParams
from engine.text.detokenizer import append_token_text, find_stop_string, take_new_text
from engine.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir) -> Tokenizer:
    return Tokenizer.from_path(tiny_llama_dir)


def _stream(tokenizer, text: str, params: SamplingParams) -> tuple[list[str], Sequence]:
    prompt = tokenizer.encode("Hello")
    seq = Sequence(0, "r", 0, prompt, params, 0.0)
    deltas = []
    for token in tokenizer.encode(text, add_special_tokens=False):
        seq.token_ids.append(token)
        before = len(seq.output_text)
        append_token_text(tokenizer, seq)
        if params.stop and find_stop_string(seq, len(seq.output_text) - before):
            from engine.core.sequence import SequenceStatus

            seq.status = SequenceStatus.FINISHED
            deltas.append(take_new_text(seq))
            break
        deltas.append(take_new_text(seq))
    return deltas, seq


def test_multibyte_characters_arrive_whole(tokenizer):
    text = " 東京は日本の首都です。 Emoji 🙂 élèves"
    deltas, _ = _stream(tokenizer, text, SamplingParams())
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens_is_cut(tokenizer, include):
    text = " the quick brown fox jumps over the lazy dog"
    params = SamplingParams(stop=["fox jum"], include_stop_str_in_output=include)
    deltas, seq = _stream(tokenizer, text, params)
    expected = " the quick brown fox jum" if include else " the quick brown "
    assert "".join(deltas) == expected
    # Nothing of the stop string leaked before it was recognised.
    assert all("fox" not in d for d in deltas[:-1])


def test_engine_reports_stop_reason(tiny_llama_dir):
    engine = LLMEngine.from_config(EngineConfig(model=tiny_llama_dir))
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
