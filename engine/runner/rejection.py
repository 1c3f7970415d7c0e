"""Verification of proposed tokens: which of them the target model keeps, and the token after them.

A sequence with k draft tokens d_1..d_k was run over k+1 positions in one forward; position j's logits
give the target's distribution p_j for the token after d_1..d_j. Every step emits between 1 and k+1
tokens, and the output is what the target model alone gives.

The rule for sampled tokens is the rejection rule (`rejection_sample`, the reference): d_j is kept with
probability min(1, p(d_j) / q(d_j)), q being the distribution the proposer drew it from; the first
rejected position draws from the residual max(0, p - q), normalised; when all k are kept, one more
token is drawn from p_k. Every emitted token is then distributed as the target's own sample.

Both proposers here propose deterministically: q is a point mass at the draft, so d_j is kept with
probability p(d_j) and a rejection draws from p without d_j. `verify_drafts` computes exactly that by
coupling: it samples the target's own token at every position, with the sampler plain decoding uses
(penalties, bias, bans, temperature, top-k/p, min-p) and the draws plain decoding would make, and keeps
d_j while it equals that token. The target's token equals d_j with probability p(d_j), and otherwise is
a draw from p without d_j, so the rule holds; and the tokens are the ones decoding one at a time would
give, so a seeded request gives the same tokens with or without speculation (greedy: the argmax).
"""

from __future__ import annotations

import torch

from engine.outputs import EmittedTokens
from engine.runner.sampler import SamplingRow, draw_uniforms, sample


def acceptance_probability(target_probs: torch.Tensor, draft_probs: torch.Tensor, token_id: int) -> float:
    """min(1, p(x) / q(x)) for the proposed token x; p, q: [V]. A token q never proposes is never accepted."""
    q = float(draft_probs[token_id])
    if q <= 0.0:
        return 0.0
    return min(1.0, float(target_probs[token_id]) / q)


def residual_distribution(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """max(0, p - q) normalised: what to draw from after a rejection; p, q: [V].

    When p == q nothing is left (a rejection then has probability 0); p itself is returned so the
    function is total.
    """
    residual = (target_probs - draft_probs).clamp_(min=0.0)
    total = residual.sum()
    if float(total) <= 0.0:
        return target_probs
    return residual / total


def _uniform(generator: torch.Generator | None, device: torch.device) -> float:
    return float(torch.rand(1, generator=generator, dtype=torch.float64, device=device))


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from probs [V] by inverse CDF; never a zero-probability token."""
    cdf = probs.to(torch.float64).cumsum(dim=0)
    u = torch.rand(1, generator=generator, dtype=torch.float64, device=probs.device) * cdf[-1]
    return int(torch.searchsorted(cdf, u, right=True).clamp_(max=probs.shape[0] - 1))


def rejection_sample(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_token_ids: list[int],
    generator: torch.Generator | None,
) -> tuple[list[int], int]:
    """(emitted token ids, number of drafts accepted) by the rejection rule.

    target_probs: [k+1, V], p_j for positions 0..k; draft_probs: [k, V], q_j each draft was drawn from.
    """
    emitted: list[int] = []
    for j, token_id in enumerate(draft_token_ids):
        p, q = target_probs[j], draft_probs[j]
        if _uniform(generator, p.device) < acceptance_probability(p, q, token_id):
            emitted.append(token_id)
            continue
        emitted.append(_draw(residual_distribution(p, q), generator))
        return emitted, j
    emitted.append(_draw(target_probs[len(draft_token_ids)], generator))
    return emitted, len(draft_token_ids)


def _position_rows(row: SamplingRow, draft_token_ids: list[int]) -> list[SamplingRow]:
    """One sampling row per verified position: position j sees the drafts before it as generated tokens
    (so penalties and the min_tokens ban count them exactly as plain decoding would)."""
    return [
        SamplingRow(
            row.params, row.token_ids + draft_token_ids[:j], row.num_prompt_tokens, row.eos_token_ids, row.generator
        )
        for j in range(len(draft_token_ids) + 1)
    ]


def verify_drafts(
    logits: torch.Tensor, rows: list[SamplingRow], draft_token_ids: list[list[int]]
) -> list[EmittedTokens]:
    """The tokens each speculating sequence emits.

    logits: float32 [sum of (k_i + 1), V], sequence i's last k_i + 1 positions in order; rows[i] and
    draft_token_ids[i]: its sampling row and its k_i drafts. All positions are sampled in one call.
    """
    position_rows = [r for row, drafts in zip(rows, draft_token_ids, strict=True) for r in _position_rows(row, drafts)]
    states = [
        row.generator.get_state() if row.generator is not None and not row.params.is_greedy else None for row in rows
    ]
    sampled = sample(logits, position_rows)  # the target's own token at every position, one draw each in order
    emitted = []
    offset = 0
    for drafts, state, row in zip(draft_token_ids, states, rows):
        choices = sampled.token_ids[offset : offset + len(drafts) + 1]
        num_accepted = 0
        while num_accepted < len(drafts) and choices[num_accepted] == drafts[num_accepted]:
            num_accepted += 1
        used = num_accepted + 1
        if state is not None and used < len(choices):
            # Give back the draws of the positions past the first mismatch: the generator is where
            # decoding the emitted tokens one at a time leaves it.
            row.generator.set_state(state)
            draw_uniforms(position_rows[offset : offset + used], logits.dtype, logits.device)
        emitted.append(EmittedTokens(choices[:used], sampled.logprobs[offset : offset + used], num_accepted))
        offset += len(choices)
    return emitted
