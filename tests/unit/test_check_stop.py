"""check_stop, the one stop check on token ids: a table of (parameters, newest token, lengths) -> finish.

It sees one token at a time: accepted drafts are checked one by one as they are appended
(tests/unit/test_scheduler_update.py has those rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from engine.core.scheduler import check_stop
from engine.outputs import FINISH_LENGTH, FINISH_STOP
from engine.params import SamplingParams

EOS = 2
OTHER_EOS = 3  # models such as LLaMA 3 end a turn on more than one token
EOS_TOKEN_IDS = (EOS, OTHER_EOS)
MAX_MODEL_LEN = 32
PROMPT_LEN = 10
PLAIN = 50  # a token that is neither EOS nor a stop token
STOP_TOKEN = 7


@dataclass(frozen=True)
class StopCase:
    id: str
    params: SamplingParams
    token_id: int
    num_generated_tokens: int  # including token_id
    expected: tuple[str, int | None] | None
    num_tokens: int | None = None  # prompt + generated; PROMPT_LEN + num_generated_tokens when None
    is_grammar_complete: bool = False


CASES = [
    # EOS
    StopCase("plain_token_goes_on", SamplingParams(max_tokens=16), PLAIN, 1, None),
    StopCase("eos_stops", SamplingParams(max_tokens=16), EOS, 1, (FINISH_STOP, None)),
    StopCase("any_eos_id_stops", SamplingParams(max_tokens=16), OTHER_EOS, 4, (FINISH_STOP, None)),
    StopCase("ignore_eos_goes_on", SamplingParams(max_tokens=16, ignore_eos=True), EOS, 1, None),
    StopCase("eos_on_the_last_allowed_token_is_a_stop", SamplingParams(max_tokens=4), EOS, 4, (FINISH_STOP, None)),
    # stop token ids: the stop reason names the token
    StopCase(
        "stop_token_stops", SamplingParams(stop_token_ids=(STOP_TOKEN,)), STOP_TOKEN, 1, (FINISH_STOP, STOP_TOKEN)
    ),
    StopCase("another_token_goes_on", SamplingParams(stop_token_ids=(STOP_TOKEN,)), PLAIN, 1, None),
    StopCase(
        "stop_token_beats_ignore_eos",
        SamplingParams(stop_token_ids=(EOS,), ignore_eos=True),
        EOS,
        1,
        (FINISH_STOP, EOS),
    ),
    StopCase(
        "stop_token_on_the_last_allowed_token_is_a_stop",
        SamplingParams(max_tokens=4, stop_token_ids=(STOP_TOKEN,)),
        STOP_TOKEN,
        4,
        (FINISH_STOP, STOP_TOKEN),
    ),
    # max_tokens
    StopCase("one_under_max_tokens_goes_on", SamplingParams(max_tokens=4), PLAIN, 3, None),
    StopCase("max_tokens_reached", SamplingParams(max_tokens=4), PLAIN, 4, (FINISH_LENGTH, None)),
    StopCase("max_tokens_passed", SamplingParams(max_tokens=4), PLAIN, 6, (FINISH_LENGTH, None)),
    StopCase(
        "max_tokens_ignores_ignore_eos", SamplingParams(max_tokens=1, ignore_eos=True), EOS, 1, (FINISH_LENGTH, None)
    ),
    # min_tokens: the sampler bans EOS and stop tokens before it, so the check does not repeat that
    StopCase("min_tokens_does_not_hold_eos_back", SamplingParams(min_tokens=5), EOS, 2, (FINISH_STOP, None)),
    StopCase(
        "min_tokens_over_max_tokens_changes_nothing",
        SamplingParams(max_tokens=5, min_tokens=5),
        PLAIN,
        5,
        (FINISH_LENGTH, None),
    ),
    StopCase("under_min_tokens_a_plain_token_goes_on", SamplingParams(min_tokens=5), PLAIN, 2, None),
    # context length (max_model_len): prompt + generated
    StopCase("context_full", SamplingParams(max_tokens=100), PLAIN, 22, (FINISH_LENGTH, None)),
    StopCase("one_under_the_context_goes_on", SamplingParams(max_tokens=100), PLAIN, 21, None),
    StopCase("no_max_tokens_runs_to_the_context", SamplingParams(max_tokens=None), PLAIN, 21, None),
    StopCase("no_max_tokens_ends_at_the_context", SamplingParams(max_tokens=None), PLAIN, 22, (FINISH_LENGTH, None)),
    StopCase("eos_at_the_context_is_a_stop", SamplingParams(max_tokens=100), EOS, 22, (FINISH_STOP, None)),
    # structured output: the grammar allows nothing more
    StopCase("grammar_complete_stops", SamplingParams(), PLAIN, 1, (FINISH_STOP, None), is_grammar_complete=True),
    StopCase(
        "grammar_complete_beats_ignore_eos",
        SamplingParams(ignore_eos=True),
        PLAIN,
        1,
        (FINISH_STOP, None),
        is_grammar_complete=True,
    ),
    StopCase(
        "grammar_complete_on_the_last_allowed_token_is_a_stop",
        SamplingParams(max_tokens=4),
        PLAIN,
        4,
        (FINISH_STOP, None),
        is_grammar_complete=True,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_check_stop(case: StopCase):
    num_tokens = PROMPT_LEN + case.num_generated_tokens if case.num_tokens is None else case.num_tokens
    stop = check_stop(
        case.params,
        case.token_id,
        case.num_generated_tokens,
        num_tokens,
        EOS_TOKEN_IDS,
        MAX_MODEL_LEN,
        is_grammar_complete=case.is_grammar_complete,
    )
    assert stop == case.expected
