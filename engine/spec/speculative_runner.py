"""Speculative decoding around a batch runner: propose, verify in one forward, learn from the outcome.

`SpeculativeRunner.execute` fills the draft slots the scheduler made room for with the Speculator's
proposals, runs the batch (the target model verifies every draft in the same forward, by rejection
sampling), and hands the outcome to the Speculator: each verification's acceptance and, for a step of
decodes only, the step's time. The scheduler then appends the accepted drafts like any sampled token.
"""

from __future__ import annotations

import logging
import time

from engine.config import EngineConfig, ModelConfig, SpeculativeConfig
from engine.core.scheduler import ScheduledBatch
from engine.core.sequence import Sequence
from engine.runner.isolation import BatchOutcome, BatchRunner
from engine.spec.draft import DraftModelProposer
from engine.spec.speculator import NgramProposer, Proposer, Speculator

logger = logging.getLogger(__name__)


class SpeculativeRunner:
    def __init__(self, inner: BatchRunner, speculator: Speculator) -> None:
        self.inner = inner
        self.speculator = speculator

    def execute(self, batch: ScheduledBatch) -> BatchOutcome:
        """The batch run with drafts in its slots; a failure is the inner runner's to isolate or raise."""
        started = time.perf_counter()
        if any(batch.num_draft_slots):
            batch.set_drafts(self.speculator.propose(batch.seqs, batch.num_draft_slots))
        outcome = self.inner.execute(batch)
        if batch.decodes_only and not outcome.failed:
            self.speculator.observe_step(len(batch.seqs), batch.num_drafts, time.perf_counter() - started)
        verified = outcome.batch
        sampling = [i for i in range(len(verified.seqs)) if verified.is_sampling(i)]
        for i, tokens in zip(sampling, outcome.sampled, strict=True):
            if verified.draft_token_ids[i]:
                self.speculator.record(verified.seqs[i], len(verified.draft_token_ids[i]), tokens.num_accepted_drafts)
        return outcome

    def plan_drafts(self, candidates: list[Sequence], num_seqs: int) -> list[int]:
        """Draft slots for each decoding candidate of a step of num_seqs sequences (the scheduler asks)."""
        return self.speculator.plan(candidates, num_seqs)

    def forget(self, seq: Sequence) -> None:
        """A sequence finished: its speculation state (and a draft model's K/V for it) goes."""
        self.speculator.forget([seq])

    def stats_fields(self) -> dict[str, object]:
        """Speculation's part of EngineStats: verifications, tokens proposed, accepted, accepted per position."""
        stats = self.speculator.stats
        return {
            "num_spec_drafts": stats.num_drafts,
            "num_spec_draft_tokens": stats.num_draft_tokens,
            "num_spec_accepted_tokens": stats.num_accepted_tokens,
            "spec_accepted_per_position": tuple(stats.accepted_per_position),
        }


def build_speculative_runner(
    inner: BatchRunner,
    config: EngineConfig,
    max_model_len: int,
    vocab_size: int,
    draft_model: tuple[EngineConfig, ModelConfig, dict] | None,
) -> SpeculativeRunner | None:
    """The runner that speculates as config.speculative says, around `inner` (None: no speculation).

    draft_model: (its config, architecture, weights) for the method "draft".
    """
    spec: SpeculativeConfig | None = config.speculative
    if spec is None:
        return None
    proposer: Proposer
    if spec.method == "ngram":
        proposer = NgramProposer(spec.ngram_min, spec.ngram_max)
    elif draft_model is None:
        raise ValueError("speculative method draft needs the draft model loaded")
    else:
        draft_config, draft_model_config, draft_weights = draft_model
        proposer = DraftModelProposer(
            draft_model_config, draft_weights, draft_config, spec.num_speculative_tokens, config.max_num_seqs
        )
    logger.info(
        "speculative decoding: %s, up to %d tokens per step%s",
        spec.method,
        spec.num_speculative_tokens,
        f", n-grams of {spec.ngram_min} to {spec.ngram_max}" if spec.method == "ngram" else "",
    )
    return SpeculativeRunner(inner, Speculator(spec, proposer, max_model_len, vocab_size))
