"""Scheduler.schedule() at block_size=2, no model: token budget, chunking, sequence cap, preemption, counters."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from engine.core.block_pool import BlockPool
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.scheduler import ScheduledBatch, Scheduler, StepCounters
from engine.core.sequence import Sequence, SequenceStatus
from engine.outputs import FINISH_STOP, EmittedTokens
from engine.params import SamplingParams

SAMPLED_TOKEN = 7
_seq_ids = itertools.count()


def _scheduler(
    num_blocks: int = 64, max_num_seqs: int = 8, max_num_batched_tokens: int = 64, prefix_caching: bool = False
) -> Scheduler:
    manager = KVCacheManager.single(BlockPool(num_blocks, prefix_caching), 2, None)
    return Scheduler(manager, max_num_seqs, max_num_batched_tokens, eos_token_ids=(), max_model_len=10_000)


def _seq(num_prompt_tokens: int, parent: Sequence | None = None) -> Sequence:
    return Sequence(
        seq_id=next(_seq_ids),
        request_id="r",
        index=0 if parent is None else 1,
        prompt_token_ids=list(range(100, 100 + num_prompt_tokens)),
        params=SamplingParams(max_tokens=1000, ignore_eos=True),
        arrival_time=0.0,
        parent=parent,
    )


def _add(scheduler: Scheduler, *num_prompt_tokens: int) -> list[Sequence]:
    seqs = [_seq(n) for n in num_prompt_tokens]
    for seq in seqs:
        scheduler.add(seq)
    return seqs


def _run(scheduler: Scheduler, batch: ScheduledBatch) -> None:
    """What the engine does once the model ran: advance progress, append a token where one was sampled."""
    num_sampled = sum(batch.is_sampling(i) for i in range(len(batch.seqs)))
    scheduler.update(batch, [EmittedTokens([SAMPLED_TOKEN], [None]) for _ in range(num_sampled)])


def _plan(batch: ScheduledBatch) -> list[tuple[Sequence, int]]:
    return list(zip(batch.seqs, batch.num_new_tokens))


def test_the_token_budget_is_split_in_arrival_order():
    scheduler = _scheduler(max_num_batched_tokens=10)
    a, b, c = _add(scheduler, 6, 6, 6)
    batch = scheduler.schedule()
    assert _plan(batch) == [(a, 6), (b, 4)]
    assert batch.num_tokens == 10
    assert scheduler.waiting[0] is c


def test_running_sequences_are_served_before_waiting_ones():
    scheduler = _scheduler(max_num_batched_tokens=10)
    a, b = _add(scheduler, 3, 3)
    _run(scheduler, scheduler.schedule())  # both prompts computed, one token sampled each
    (c,) = _add(scheduler, 20)
    batch = scheduler.schedule()
    assert _plan(batch) == [(a, 1), (b, 1), (c, 8)]
    assert [batch.is_sampling(i) for i in range(3)] == [True, True, False]


def test_a_long_prompt_is_prefilled_in_chunks():
    scheduler = _scheduler(max_num_batched_tokens=4)
    (seq,) = _add(scheduler, 10)
    chunks = []
    for _ in range(3):
        batch = scheduler.schedule()
        chunks.append((batch.num_new_tokens, batch.is_sampling(0)))
        _run(scheduler, batch)
    assert chunks == [([4], False), ([4], False), ([2], True)]
    assert seq.num_computed_tokens == 10 and seq.num_generated_tokens == 1
    assert scheduler.schedule().num_new_tokens == [1]  # then it decodes


def test_max_num_seqs_caps_the_running_set():
    scheduler = _scheduler(max_num_seqs=2)
    a, b, c = _add(scheduler, 2, 2, 2)
    batch = scheduler.schedule()
    assert batch.seqs == [a, b]
    assert c.status is SequenceStatus.WAITING
    _run(scheduler, batch)
    assert scheduler.schedule().seqs == [a, b]
    scheduler.finish(a, "stop")
    assert scheduler.schedule().seqs == [b, c]


def test_the_newest_running_sequence_is_preempted_and_waits_in_front():
    scheduler = _scheduler(num_blocks=7)  # 6 usable blocks of 2 tokens
    a, b, c = _add(scheduler, 4, 4, 4)
    batch = scheduler.schedule()
    assert batch.seqs == [a, b, c]
    assert scheduler.kv_manager.pool.num_free_blocks == 0
    _run(scheduler, batch)  # each now holds 5 tokens: its next step needs a third block
    (d,) = _add(scheduler, 2)

    batch = scheduler.schedule()
    assert _plan(batch) == [(a, 1), (b, 1)]
    assert scheduler.counters.num_preemptions == 1
    assert scheduler.running == [a, b]
    assert list(scheduler.waiting) == [c, d]
    assert c.status is SequenceStatus.WAITING
    assert c.num_computed_tokens == 0 and c.block_table == []
    assert c.token_ids[-1] == SAMPLED_TOKEN  # keeps its tokens: it recomputes them all when readmitted


def test_a_sequence_that_can_never_fit_is_an_error():
    scheduler = _scheduler(num_blocks=4)  # 3 usable blocks: 6 tokens
    _add(scheduler, 10)
    with pytest.raises(RuntimeError, match="cannot hold one sequence of 10 tokens"):
        scheduler.schedule()


def _token_counts(counters: StepCounters) -> tuple[int, int, int, int]:
    """(prompt tokens computed, prompts counted, of those cached, tokens generated)."""
    c = counters
    return c.num_computed_prompt_tokens, c.num_prompt_tokens, c.num_cached_prompt_tokens, c.num_generation_tokens


def test_the_counters_count_a_prompt_once_whole_and_every_token_computed():
    scheduler = _scheduler(num_blocks=7, max_num_batched_tokens=4, prefix_caching=True)
    counters = scheduler.counters
    (first,) = _add(scheduler, 6)
    _run(scheduler, scheduler.schedule())  # 4 of its 6 prompt tokens
    assert _token_counts(counters) == (4, 0, 0, 0)
    _run(scheduler, scheduler.schedule())  # the last 2, then its first token
    assert _token_counts(counters) == (6, 6, 0, 1)
    scheduler.finish(first, FINISH_STOP)

    _add(scheduler, 6)  # the same prompt: its first two blocks come from the prefix cache
    _run(scheduler, scheduler.schedule())
    assert (counters.prefix_cache_queries, counters.prefix_cache_hits) == (12, 4)
    assert _token_counts(counters) == (8, 12, 4, 2)
    _run(scheduler, scheduler.schedule())  # a decode: no prompt token
    assert _token_counts(counters) == (8, 12, 4, 3)


def test_steps_counted_into_other_counters_leave_the_usual_ones_as_they_were():
    scheduler = _scheduler()
    before = dataclasses.replace(scheduler.counters)
    with scheduler.counting_into(StepCounters()) as scratch:
        _add(scheduler, 5)
        _run(scheduler, scheduler.schedule())
    assert (scratch.num_prompt_tokens, scratch.num_generation_tokens, scratch.prefix_cache_queries) == (5, 1, 5)
    assert scheduler.counters == before
    _run(scheduler, scheduler.schedule())
    assert scheduler.counters.num_generation_tokens == 1 and scheduler.counters.num_prompt_tokens == 0


def test_later_samples_wait_for_the_first_and_take_its_cached_prompt():
    scheduler = _scheduler(max_num_batched_tokens=4, prefix_caching=True)
    first = _seq(7)
    second = _seq(7, parent=first)
    scheduler.add(first)
    scheduler.add(second)
    batch = scheduler.schedule()
    assert batch.seqs == [first]  # second waits: the shared prompt blocks are not computed yet
    _run(scheduler, batch)
    batch = scheduler.schedule()
    assert _plan(batch) == [(first, 3)]
    _run(scheduler, batch)
    batch = scheduler.schedule()
    assert _plan(batch) == [(first, 1), (second, 1)]  # 6 of its 7 prompt tokens came from the cache
    assert second.block_table[:3] == first.block_table[:3]


def _scored_seq(num_prompt_tokens: int) -> Sequence:
    return Sequence(
        seq_id=next(_seq_ids),
        request_id="scored",
        index=0,
        prompt_token_ids=list(range(100, 100 + num_prompt_tokens)),
        params=SamplingParams(max_tokens=1000, ignore_eos=True, prompt_logprobs=5),
        arrival_time=0.0,
    )


def _run_scoring(scheduler: Scheduler, batch: ScheduledBatch) -> None:
    """_run, and every prompt row the runner would score handed back as a logprob."""
    from engine.outputs import TokenLogprob
    from engine.runner.prompt_logprobs import prompt_rows

    scored = {
        part.seq: [TokenLogprob(token_id=1, logprob=-1.0, top=[], rank=1) for _ in range(part.count)]
        for part in prompt_rows(batch)
    }
    num_sampled = sum(batch.is_sampling(i) for i in range(len(batch.seqs)))
    scheduler.update(batch, [EmittedTokens([SAMPLED_TOKEN], [None]) for _ in range(num_sampled)], scored)


def test_scored_prompt_rows_are_capped_per_step_and_others_go_on(monkeypatch):
    import engine.core.scheduler as scheduler_module

    monkeypatch.setattr(scheduler_module, "PROMPT_LOGPROB_ROWS_PER_STEP", 8)
    scheduler = _scheduler(num_blocks=256, max_num_batched_tokens=64)
    a, b = _scored_seq(40), _scored_seq(40)
    scheduler.add(a)
    scheduler.add(b)
    (c,) = _add(scheduler, 5)  # a plain request behind two long scored prompts
    batch = scheduler.schedule()
    assert _plan(batch) == [(a, 8), (c, 5)]  # b waits for the next step's rows; c is not held back
    for _ in range(20):
        _run_scoring(scheduler, batch)
        batch = scheduler.schedule()
        scored_rows = sum(n for seq, n in _plan(batch) if seq.needs_prompt_logprobs)
        assert scored_rows <= 8
        assert (c, 1) in _plan(batch)  # the plain request decodes in every step
    assert [len(a.prompt_logprobs), len(b.prompt_logprobs)] == [39, 39]  # both scored in full, a first


def _request(num_prompt_tokens: int, request_id: str) -> Sequence:
    return dataclasses.replace(_seq(num_prompt_tokens), seq_id=next(_seq_ids), request_id=request_id)


def test_a_long_prompt_beside_other_requests_takes_at_most_the_threshold_a_step():
    manager = KVCacheManager.single(BlockPool(256, False), 2, None)
    scheduler = Scheduler(manager, 8, 64, eos_token_ids=(), max_model_len=10_000, long_prefill_token_threshold=16)
    decoding = _request(3, "decoding")
    scheduler.add(decoding)
    _run(scheduler, scheduler.schedule())  # its prompt computed: it decodes from now on
    long_prompt, short_prompt = _request(100, "long"), _request(20, "short")
    scheduler.add(long_prompt)
    scheduler.add(short_prompt)
    # Capped per sequence, and the rest of the budget goes to the next in line.
    assert _plan(scheduler.schedule()) == [(decoding, 1), (long_prompt, 16), (short_prompt, 16)]


def test_a_request_alone_keeps_the_whole_budget_and_zero_is_no_cap():
    for threshold, others in ((16, False), (0, True)):
        manager = KVCacheManager.single(BlockPool(256, False), 2, None)
        scheduler = Scheduler(
            manager, 8, 64, eos_token_ids=(), max_model_len=10_000, long_prefill_token_threshold=threshold
        )
        long_prompt = _request(100, "long")
        scheduler.add(long_prompt)
        # Samples of the same request are the same request.
        scheduler.add(dataclasses.replace(_seq(100, parent=long_prompt), request_id="long"))
        if others:
            scheduler.add(_request(3, "other"))
        assert _plan(scheduler.schedule())[0] == (long_prompt, 64)
