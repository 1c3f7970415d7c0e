"""Incremental detokenization: whole UTF-8 deltas, stop strings across tokens."""

from __future__ import annotations

import random

import pytest

from engine.config import EngineConfig
from engine.llm import LLM
from engine.params import SamplingParams
from engine.text.detokenizer import IncrementalDetokenizer, StopStringMatcher
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


# ---- the stop-string matcher against the plain reference ----


class _PieceTokenizer:
    """Each token id decodes to a fixed piece of text, so the detokenizer's text deltas are the pieces."""

    PIECES = ("a", "b", "c", "ab", "ba", "abc", "aab", "cab", "bb", "abab")

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.PIECES[t] for t in token_ids)


class _ReferenceStopText:
    """The plain stop-string rules: after each new piece, look for a stop string overlapping it with
    `str.find`, and hold back the longest tail that is a proper prefix of some stop string, found by
    trying every prefix length."""

    def __init__(self, params: SamplingParams) -> None:
        self._params = params
        self._num_emitted_chars = 0
        self.output_text = ""

    def add_text(self, new_text: str, num_generated_tokens: int) -> str | None:
        self.output_text += new_text
        if not self._params.stop or num_generated_tokens < self._params.min_tokens:
            return None
        text = self.output_text
        for stop in self._params.stop:
            start = max(0, len(text) - len(new_text) - len(stop) + 1)
            position = text.find(stop, start)
            if position != -1:
                end = position + len(stop) if self._params.include_stop_str_in_output else position
                self.output_text = text[:end]
                return stop
        return None

    def take_new_text(self, is_finished: bool) -> str:
        end = len(self.output_text)
        if not is_finished and self._params.stop:
            longest = 0
            for stop in self._params.stop:
                for k in range(min(len(stop) - 1, len(self.output_text)), longest, -1):
                    if self.output_text.endswith(stop[:k]):
                        longest = k
                        break
            end -= longest
        if end <= self._num_emitted_chars:
            return ""
        delta = self.output_text[self._num_emitted_chars : end]
        self._num_emitted_chars = end
        return delta


def _random_case(rng: random.Random) -> tuple[list[int], SamplingParams]:
    tokens = [rng.randrange(len(_PieceTokenizer.PIECES)) for _ in range(rng.randint(0, 30))]
    stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 7))) for _ in range(rng.randint(1, 4))]
    params = SamplingParams(
        stop=stops,
        include_stop_str_in_output=rng.random() < 0.5,
        min_tokens=rng.choice([0, 0, 1, 3, 8]),
        max_tokens=64,
    )
    return tokens, params


def test_stop_matcher_equals_the_reference_on_random_texts():
    """Emitted deltas, the stop decision and the final text match the reference, step by step."""
    rng = random.Random(1234)
    tokenizer = _PieceTokenizer()
    num_stopped = num_held_back = 0
    for _ in range(3000):
        tokens, params = _random_case(rng)
        ours = IncrementalDetokenizer(tokenizer, [], params)
        reference = _ReferenceStopText(params)
        emitted = ""
        for num_generated, token in enumerate(tokens, start=1):
            stop = ours.add_token(token, num_generated)
            assert stop == reference.add_text(tokenizer.PIECES[token], num_generated), (tokens, params)
            finished = stop is not None or num_generated == len(tokens)
            delta = ours.take_new_text(finished)
            assert delta == reference.take_new_text(finished), (tokens, params)
            emitted += delta
            num_held_back += len(emitted) < len(ours.output_text)
            if stop is not None:
                num_stopped += 1
                break
        assert ours.output_text == reference.output_text == emitted
    # The cases exercise both outcomes, and text held back while it could begin a stop string.
    assert num_stopped > 500 and num_held_back > 500


def test_held_back_text_is_released_once_it_cannot_begin_a_stop_string():
    matcher = StopStringMatcher(("abcabd",))
    assert matcher.feed("xxabcab", counts=True) is None
    assert matcher.held_back_length() == 5  # "abcab" may still become "abcabd"
    assert matcher.feed("c", counts=True) is None
    assert matcher.held_back_length() == 3  # "abcabc": only "abc" may still begin it
    assert matcher.feed("abd!", counts=True) == (3, "abcabd")


def test_matches_before_min_tokens_are_passed_over_and_overlapping_ones_found():
    matcher = StopStringMatcher(("aa",))
    assert matcher.feed("aa", counts=False) is None
    assert matcher.held_back_length() == 1  # the last "a" may begin a new match
    assert matcher.feed("a", counts=True) == (1, "aa")  # "aaa": the overlapping match counts now


def test_the_first_stop_string_in_order_wins():
    assert StopStringMatcher(("cd", "ab")).feed("abcd", counts=True) == (4, "cd")


def test_stop_strings_benchmark_prints_one_row_per_text(capsys):
    from engine.bench import stop_strings

    assert stop_strings.main(["--num-tokens", "50", "--repeats", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == 3 and "20,000-char stop" in rows[0]
