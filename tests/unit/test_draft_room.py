"""Room for draft tokens at block_size=2, no model: the slots and blocks schedule() gives a speculating decode.

After the running sequences are scheduled, each decoding one gets the draft slots plan_drafts asks for, as far
as the token budget and the free blocks allow: room for drafts never preempts anyone. Rejected drafts' blocks
go back in Scheduler.update (tests/unit/test_scheduler_update.py) and the next step makes room again.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from engine.config import cdiv
from engine.core.sequence import Sequence, SequenceStatus
from engine.outputs import EmittedTokens
from tests.support.scheduling import BLOCK_SIZE, make_scheduler, make_seq, put_running

PROMPT_LEN = 4


def _plan_every(num_drafts: int):
    """plan_drafts asking num_drafts for every candidate."""
    return lambda candidates, num_seqs: [num_drafts] * len(candidates)


def _decoding(scheduler, num_generated: int) -> Sequence:
    """A running sequence of PROMPT_LEN prompt tokens and num_generated tokens, all computed but the newest."""
    seq = make_seq(PROMPT_LEN, range(20, 20 + num_generated))
    return put_running(scheduler, seq, len(seq.token_ids) - 1)


@dataclass(frozen=True)
class RoomCase:
    id: str
    num_generated: int  # the sequence holds PROMPT_LEN + num_generated tokens, the newest not computed
    planned: int  # drafts plan_drafts asks for
    num_spare_blocks: int  # free blocks once the decode itself has its blocks
    budget: int  # max_num_batched_tokens
    expected_slots: int
    expected_num_blocks: int


ROOM_CASES = [
    RoomCase("room_for_every_planned_draft", 1, 3, 8, 64, 3, 4),
    RoomCase("nothing_planned_nothing_given", 1, 0, 8, 64, 0, 3),
    RoomCase("the_current_block_holds_a_draft_without_a_free_block", 1, 3, 0, 64, 1, 3),
    RoomCase("a_full_block_and_no_free_one_holds_no_draft", 2, 3, 0, 64, 0, 3),
    RoomCase("one_free_block_holds_two_drafts", 2, 3, 1, 64, 2, 4),
    RoomCase("the_token_budget_caps_the_drafts", 1, 5, 8, 3, 2, 4),
    RoomCase("a_budget_spent_on_the_decode_leaves_no_draft", 1, 3, 8, 1, 0, 3),
]


@pytest.mark.parametrize("case", ROOM_CASES, ids=[case.id for case in ROOM_CASES])
def test_draft_room(case: RoomCase):
    num_tokens = PROMPT_LEN + case.num_generated
    num_blocks = 1 + cdiv(num_tokens, BLOCK_SIZE) + case.num_spare_blocks  # block 0 is the null block
    scheduler = make_scheduler(num_blocks, max_num_batched_tokens=case.budget, plan_drafts=_plan_every(case.planned))
    seq = _decoding(scheduler, case.num_generated)
    table_before = list(seq.block_table)

    batch = scheduler.schedule()

    assert batch.seqs == [seq]
    assert batch.num_new_tokens == [1]  # drafts join the batch only once proposed
    assert batch.num_draft_slots == [case.expected_slots]
    assert len(seq.block_table) == case.expected_num_blocks
    assert seq.block_table[: len(table_before)] == table_before  # grown, never replaced
    assert len(seq.block_table) * BLOCK_SIZE >= seq.num_computed_tokens + 1 + case.expected_slots
    assert scheduler.running == [seq] and not scheduler.waiting  # nobody preempted


def test_without_a_planner_there_is_no_room():
    scheduler = make_scheduler(plan_drafts=None)
    seq = _decoding(scheduler, 1)
    batch = scheduler.schedule()
    assert batch.num_draft_slots == [0]
    assert len(seq.block_table) == 3


def test_only_decoding_sequences_are_candidates():
    seen: list[tuple[list[Sequence], int]] = []

    def plan(candidates: list[Sequence], num_seqs: int) -> list[int]:
        seen.append((list(candidates), num_seqs))
        return [2] * len(candidates)

    scheduler = make_scheduler(plan_drafts=plan)
    decoding = _decoding(scheduler, 1)
    prefilling = put_running(scheduler, make_seq(8), 2)  # 6 prompt tokens to go: a chunk, not a decode
    batch = scheduler.schedule()
    assert seen == [([decoding], 2)]
    assert batch.seqs == [decoding, prefilling]
    assert batch.num_draft_slots == [2, 0]
    assert [len(decoding.block_table), len(prefilling.block_table)] == [4, 4]  # 4 + 1 + 2 and 8 positions


def test_room_for_drafts_never_preempts():
    # Two decodes of 6 tokens hold 3 blocks each; one block is spare.
    scheduler = make_scheduler(1 + 3 + 3 + 1, plan_drafts=_plan_every(3))
    older = _decoding(scheduler, 2)
    newer = _decoding(scheduler, 2)
    batch = scheduler.schedule()
    assert batch.seqs == [older, newer]
    assert batch.num_draft_slots == [2, 0]  # the spare block goes to the older; the newer decodes plainly
    assert [len(older.block_table), len(newer.block_table)] == [4, 3]
    assert scheduler.running == [older, newer] and not scheduler.waiting  # nobody preempted
    assert [older.num_computed_tokens, newer.num_computed_tokens] == [5, 5]
    assert scheduler.kv_manager.pool.num_free_blocks == 0


def test_draft_slots_come_out_of_the_budget_before_waiting_prompts():
    scheduler = make_scheduler(max_num_batched_tokens=8, plan_drafts=_plan_every(3))
    decoding = _decoding(scheduler, 1)
    waiting = make_seq(10)
    scheduler.add(waiting)
    batch = scheduler.schedule()
    assert batch.seqs == [decoding, waiting]
    assert batch.num_new_tokens == [1, 4]  # 8 - 1 decode - 3 draft slots
    assert batch.num_draft_slots == [3, 0]


def test_rejected_drafts_blocks_go_back_and_the_next_step_makes_room_again():
    scheduler = make_scheduler(plan_drafts=_plan_every(3))
    pool = scheduler.kv_manager.pool
    seq = _decoding(scheduler, 1)  # 5 tokens, 4 computed

    batch = scheduler.schedule()
    assert batch.num_draft_slots == [3]
    table = list(seq.block_table)
    assert len(table) == 4  # 4 + 1 + 3 positions
    batch.set_drafts([[21, 22, 23]])
    assert batch.num_new_tokens == [4]
    scheduler.update(batch, [EmittedTokens([30], [None], num_accepted_drafts=0)])  # every draft rejected

    assert seq.token_ids[PROMPT_LEN:] == [20, 30] and seq.num_computed_tokens == 5
    assert seq.block_table == table[:3]  # 6 tokens: the fourth block held only rejected drafts
    assert pool.ref_count(table[3]) == 0 and not pool.holds_cached_prefix(table[3])

    batch = scheduler.schedule()
    assert batch.num_draft_slots == [3]
    # 5 + 1 + 3 positions: 5 blocks; the trimmed block held nothing reusable and is handed out first
    assert seq.block_table[:4] == table and len(seq.block_table) == 5
    assert seq.status is SequenceStatus.RUNNING
