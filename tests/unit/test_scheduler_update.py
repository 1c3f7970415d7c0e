"""Scheduler.update at block_size=2, no model: (scheduled batch, emitted tokens) -> sequence state and blocks.

update is the one place sequences advance. Each row puts one running sequence at some progress, schedules
it for num_new tokens (and drafts), hands update what the runner emitted, and checks the tokens, the
computed count, the finish, the table (kept, trimmed or freed) and which of its blocks reached the prefix cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from engine.core.scheduler import ScheduledBatch, Scheduler
from engine.core.sequence import Sequence, SequenceStatus
from engine.outputs import FINISH_LENGTH, FINISH_STOP, EmittedTokens
from engine.params import SamplingParams
from tests.support.scheduling import EOS, MAX_MODEL_LEN, make_scheduler, make_seq, put_running

# Tokens the "runner" emits: 20, 21, ...; prompts are 100, 101, ... and EOS is 2.
STOP_TOKEN = 24


@dataclass(frozen=True)
class UpdateCase:
    id: str
    # the sequence before the step
    num_prompt_tokens: int
    generated: tuple[int, ...]
    num_computed: int
    # the step
    num_new: int  # tokens computed this step, drafts not counted
    emitted: tuple[int, ...] | None  # None: the step does not reach the last token, nothing is sampled
    # the sequence after the step
    expected_generated: tuple[int, ...]
    expected_num_computed: int
    expected_num_blocks: int  # its table length; 0 once finished (all freed)
    expected_num_published: int  # blocks of the step's table that are in the prefix cache afterwards
    expected_finish: tuple[str, int | None] | None = None
    drafts: tuple[int, ...] = ()
    num_draft_slots: int | None = None  # the room the scheduler made; len(drafts) when None
    params: SamplingParams = field(default_factory=lambda: SamplingParams(max_tokens=16))


PLAIN_CASES = [
    # chunked prefill: nothing is sampled until the prompt is done
    UpdateCase("first_chunk_samples_nothing", 7, (), 0, 4, None, (), 4, 2, 2),
    UpdateCase("middle_chunk_samples_nothing", 7, (), 2, 4, None, (), 6, 3, 3),
    UpdateCase("last_chunk_samples", 7, (), 4, 3, (20,), (20,), 7, 4, 3),
    UpdateCase("whole_prompt_at_once", 4, (), 0, 4, (20,), (20,), 4, 2, 2),
    # decodes
    UpdateCase("decode", 4, (20,), 4, 1, (21,), (20, 21), 5, 3, 2),
    UpdateCase("decode_filling_a_block_publishes_it", 4, (20, 21), 5, 1, (22,), (20, 21, 22), 6, 3, 3),
    # finishing: the blocks go back to the pool, the computed full ones stay findable
    UpdateCase("eos_finishes_and_frees", 4, (20,), 4, 1, (EOS,), (20, EOS), 5, 0, 2, (FINISH_STOP, None)),
    UpdateCase(
        "eos_ignored",
        4,
        (20,),
        4,
        1,
        (EOS,),
        (20, EOS),
        5,
        3,
        2,
        params=SamplingParams(max_tokens=16, ignore_eos=True),
    ),
    UpdateCase(
        "stop_token_finishes_and_names_it",
        4,
        (20,),
        4,
        1,
        (STOP_TOKEN,),
        (20, STOP_TOKEN),
        5,
        0,
        2,
        (FINISH_STOP, STOP_TOKEN),
        params=SamplingParams(max_tokens=16, stop_token_ids=(STOP_TOKEN,)),
    ),
    UpdateCase(
        "max_tokens_finishes",
        4,
        (20,),
        4,
        1,
        (21,),
        (20, 21),
        5,
        0,
        2,
        (FINISH_LENGTH, None),
        params=SamplingParams(max_tokens=2),
    ),
    UpdateCase(
        "context_length_finishes",
        MAX_MODEL_LEN - 2,
        (20,),
        MAX_MODEL_LEN - 2,
        1,
        (21,),
        (20, 21),
        MAX_MODEL_LEN - 1,
        0,
        MAX_MODEL_LEN // 2 - 1,
        (FINISH_LENGTH, None),
    ),
    UpdateCase(
        "prompt_done_and_max_tokens_1_finishes_at_once",
        7,
        (),
        4,
        3,
        (20,),
        (20,),
        7,
        0,
        3,
        (FINISH_LENGTH, None),
        params=SamplingParams(max_tokens=1),
    ),
]

# Speculative steps: the sequence (4 prompt tokens and 20, which is not computed yet) verifies drafts.
# Accepted drafts' K/V count and their full blocks are published; blocks past the accepted tokens go back.
SPEC_CASES = [
    UpdateCase(
        "all_drafts_accepted_keep_the_table",
        4,
        (20,),
        4,
        1,
        (21, 22, 23, 30),
        (20, 21, 22, 23, 30),
        8,
        4,
        4,
        drafts=(21, 22, 23),
    ),
    UpdateCase(
        "rejected_drafts_blocks_are_trimmed",
        4,
        (20,),
        4,
        1,
        (30,),
        (20, 30),
        5,
        3,
        2,
        drafts=(21, 22, 23),
    ),
    UpdateCase(
        "some_drafts_accepted",
        3,
        (20,),
        3,
        1,
        (21, 30),
        (20, 21, 30),
        5,
        3,
        2,
        drafts=(21, 22, 23, 24),
    ),
    UpdateCase(
        "slots_the_proposer_left_empty_are_trimmed",
        4,
        (20,),
        4,
        1,
        (21,),
        (20, 21),
        5,
        3,
        2,
        drafts=(),
        num_draft_slots=2,
    ),
    UpdateCase(
        "eos_among_accepted_drafts_cuts_and_frees",
        4,
        (20,),
        4,
        1,
        (21, EOS, 23, 30),
        (20, 21, EOS),
        5,
        0,
        2,
        (FINISH_STOP, None),
        drafts=(21, EOS, 23),
    ),
    UpdateCase(
        "max_tokens_among_accepted_drafts_cuts_and_frees",
        4,
        (20,),
        4,
        1,
        (21, 22, 23, 30),
        (20, 21, 22),
        5,
        0,
        2,
        (FINISH_LENGTH, None),
        drafts=(21, 22, 23),
        params=SamplingParams(max_tokens=3),
    ),
    UpdateCase(
        "stop_token_after_the_accepted_drafts",
        4,
        (20,),
        4,
        1,
        (21, 22, STOP_TOKEN),
        (20, 21, 22, STOP_TOKEN),
        5,
        0,
        2,
        (FINISH_STOP, STOP_TOKEN),
        drafts=(21, 22, 23),
        params=SamplingParams(max_tokens=16, stop_token_ids=(STOP_TOKEN,)),
    ),
    UpdateCase(
        "ignored_eos_drafts_are_kept",
        4,
        (20,),
        4,
        1,
        (EOS, EOS, 30),
        (20, EOS, EOS, 30),
        7,
        4,
        3,
        drafts=(EOS, EOS),
        params=SamplingParams(max_tokens=16, ignore_eos=True),
    ),
]

CASES = PLAIN_CASES + SPEC_CASES


def _schedule_one(
    scheduler: Scheduler, seq: Sequence, num_new: int, drafts: list[int], num_slots: int
) -> ScheduledBatch:
    """The batch the scheduler would hand the runner: room for num_new tokens and num_slots drafts, drafts set."""
    assert scheduler.kv_manager.grow(seq, seq.num_computed_tokens + num_new + num_slots)
    batch = ScheduledBatch([seq], [num_new], [num_slots])
    batch.set_drafts([drafts])
    return batch


def _emitted(tokens: tuple[int, ...], num_drafts: int) -> EmittedTokens:
    return EmittedTokens(list(tokens), [None] * len(tokens), num_accepted_drafts=min(len(tokens) - 1, num_drafts))


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_update(case: UpdateCase):
    scheduler = make_scheduler()
    pool = scheduler.kv_manager.pool
    seq = put_running(scheduler, make_seq(case.num_prompt_tokens, case.generated, case.params), case.num_computed)
    num_slots = len(case.drafts) if case.num_draft_slots is None else case.num_draft_slots
    batch = _schedule_one(scheduler, seq, case.num_new, list(case.drafts), num_slots)
    assert batch.is_sampling(0) == (case.emitted is not None)
    step_table = list(seq.block_table)

    emitted = [] if case.emitted is None else [_emitted(case.emitted, len(case.drafts))]
    appended = scheduler.update(batch, emitted)

    num_appended = len(case.expected_generated) - len(case.generated)
    assert appended == ([] if case.emitted is None else [(seq, num_appended)])
    assert seq.token_ids == seq.prompt_token_ids + list(case.expected_generated)
    assert seq.num_computed_tokens == case.expected_num_computed
    assert (seq.finish_reason, seq.stop_reason) == (case.expected_finish or (None, None))
    assert seq.is_finished == (case.expected_finish is not None)
    assert (seq in scheduler.running) == (not seq.is_finished)
    # kept blocks are a prefix of the step's table; the rest (trimmed or freed) are back in the pool
    assert seq.block_table == step_table[: case.expected_num_blocks]
    assert pool.num_used_blocks == case.expected_num_blocks
    assert [pool.ref_count(block) for block in step_table[case.expected_num_blocks :]] == [0] * (
        len(step_table) - case.expected_num_blocks
    )
    assert sum(pool.holds_cached_prefix(block) for block in step_table) == case.expected_num_published
    assert all(pool.holds_cached_prefix(block) for block in step_table[: case.expected_num_published])


def test_emitted_tokens_go_to_the_sampling_sequences_in_batch_order():
    scheduler = make_scheduler()
    chunking = put_running(scheduler, make_seq(9), 0)
    decoding = put_running(scheduler, make_seq(4, (20,)), 4)
    finishing = put_running(scheduler, make_seq(4, (20,)), 4)
    speculating = put_running(scheduler, make_seq(4, (20,)), 4)
    for seq, room in ((chunking, 4), (decoding, 1), (finishing, 1), (speculating, 4)):
        assert scheduler.kv_manager.grow(seq, seq.num_computed_tokens + room)
    batch = ScheduledBatch([chunking, decoding, finishing, speculating], [4, 1, 1, 1], [0, 0, 0, 3])
    batch.set_drafts([[], [], [], [21, 22, 23]])
    assert [batch.is_sampling(i) for i in range(4)] == [False, True, True, True]

    appended = scheduler.update(batch, [_emitted((21,), 0), _emitted((EOS,), 0), _emitted((21, 30), 3)])

    assert appended == [(decoding, 1), (finishing, 1), (speculating, 2)]
    assert chunking.token_ids == chunking.prompt_token_ids and chunking.num_computed_tokens == 4
    assert decoding.token_ids[4:] == [20, 21] and decoding.num_computed_tokens == 5
    assert finishing.finish_reason == FINISH_STOP and finishing.block_table == []
    assert speculating.token_ids[4:] == [20, 21, 30] and speculating.num_computed_tokens == 6
    assert len(speculating.block_table) == 4  # 7 tokens; the trim gives back nothing of 4 blocks
    assert scheduler.running == [chunking, decoding, speculating]
    assert scheduler.kv_manager.pool.num_used_blocks == 2 + 3 + 4


def test_one_emitted_entry_per_sampling_sequence_is_required():
    scheduler = make_scheduler()
    seq = put_running(scheduler, make_seq(4, (20,)), 4)
    batch = _schedule_one(scheduler, seq, 1, [], 0)
    with pytest.raises(ValueError):
        scheduler.update(batch, [])


class _ClosingGrammar:
    """A grammar matcher stand-in: complete once it has consumed `closing`."""

    def __init__(self, closing: int) -> None:
        self.closing = closing
        self.consumed: list[int] = []

    def consume_token(self, token_id: int) -> None:
        self.consumed.append(token_id)

    def is_stopped(self) -> bool:
        return self.closing in self.consumed


@pytest.mark.parametrize(
    ("drafts", "emitted", "expected_consumed", "expected_finish"),
    [
        pytest.param([], (21,), [21], None, id="decode_goes_on"),
        pytest.param([], (STOP_TOKEN,), [STOP_TOKEN], FINISH_STOP, id="decode_closes"),
        pytest.param([21, STOP_TOKEN, 23], (21, STOP_TOKEN, 23, 30), [21, STOP_TOKEN], FINISH_STOP, id="draft_closes"),
        pytest.param([21, 22], (21, 22, 30), [21, 22, 30], None, id="drafts_go_on"),
    ],
)
def test_the_grammar_sees_each_appended_token_and_its_completion_ends_the_sequence(
    drafts, emitted, expected_consumed, expected_finish
):
    scheduler = make_scheduler()
    seq = put_running(scheduler, make_seq(4, (20,)), 4)
    seq.matcher = _ClosingGrammar(STOP_TOKEN)
    batch = _schedule_one(scheduler, seq, 1, drafts, len(drafts))
    scheduler.update(batch, [_emitted(emitted, len(drafts))])
    assert seq.matcher.consumed == expected_consumed
    assert seq.finish_reason == expected_finish
    assert seq.status is (SequenceStatus.FINISHED if expected_finish else SequenceStatus.RUNNING)
