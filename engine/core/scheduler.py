"""Token-budget scheduler: continuous batching without prefill/decode phases.

Every step each scheduled sequence catches `num_computed_tokens` up towards
`len(token_ids)`, within a token budget and a sequence cap. A long prompt is
therefore chunked over steps, a decode costs one token, and a preempted
sequence (blocks freed, num_computed_tokens reset) simply recomputes. Running
sequences go first so decodes are never starved by new prompts.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from engine.core.kv_cache_manager import KVCacheManager
from engine.core.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """Which sequences run this step and how many new tokens each computes."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def samples(self, i: int) -> bool:
        """Does sequence i reach its last token this step (so its logits are sampled)?"""
        seq = self.seqs[i]
        return seq.num_computed_tokens + self.num_new_tokens[i] == len(seq.token_ids)


class Scheduler:
    def __init__(self, kv_manager: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.kv_manager = kv_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # oldest first; the newest is preempted first
        self.num_preemptions = 0

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

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

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _is_blocked_on_parent(self, seq: Sequence) -> bool:
        """Samples 1..n-1 wait until sample 0 has cached the shared prompt blocks."""
        parent = seq.parent
        if parent is None or not self.kv_manager.pool.enable_prefix_caching:
            return False
        return not parent.is_finished and parent.num_computed_tokens < parent.num_prompt_tokens

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        bm = self.kv_manager

        # 1. Running sequences, oldest first; preempt from the newest end when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_uncomputed_tokens, budget)
            bm.release_out_of_window(seq)
            while not bm.grow(seq, seq.num_computed_tokens + num_new):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break  # seq preempted itself: nothing newer is left to run
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            budget -= num_new
            i += 1

        # 2. Waiting sequences in arrival order (preempted ones were put in front).
        now = time.monotonic()
        skipped: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if self._is_blocked_on_parent(seq):
                skipped.append(self.waiting.popleft())
                continue
            if not seq.block_table:
                seq.num_computed_tokens = bm.take_cached_prefix(seq)
            bm.release_out_of_window(seq)
            num_new = min(seq.num_uncomputed_tokens, budget)
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
                stats = bm.pool.cache_stats
                stats.queries += seq.num_prompt_tokens
                stats.hits += min(seq.num_computed_tokens, seq.num_prompt_tokens)
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))
        return batch

    def update_computed(self, batch: ScheduledBatch) -> None:
        """Advance progress after the model ran; publish newly full blocks."""
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += num_new
            self.kv_manager.register_computed_blocks(seq)
