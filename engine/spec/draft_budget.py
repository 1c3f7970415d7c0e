"""How many draft tokens each decoding sequence verifies this step: the count that makes the step give
the most tokens per second.

A step's time is about t = fixed + per_seq * B + per_draft * D for B decoding sequences and D draft
tokens. Where the matrix products are bound by reading the weights (float32 on a CPU, small batches on a
GPU) per_draft is small and drafts are almost free; where they are bound by arithmetic (block-quantized
weights on a CPU, large batches) each draft position costs nearly what a sequence's own token costs.
`StepCostModel` learns the three from the steps the engine times; `plan_draft_slots` then gives slots
one at a time to the sequence whose next draft is likeliest to be kept, as long as that draft's expected
tokens per second beat the step's average so far.

A sequence keeps its j-th draft with probability about alpha^j, alpha being its recent rate of keeping a
draft it was given the chance to keep.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

# Steps to time before trusting the fit; until then every sequence gets its full k.
MIN_TIMED_STEPS = 16
# Weight of the newest step in the running sums (older steps fade, so the fit follows the load).
STEP_DECAY = 0.02


@dataclass
class StepCostModel:
    """A decaying least-squares fit of a step's seconds against (1, sequences, draft tokens)."""

    gram: np.ndarray = field(default_factory=lambda: np.zeros((3, 3)))  # sum of x x^T
    moment: np.ndarray = field(default_factory=lambda: np.zeros(3))  # sum of x * seconds
    num_steps: int = 0

    def observe(self, num_seqs: int, num_drafts: int, seconds: float) -> None:
        x = np.array([1.0, float(num_seqs), float(num_drafts)])
        keep = 1.0 - STEP_DECAY
        self.gram = keep * self.gram + np.outer(x, x)
        self.moment = keep * self.moment + x * seconds
        self.num_steps += 1

    def fit(self) -> tuple[float, float, float] | None:
        """(fixed, per_seq, per_draft) seconds, or None until enough steps of different shapes were seen."""
        if self.num_steps < MIN_TIMED_STEPS:
            return None
        # Without steps with and without drafts, and of more than one batch size, the parts cannot be
        # told apart: no fit.
        if np.linalg.cond(self.gram) > 1e8:
            return None
        fixed, per_seq, per_draft = np.linalg.solve(self.gram, self.moment)
        # Noise can tip a part below zero; none is negative in reality.
        return max(float(fixed), 0.0), max(float(per_seq), 0.0), max(float(per_draft), 0.0)


def plan_draft_slots(
    acceptance_rates: Sequence[float],
    max_slots: Sequence[int],
    num_seqs: int,
    cost: tuple[float, float, float] | None,
) -> list[int]:
    """Draft slots per candidate sequence.

    acceptance_rates[i]: the chance that candidate i keeps a draft given the chance (alpha); max_slots[i]:
    the most it may take; num_seqs: the step's sequences (each brings its own token); cost: (fixed,
    per_seq, per_draft) seconds, or None to give everyone max_slots.
    """
    if cost is None:
        return list(max_slots)
    fixed, per_seq, per_token = cost
    slots = [0] * len(max_slots)
    expected_tokens = float(num_seqs)
    seconds = fixed + per_seq * num_seqs
    # The next draft of candidate i is kept with probability alpha_i^(slots_i + 1).
    while True:
        best, gain = -1, 0.0
        for i, (alpha, most) in enumerate(zip(acceptance_rates, max_slots)):
            if slots[i] < most:
                candidate_gain = alpha ** (slots[i] + 1)
                if candidate_gain > gain:
                    best, gain = i, candidate_gain
        # Worth it when its tokens per second beat the step's: gain / per_token > expected / seconds.
        if best < 0 or gain * seconds <= per_token * expected_tokens:
            return slots
        slots[best] += 1
        expected_tokens += gain
        seconds += per_token
