"""One generated sample: its token ids, progress and block table. No text.

A request with n samples owns n Sequences. Each field has one writer:
- the engine fills the identity fields once (seq_id ... parent);
- the scheduler writes status, num_computed_tokens, first_scheduled_time, and
  appends sampled tokens (token_ids, logprobs), the prompt's logprobs (prompt_logprobs) and
  the finish (finish_reason, stop_reason) in `Scheduler.update`;
- the KV cache manager writes block_tables, block_hashes and num_registered_blocks;
- the engine creates the matcher (structured output), and `Scheduler.update` advances it with
  each sampled token. A preempted sequence keeps it: recomputing its KV changes no token.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.outputs import TokenLogprob
from engine.params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    index: int  # which of the request's n samples
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    token_ids: list[int] = field(default_factory=list)  # prompt + generated
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    # One block table per attention group (engine/core/kv_layout.py); block_tables[g][i] holds positions
    # [i * block_size, (i + 1) * block_size) of group g's layers.
    block_tables: list[list[int]] = field(default_factory=lambda: [[]])
    block_hashes: list[bytes] = field(default_factory=list)  # chained digest of each full block
    num_registered_blocks: int = 0  # full blocks already published to the prefix cache
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    generator: torch.Generator | None = None  # per-request seed: same tokens in any batch
    parent: Sequence | None = None  # sample 0 of the request, for n > 1 prefix sharing
    first_scheduled_time: float | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of generated tokens, when asked
    # Entry j scores prompt token j + 1 (computed at position j); sample 0 of a request only.
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    matcher: Any = None  # the grammar matcher of a structured request (llguidance), at its output so far

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def block_table(self) -> list[int]:
        """The first group's table: the only one of a model whose layers all attend alike."""
        return self.block_tables[0]

    @block_table.setter
    def block_table(self, table: list[int]) -> None:
        self.block_tables[0] = table

    @property
    def holds_blocks(self) -> bool:
        return any(self.block_tables)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Its prompt still has tokens to score. Only sample 0 scores the prompt (the n samples share it)."""
        wanted = self.params.prompt_logprobs is not None and self.parent is None
        return wanted and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
