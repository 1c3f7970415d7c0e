"""Speculative decoding's policy and bookkeeping: who speculates how far, and how well it went.

The speculative runner (engine/spec/speculative_runner.py) owns one Speculator. Before a step the
scheduler asks `plan` how many drafts each decoding sequence verifies and makes room; the Speculator's
proposer then fills the slots (`propose`); once the batch is verified `record` takes each verification's
outcome and `observe_step` the step's time, and `forget` drops a finished sequence. Two things keep
speculation from costing more than it brings:
- the plan gives a sequence drafts only while their expected tokens per second beat the step's
  (engine/spec/draft_budget.py), from each sequence's acceptance and the step times measured so far:
  where another position is nearly free every sequence gets its k, where it costs what a token costs
  (quantized weights on a CPU, large batches) only the likeliest drafts run;
- a sequence whose drafts keep being rejected stops proposing for a while (doubling the pause each time
  it fails again), so output with nothing to copy (free-form chat) pays almost nothing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Protocol

from engine.config import SpeculativeConfig
from engine.core.sequence import Sequence
from engine.spec.draft_budget import StepCostModel, plan_draft_slots
from engine.spec.ngram import propose_ngram

logger = logging.getLogger(__name__)

# Acceptance below this (a moving average of drafts kept over drafts that had the chance: each one after
# a kept one, up to the first rejection) pauses a sequence's proposals.
MIN_ACCEPTANCE = 0.3
# Weight of the newest verification in the moving average.
ACCEPTANCE_SMOOTHING = 0.3
# A new sequence's acceptance, until it has drafts of its own.
PRIOR_ACCEPTANCE = 0.7
# A pause's length in generated tokens: the first, and the most it doubles to.
FIRST_PAUSE_TOKENS = 8
MAX_PAUSE_TOKENS = 256


class Proposer(Protocol):
    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[list[int]]:
        """Up to num_tokens[i] draft tokens to follow seqs[i].token_ids."""
        ...

    def forget(self, seq_ids: list[int]) -> None:
        """Drop whatever is kept for these sequences (they finished)."""
        ...


class NgramProposer:
    """Prompt lookup over each sequence's own tokens (prompt and output)."""

    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[list[int]]:
        return [propose_ngram(s.token_ids, k, self.ngram_min, self.ngram_max) for s, k in zip(seqs, num_tokens)]

    def forget(self, seq_ids: list[int]) -> None:
        return None


@dataclass
class SpeculationStats:
    """Counters after vLLM's spec-decode metrics; each only grows."""

    num_drafts: int = 0  # verifications of at least one proposed token
    num_draft_tokens: int = 0  # tokens proposed and verified
    num_accepted_tokens: int = 0  # of those, accepted
    accepted_per_position: list[int] = field(default_factory=list)  # [j]: drafts whose token j+1 was accepted


@dataclass
class _SequenceState:
    acceptance: float = PRIOR_ACCEPTANCE  # three wholly rejected drafts in a row pause it
    paused_until: int = 0  # generated-token count before which it does not propose
    pause: int = FIRST_PAUSE_TOKENS


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_model_len: int, vocab_size: int) -> None:
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size  # the target's: a draft model may know ids past it
        self.stats = SpeculationStats(accepted_per_position=[0] * config.num_speculative_tokens)
        self.cost_model = StepCostModel()
        self._states: dict[int, _SequenceState] = {}

    def draft_slots(self, seq: Sequence) -> int:
        """How many drafts a decoding sequence verifies next step: 0 when it does not speculate.

        Never more than fit before max_tokens or the context end (every accepted draft plus the token
        after them becomes output). Structured requests do not speculate: their grammar allows tokens
        one at a time.
        """
        params = seq.params
        if not params.speculative or seq.matcher is not None:
            return 0
        state = self._states.get(seq.seq_id)
        if state is not None and seq.num_generated_tokens < state.paused_until:
            return 0
        max_tokens = params.max_tokens or self.max_model_len
        room = min(max_tokens - seq.num_generated_tokens, self.max_model_len - len(seq.token_ids)) - 1
        return max(0, min(self.config.num_speculative_tokens, room))

    def plan(self, candidates: list[Sequence], num_seqs: int) -> list[int]:
        """Draft slots for each decoding candidate of a step of num_seqs sequences (see draft_budget)."""
        most = [self.draft_slots(seq) for seq in candidates]
        rates = [self._acceptance(seq) for seq in candidates]
        return plan_draft_slots(rates, most, num_seqs, self.cost_model.fit())

    def observe_step(self, num_seqs: int, num_drafts: int, seconds: float) -> None:
        """A step of decoding sequences only (no prompt chunk) took `seconds`, proposing included."""
        self.cost_model.observe(num_seqs, num_drafts, seconds)

    def _acceptance(self, seq: Sequence) -> float:
        state = self._states.get(seq.seq_id)
        return state.acceptance if state is not None else PRIOR_ACCEPTANCE

    def propose(self, seqs: list[Sequence], num_slots: list[int]) -> list[list[int]]:
        """Drafts for the sequences with slots (at most their slots); [] for the rest.

        A proposer that raises (a draft model out of memory, say) costs the step its drafts, not its
        requests: they decode plainly, the proposer's state for them is dropped, and the error is logged.
        """
        wanted = [i for i, slots in enumerate(num_slots) if slots > 0]
        drafts: list[list[int]] = [[] for _ in seqs]
        if not wanted:
            return drafts
        try:
            proposed = self.proposer.propose([seqs[i] for i in wanted], [num_slots[i] for i in wanted])
        except Exception:  # noqa: BLE001 - speculation is optional: the step goes on without drafts
            logger.exception("the %s proposer failed; this step decodes without drafts", self.config.method)
            self.proposer.forget([seqs[i].seq_id for i in wanted])
            return drafts
        for i, draft in zip(wanted, proposed, strict=True):
            draft = draft[: num_slots[i]]
            outside = [j for j, token_id in enumerate(draft) if not 0 <= token_id < self.vocab_size]
            drafts[i] = draft[: outside[0]] if outside else draft
        return drafts

    def record(self, seq: Sequence, num_proposed: int, num_accepted: int) -> None:
        """One verification's outcome for a sequence that proposed num_proposed > 0 tokens, before the
        sequence appends the accepted drafts and the token after them (a pause counts from there on)."""
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_proposed
        stats.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            stats.accepted_per_position[position] += 1
        state = self._states.setdefault(seq.seq_id, _SequenceState())
        # Drafts that had the chance to be kept: the accepted ones and the first rejected one.
        rate = num_accepted / (num_accepted + (num_accepted < num_proposed))
        state.acceptance += ACCEPTANCE_SMOOTHING * (rate - state.acceptance)
        if state.acceptance < MIN_ACCEPTANCE:
            state.paused_until = seq.num_generated_tokens + num_accepted + 1 + state.pause
            state.pause = min(2 * state.pause, MAX_PAUSE_TOKENS)
            state.acceptance = MIN_ACCEPTANCE  # after the pause it gets a fair new chance
        elif rate >= 0.5:
            state.pause = FIRST_PAUSE_TOKENS

    def forget(self, seqs: list[Sequence]) -> None:
        """Drop the state of finished sequences."""
        for seq in seqs:
            self._states.pop(seq.seq_id, None)
        self.proposer.forget([seq.seq_id for seq in seqs])
