"""Token-budget scheduler: continuous batching without prefill/decode phases.

Every step each scheduled sequence catches `num_computed_tokens` up towards
`len(token_ids)`, within a token budget and a sequence cap. A long prompt is
therefore chunked over steps, a decode costs one token, and a preempted
sequence (blocks freed, num_computed_tokens reset) simply recomputes. Running
sequences go first so decodes are never starved by new prompts.

After the runner has run a batch, `update` is the one place where sequences
advance: progress, newly full blocks published to the prefix cache, the sampled
token appended and the one pure stop check (EOS, stop token ids, max_tokens,
context length) applied. Stop strings are text and are checked on the async side.

The scheduler owns the engine's step counters (`StepCounters`): it is where prompts are looked up in
the prefix cache, sequences preempted, and prompt and generated tokens computed.

Prompt tokens whose logprobs a request asked for cost far more than other prompt tokens (an
output-head row over the vocabulary, a softmax and a top-k each), so a step scores at most
PROMPT_LOGPROB_ROWS_PER_STEP of them: a long scored prompt spreads over many steps, and the
rest of each step's budget goes to everyone else (a waiting sequence behind it is not held back).

While more than one request is in the engine, a prompt computes at most `long_prefill_token_threshold`
tokens a step (0: no cap). A step lasts as long as its largest chunk, and every decoding stream waits for
the step: on a CPU, a 2,048-token chunk is seconds of silence for every stream, where a 512-token one is a
quarter of that at about the same prompt throughput. A request alone keeps the whole budget.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from engine.core.kv_cache_manager import KVCacheManager
from engine.core.sequence import Sequence, SequenceStatus
from engine.outputs import FINISH_LENGTH, FINISH_STOP, EmittedTokens, TokenLogprob
from engine.params import SamplingParams

# Scored prompt tokens per step, over every sequence: 512 rows of a 49k vocabulary are ~100 MB of
# logits in slices and a few tens of ms of head products on a CPU, a step's share, not its whole.
PROMPT_LOGPROB_ROWS_PER_STEP = 512


@dataclass
class StepCounters:
    """What the steps so far have counted; each only grows. The names are EngineStats's, which says how
    the three prompt-token counts differ."""

    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache, once per sequence
    prefix_cache_hits: int = 0  # of those, found computed there
    num_preemptions: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    num_computed_prompt_tokens: int = 0
    num_greedy_bursts: int = 0
    num_greedy_burst_tokens: int = 0


@dataclass
class ScheduledBatch:
    """Which sequences run this step and how many new tokens each computes.

    A speculating sequence computes its one uncomputed token and then the draft tokens proposed for it
    (`draft_token_ids[i]`, not in seq.token_ids); num_new_tokens[i] counts both. `num_draft_slots[i]` is
    how many drafts the scheduler made room for (blocks and token budget); the proposer may fill fewer.

    `burst` > 1: every sequence decodes `burst` greedy steps in one call (engine/models/greedy_burst.py), each
    step's chosen token the next step's input; num_draft_slots[i] is then the room for the steps after the
    first, and no drafts are proposed.
    """

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_draft_slots: list[int] = field(default_factory=list)
    draft_token_ids: list[list[int]] = field(default_factory=list)
    burst: int = 1

    def __post_init__(self) -> None:
        self.num_draft_slots = self.num_draft_slots or [0] * len(self.seqs)
        self.draft_token_ids = self.draft_token_ids or [[] for _ in self.seqs]

    def append(self, seq: Sequence, num_new: int, num_draft_slots: int = 0) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new)
        self.num_draft_slots.append(num_draft_slots)
        self.draft_token_ids.append([])

    def set_drafts(self, drafts: list[list[int]]) -> None:
        """Put the proposed tokens in (each at most its slots); they join the sequences' new tokens."""
        for i, draft in enumerate(drafts):
            if len(draft) > self.num_draft_slots[i]:
                raise ValueError(f"{len(draft)} drafts proposed for {self.num_draft_slots[i]} slots")
            self.num_new_tokens[i] += len(draft) - len(self.draft_token_ids[i])
            self.draft_token_ids[i] = list(draft)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def num_drafts(self) -> int:
        return sum(len(d) for d in self.draft_token_ids)

    @property
    def decodes_only(self) -> bool:
        """Every sequence computes its one uncomputed token (and maybe drafts after it): no prompt chunk."""
        return all(
            seq.num_uncomputed_tokens == 1 and n - len(d) == 1
            for seq, n, d in zip(self.seqs, self.num_new_tokens, self.draft_token_ids)
        )

    def is_sampling(self, i: int) -> bool:
        """Does sequence i reach its last token this step (so its logits are sampled)?"""
        seq = self.seqs[i]
        return seq.num_computed_tokens + self.num_new_tokens[i] - len(self.draft_token_ids[i]) == len(seq.token_ids)

    def only(self, request_ids: Collection[str]) -> ScheduledBatch:
        """The part of this batch that belongs to these requests, in batch order."""
        keep = [i for i, seq in enumerate(self.seqs) if seq.request_id in request_ids]
        return ScheduledBatch(
            [self.seqs[i] for i in keep],
            [self.num_new_tokens[i] for i in keep],
            [self.num_draft_slots[i] for i in keep],
            [self.draft_token_ids[i] for i in keep],
            self.burst,
        )


class Scheduler:
    def __init__(
        self,
        kv_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        eos_token_ids: tuple[int, ...],
        max_model_len: int,
        plan_drafts: Callable[[list[Sequence], int], list[int]] | None = None,
        on_finish: Callable[[Sequence], None] | None = None,
        long_prefill_token_threshold: int = 0,
        plan_burst: Callable[[list[Sequence]], int] | None = None,
    ) -> None:
        """plan_drafts(candidates, num_seqs): how many draft tokens each decoding candidate of a step of
        num_seqs sequences verifies (None: no speculation). on_finish(seq): called once for each sequence
        as it finishes, however it finishes (speculation drops what it keeps for it). plan_burst(seqs): how
        many greedy steps a decode-only batch of these sequences may run in one call (None or 1: one)."""
        self.kv_manager = kv_manager
        self.plan_drafts = plan_drafts
        self.plan_burst = plan_burst
        self.on_finish = on_finish
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # oldest first; the newest is preempted first
        self.counters = StepCounters()
        # Prompt tokens each request's sample 0 found in the prefix cache when first scheduled, kept until
        # its prompt is counted (its first sampled token): a rescheduling after a preemption finds more
        # (its own blocks) and must not count.
        self._cached_prompt_tokens: dict[Sequence, int] = {}

    @contextmanager
    def counting_into(self, counters: StepCounters) -> Iterator[StepCounters]:
        """Count into `counters` until the block ends, then into the usual ones again (a probe's steps)."""
        usual, self.counters = self.counters, counters
        try:
            yield counters
        finally:
            self.counters = usual

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        """Mark finished and give its blocks back (idempotent)."""
        if seq.is_finished:
            return
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv_manager.free(seq)
        self._cached_prompt_tokens.pop(seq, None)
        if self.on_finish is not None:
            self.on_finish(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.counters.num_preemptions += 1

    def _is_blocked_on_parent(self, seq: Sequence) -> bool:
        """Samples 1..n-1 wait until sample 0 has cached the shared prompt blocks."""
        parent = seq.parent
        if parent is None or not self.kv_manager.pool.enable_prefix_caching:
            return False
        return not parent.is_finished and parent.num_computed_tokens < parent.num_prompt_tokens

    def _prompt_chunk_cap(self) -> int:
        """Most tokens one sequence computes this step: the long-prefill threshold while more than one
        request is in the engine (samples of one request are one request), else the whole budget."""
        threshold = self.long_prefill_token_threshold
        sequences = itertools.chain(self.running, self.waiting)
        first = next(sequences, None)
        if threshold <= 0 or first is None:
            return self.max_num_batched_tokens
        # Stops at the first other request: the waiting queue can be long, and this runs every step.
        others = any(seq.request_id != first.request_id for seq in sequences)
        return threshold if others else self.max_num_batched_tokens

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        chunk_cap = self._prompt_chunk_cap()
        scored_rows_left = PROMPT_LOGPROB_ROWS_PER_STEP
        bm = self.kv_manager

        # 1. Running sequences, oldest first; preempt from the newest end when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_uncomputed_tokens, budget, chunk_cap)
            if seq.needs_prompt_logprobs:
                num_new = min(num_new, scored_rows_left)
                if num_new == 0:  # this step's scored rows are spent: it goes on next step
                    i += 1
                    continue
            bm.release_out_of_window(seq)
            while not bm.grow(seq, seq.num_computed_tokens + num_new):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break  # seq preempted itself: nothing newer is left to run
            batch.append(seq, num_new)
            budget -= num_new
            if seq.needs_prompt_logprobs:
                scored_rows_left -= num_new
            i += 1
        budget -= self._make_draft_room(batch, budget)

        # 2. Waiting sequences in arrival order (preempted ones were put in front).
        now = time.monotonic()
        skipped: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if self._is_blocked_on_parent(seq) or (seq.needs_prompt_logprobs and scored_rows_left == 0):
                skipped.append(self.waiting.popleft())
                continue
            if not seq.holds_blocks and not seq.needs_prompt_logprobs:
                # A cached prefix has no logits left to score its tokens with: a sequence that still
                # owes prompt logprobs computes its whole prompt (its blocks are then cached for others).
                seq.num_computed_tokens = bm.take_cached_prefix(seq)
            bm.release_out_of_window(seq)
            num_new = min(seq.num_uncomputed_tokens, budget, chunk_cap)
            if seq.needs_prompt_logprobs:
                num_new = min(num_new, scored_rows_left)
            if not bm.grow(seq, seq.num_computed_tokens + num_new):
                if not self.running and not batch.seqs and not skipped:
                    # Nothing else holds blocks and it still does not fit: it never will.
                    raise RuntimeError(
                        f"the KV cache ({bm.pool.num_blocks - 1} blocks of {bm.block_size} tokens) cannot hold "
                        f"one sequence of {len(seq.token_ids)} tokens; raise --kv-cache-memory"
                    )
                bm.free(seq)
                seq.num_computed_tokens = 0
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
                # Prompt tokens looked up / found in the prefix cache, once per sequence (like vLLM's metrics).
                num_cached = min(seq.num_computed_tokens, seq.num_prompt_tokens)
                self.counters.prefix_cache_queries += seq.num_prompt_tokens
                self.counters.prefix_cache_hits += num_cached
                if seq.index == 0:
                    self._cached_prompt_tokens[seq] = num_cached
            self.running.append(seq)
            batch.append(seq, num_new)
            budget -= num_new
            if seq.needs_prompt_logprobs:
                scored_rows_left -= num_new
        self.waiting.extendleft(reversed(skipped))
        if self.plan_burst is not None and not self.waiting and batch.seqs and not any(batch.num_draft_slots):
            self._make_burst_room(batch)
        return batch

    def _tokens_left(self, seq: Sequence) -> int:
        """Tokens the sequence can still append before its length ends it."""
        max_tokens = seq.params.max_tokens or self.max_model_len
        return min(max_tokens - seq.num_generated_tokens, self.max_model_len - len(seq.token_ids))

    def _make_burst_room(self, batch: ScheduledBatch) -> None:
        """Make a decode-only batch a burst of greedy steps where plan_burst allows one: as many steps as every
        sequence has tokens left and blocks for, else none (a burst never preempts anyone)."""
        if not batch.decodes_only:
            return
        steps = min(self.plan_burst(batch.seqs), *(self._tokens_left(seq) for seq in batch.seqs))
        if steps <= 1:
            return
        grown: list[Sequence] = []
        for seq in batch.seqs:
            if not self.kv_manager.grow(seq, seq.num_computed_tokens + steps):
                for done in grown:
                    self.kv_manager.trim(done, done.num_computed_tokens + 1)
                return
            grown.append(seq)
        batch.burst = steps
        batch.num_draft_slots = [steps - 1] * len(batch.seqs)

    def _make_draft_room(self, batch: ScheduledBatch, budget_left: int) -> int:
        """Give the batch's decoding sequences their planned draft slots, within the budget and free blocks;
        returns the slots given.

        Room for drafts never preempts anyone: without free blocks for them a sequence decodes plainly.
        """
        if self.plan_drafts is None:
            return 0
        candidates = [
            i for i, seq in enumerate(batch.seqs) if batch.num_new_tokens[i] == 1 and seq.num_uncomputed_tokens == 1
        ]
        if not candidates:
            return 0
        planned = self.plan_drafts([batch.seqs[i] for i in candidates], len(batch.seqs))
        given = 0
        for i, slots in zip(candidates, planned, strict=True):
            seq = batch.seqs[i]
            slots = min(slots, budget_left - given)
            while slots > 0 and not self.kv_manager.grow(seq, seq.num_computed_tokens + 1 + slots):
                slots -= 1
            if slots > 0:
                batch.num_draft_slots[i] = slots
                given += slots
        return given

    def update(
        self,
        batch: ScheduledBatch,
        emitted: list[EmittedTokens],
        prompt_logprobs: dict[Sequence, list[TokenLogprob]] | None = None,
    ) -> list[tuple[Sequence, int]]:
        """Advance every sequence of the batch; append the tokens each sampling sequence emitted.

        emitted: one entry per sampling sequence, in batch order: one sampled token, or accepted drafts
        and the token after them (their K/V were computed this step; the rest of the drafts' K/V is
        dropped: the table is trimmed and only accepted tokens' blocks reach the prefix cache).
        prompt_logprobs: the prompt tokens this step scored, per sequence that owes them, in order.
        Returns each sampling sequence with the number of tokens it appended (fewer than emitted when
        a stop came first). The step's tokens are counted here (see StepCounters).
        """
        counters = self.counters
        if batch.burst > 1:
            counters.num_greedy_bursts += 1
        sampled: list[int] = []
        for i, (seq, num_new) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            is_sampling = batch.is_sampling(i)
            start = seq.num_computed_tokens
            seq.num_computed_tokens += num_new - len(batch.draft_token_ids[i])
            counters.num_computed_prompt_tokens += max(0, min(seq.num_computed_tokens, seq.num_prompt_tokens) - start)
            if prompt_logprobs and seq in prompt_logprobs:
                seq.prompt_logprobs.extend(prompt_logprobs[seq])
            self.kv_manager.register_computed_blocks(seq)
            if is_sampling:
                sampled.append(i)
        appended: list[tuple[Sequence, int]] = []
        for i, tokens in zip(sampled, emitted, strict=True):
            seq = batch.seqs[i]
            if seq.index == 0 and seq.num_generated_tokens == 0:
                # The prompt is fully computed for the first time: it counts once, whole, for all n samples
                # (a preempted sample recomputing it has generated tokens already).
                counters.num_prompt_tokens += seq.num_prompt_tokens
                counters.num_cached_prompt_tokens += self._cached_prompt_tokens.pop(seq, 0)
            count = self._append_tokens(seq, tokens)
            appended.append((seq, count))
            counters.num_generation_tokens += count
            if batch.burst > 1:
                counters.num_greedy_burst_tokens += count
            if batch.num_draft_slots[i] and not seq.is_finished:
                # Every appended token but the newest had its K/V computed this step (the accepted
                # drafts, or a burst's tokens): they count, their full blocks are published, and blocks past
                # them go back.
                seq.num_computed_tokens = len(seq.token_ids) - 1
                self.kv_manager.register_computed_blocks(seq)
                self.kv_manager.trim(seq, len(seq.token_ids))
        return appended

    def _append_tokens(self, seq: Sequence, tokens: EmittedTokens) -> int:
        """Append the emitted tokens one by one, applying the stop check after each; returns how many."""
        for count, (token_id, logprob) in enumerate(zip(tokens.token_ids, tokens.logprobs, strict=True), 1):
            seq.token_ids.append(token_id)
            if logprob is not None:
                seq.logprobs.append(logprob)
            if seq.matcher is not None:
                seq.matcher.consume_token(token_id)
            stop = check_stop(
                seq.params,
                token_id,
                seq.num_generated_tokens,
                len(seq.token_ids),
                self.eos_token_ids,
                self.max_model_len,
                is_grammar_complete=seq.matcher is not None and seq.matcher.is_stopped(),
            )
            if stop is not None:
                self.finish(seq, *stop)
                return count
        return len(tokens.token_ids)


def check_stop(
    params: SamplingParams,
    token_id: int,
    num_generated_tokens: int,
    num_tokens: int,
    eos_token_ids: tuple[int, ...],
    max_model_len: int,
    is_grammar_complete: bool = False,
) -> tuple[str, int | None] | None:
    """(finish_reason, stop_reason) if the newest token ends the sequence, else None.

    is_grammar_complete: a structured request's grammar allows nothing more (its JSON closed).

    The sampler bans EOS and stop tokens until min_tokens, so they are not checked against it here.
    """
    if token_id in params.stop_token_ids:
        return FINISH_STOP, token_id
    if token_id in eos_token_ids and not params.ignore_eos:
        return FINISH_STOP, None
    if is_grammar_complete:
        return FINISH_STOP, None
    max_tokens = params.max_tokens or max_model_len
    if num_generated_tokens >= max_tokens or num_tokens >= max_model_len:
        return FINISH_LENGTH, None
    return None
