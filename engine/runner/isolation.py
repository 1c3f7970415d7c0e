"""Running a batch so that a failure one request causes fails that request only.

`IsolatingRunner.execute` runs the batch through the model runner; when it raises, the batch's
requests run again split in halves, halving whatever still raises, until each failure is pinned on a
request or shown to be nobody's (then the model itself is failing and the first error is raised).
"""

from __future__ import annotations

import logging
import traceback
from dataclasses import dataclass, field
from typing import Protocol

import torch

from engine.core.scheduler import ScheduledBatch
from engine.core.sequence import Sequence
from engine.outputs import EmittedTokens, TokenLogprob
from engine.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclass
class BatchOutcome:
    """What running a batch gives: the results of the requests that computed, the errors of those that
    raised on their own."""

    batch: ScheduledBatch  # the sequences whose results are used, in batch order
    sampled: list[EmittedTokens]  # one per sequence of `batch` that samples, in order
    prompt_logprobs: dict[Sequence, list[TokenLogprob]] = field(default_factory=dict)  # scored this step
    failed: dict[str, Exception] = field(default_factory=dict)  # request id -> what its part raised


class BatchRunner(Protocol):
    def execute(self, batch: ScheduledBatch) -> BatchOutcome:
        """Compute a non-empty batch; raises only when no request explains a failure (nothing advanced)."""
        ...


class IsolatingRunner:
    """The model runner's `execute`, except that a failure pinned to some requests fails only those."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def execute(self, batch: ScheduledBatch) -> BatchOutcome:
        """When the batch raises, its requests are split in halves and each half runs
        alone, halving again whatever still raises: a part that succeeds keeps its
        results, a request that raises on its own lands in `failed`. The re-runs give
        exactly what the batch would have: K/V written again for the same positions get
        the same values, and every seeded generator is put back to its state before the
        failed attempt. Nothing in a sequence changes here (the scheduler advances the
        sequences of the returned batch). Raises the first error when no part succeeds:
        nothing pins the failure on a request, so the model itself is failing.
        """
        request_ids = list(dict.fromkeys(seq.request_id for seq in batch.seqs))
        if len(request_ids) == 1:  # a re-run alone is the same batch
            return BatchOutcome(batch, *self.runner.execute(batch).parts())
        generator_states = _generator_states(batch.seqs)
        try:
            return BatchOutcome(batch, *self.runner.execute(batch).parts())
        except Exception as exc:  # noqa: BLE001 - re-run below, raised again if no request explains it
            first_error = _without_locals(exc)
        logger.warning(
            "a batch of %d requests raised %r; running it again split by request", len(request_ids), first_error
        )
        sampled: dict[Sequence, EmittedTokens] = {}
        scored_prompts: dict[Sequence, list[TokenLogprob]] = {}
        succeeded: set[str] = set()
        failed: dict[str, Exception] = {}
        parts = _halves(request_ids)
        while parts:
            part_ids = parts.pop()
            part = batch.only(set(part_ids))
            for seq in part.seqs:
                if seq in generator_states:
                    seq.generator.set_state(generator_states[seq])
            try:
                output, part_prompts = self.runner.execute(part).parts()
            except Exception as exc:  # noqa: BLE001 - pinned below, or split further
                if len(part_ids) == 1:
                    failed[part_ids[0]] = _without_locals(exc)
                else:
                    parts.extend(_halves(part_ids))
                continue
            succeeded.update(part_ids)
            scored_prompts.update(part_prompts)
            sampling_seqs = [seq for i, seq in enumerate(part.seqs) if part.is_sampling(i)]
            sampled.update(zip(sampling_seqs, output, strict=True))
        if not succeeded:
            raise first_error
        survivors = batch.only(succeeded)
        rows = [sampled[seq] for i, seq in enumerate(survivors.seqs) if survivors.is_sampling(i)]
        return BatchOutcome(survivors, rows, scored_prompts, failed)


def _halves(items: list[str]) -> list[list[str]]:
    middle = len(items) // 2
    return [items[:middle], items[middle:]]


def _without_locals(exc: Exception) -> Exception:
    """The error with its traceback's finished frames cleared, so the failed attempt's tensors are freed
    before the re-runs (an out-of-memory error would otherwise strike again)."""
    traceback.clear_frames(exc.__traceback__)
    return exc


def _generator_states(seqs: list[Sequence]) -> dict[Sequence, torch.Tensor]:
    """Each seeded sequence's generator state, to put back before a re-run."""
    return {seq: seq.generator.get_state() for seq in seqs if seq.generator is not None}
