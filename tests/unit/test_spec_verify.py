"""Speculative verification: the acceptance and residual formulas, the output distribution, greedy
acceptance, and n-gram proposals against their plain reference."""

from __future__ import annotations

import random

import pytest
import torch

from engine.params import SamplingParams
from engine.runner.rejection import acceptance_probability, rejection_sample, residual_distribution, verify_drafts
from engine.runner.sampler import SamplingRow, sample, sampling_probs
from engine.spec.ngram import propose_ngram, reference_propose_ngram

# Upper 0.1% points of the chi-square distribution by degrees of freedom: a correct sampler exceeds
# them once in a thousand seeds; the draws below are seeded, so the test is deterministic.
CHI_SQUARE_999 = {3: 16.27, 5: 20.52, 7: 24.32}


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a zero-probability token was drawn"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_acceptance_and_residual_on_hand_made_distributions():
    p = torch.tensor([0.5, 0.3, 0.2, 0.0], dtype=torch.float64)
    q = torch.tensor([0.25, 0.5, 0.0, 0.25], dtype=torch.float64)
    assert acceptance_probability(p, q, 0) == 1.0  # p >= q: always kept
    assert acceptance_probability(p, q, 1) == pytest.approx(0.6)  # 0.3 / 0.5
    assert acceptance_probability(p, q, 3) == 0.0  # the target never emits it
    assert acceptance_probability(p, q, 2) == 0.0  # q never proposes it: never accepted
    # max(0, p - q) = [0.25, 0, 0.2, 0] normalised
    assert residual_distribution(p, q).tolist() == pytest.approx([0.25 / 0.45, 0.0, 0.2 / 0.45, 0.0])
    # A point-mass proposal: the residual is p without the proposed token, renormalised.
    one_hot = torch.tensor([0.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    assert acceptance_probability(p, one_hot, 1) == pytest.approx(0.3)
    assert residual_distribution(p, one_hot).tolist() == pytest.approx([0.5 / 0.7, 0.0, 0.2 / 0.7, 0.0])
    # p == q leaves no residual; the function stays total and returns p.
    assert residual_distribution(p, p).tolist() == pytest.approx(p.tolist())


def _draw_from(probs: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


@pytest.mark.slow
@pytest.mark.parametrize("proposal", ["distribution", "point_mass"])
def test_rejection_sampling_emits_the_target_distribution(proposal):
    """Over many seeded draws the first emitted token follows p_0 and, after an accepted first draft,
    the second follows p_1, whatever q proposed from (chi-square at the 0.1% level)."""
    vocab = 6
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(3, vocab, dtype=torch.float64) * 1.5, dim=-1)  # p_0, p_1, p_2
    q = torch.softmax(torch.randn(2, vocab, dtype=torch.float64) * 1.5, dim=-1)
    generator = torch.Generator().manual_seed(1)
    first = torch.zeros(vocab, dtype=torch.float64)
    second = torch.zeros(vocab, dtype=torch.float64)
    naive = torch.zeros(vocab, dtype=torch.float64)
    for _ in range(20000):
        if proposal == "distribution":
            drafts = [_draw_from(q[0], generator), _draw_from(q[1], generator)]
            draft_probs = q
        else:  # a deterministic proposer: q is a point mass at its (fixed) guess
            drafts = [2, 4]
            draft_probs = torch.zeros(2, vocab, dtype=torch.float64)
            draft_probs[0, 2] = draft_probs[1, 4] = 1.0
        emitted, accepted = rejection_sample(p, draft_probs, drafts, generator)
        assert 1 <= len(emitted) <= 3 and accepted == len(emitted) - 1
        assert emitted[:accepted] == drafts[:accepted]
        first[emitted[0]] += 1
        if accepted >= 1:
            second[emitted[1]] += 1
        naive[drafts[0]] += 1  # what always accepting would emit first
    degrees = vocab - 1
    assert _chi_square(first, p[0]) < CHI_SQUARE_999[degrees]
    assert _chi_square(second, p[1]) < CHI_SQUARE_999[degrees]
    # The test has the power to see a wrong rule: emitting the drafts unverified fails it.
    if proposal == "distribution":
        assert _chi_square(naive, p[0]) > 10 * CHI_SQUARE_999[degrees]


def test_seeded_rejection_sampling_repeats():
    p = torch.softmax(torch.randn(4, 8, dtype=torch.float64), dim=-1)
    q = torch.zeros(3, 8, dtype=torch.float64)
    q[0, 1] = q[1, 2] = q[2, 3] = 1.0
    runs = [
        [rejection_sample(p, q, [1, 2, 3], torch.Generator().manual_seed(seed)) for seed in range(50)] for _ in range(2)
    ]
    assert runs[0] == runs[1]


def _row(params: SamplingParams, history=(5, 6, 7), num_prompt=2, generator=None) -> SamplingRow:
    return SamplingRow(params, list(history), num_prompt, eos_token_ids=(0,), generator=generator)


def _verify_one(logits: torch.Tensor, row: SamplingRow, drafts: list[int]):
    return verify_drafts(logits, [row], [drafts])[0]


def test_verifying_sequences_together_equals_each_alone():
    torch.manual_seed(5)
    drafts = [[3, 4, 1], [], [7, 7], [2]]
    logits = torch.randn(sum(len(d) + 1 for d in drafts), 12)
    logits[0, 3] = logits[1, 4] = 9.0  # the first sequence's first two drafts are likely kept
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.9, seed=1),
        SamplingParams(temperature=1.0, top_k=3),
        SamplingParams(temperature=0.7, top_p=0.8),
    ]

    def rows(seed: int):
        return [_row(p, generator=torch.Generator().manual_seed(seed + i)) for i, p in enumerate(params)]

    for seed in range(30):
        together = verify_drafts(logits, rows(seed), drafts)
        alone, offset = [], 0
        for row, d in zip(rows(seed), drafts):
            alone.append(_verify_one(logits[offset : offset + len(d) + 1], row, d))
            offset += len(d) + 1
        assert [(e.token_ids, e.num_accepted_drafts) for e in together] == [
            (e.token_ids, e.num_accepted_drafts) for e in alone
        ]


def test_greedy_verification_keeps_the_matching_prefix_and_the_targets_next_token():
    logits = torch.full((4, 10), -5.0)
    for position, best in enumerate([3, 4, 9, 2]):
        logits[position, best] = 5.0
    greedy = SamplingParams(temperature=0.0, logprobs=1)
    out = _verify_one(logits, _row(greedy), [3, 4, 5])  # third draft wrong: the target says 9
    assert (out.token_ids, out.num_accepted_drafts) == ([3, 4, 9], 2)
    assert [lp.token_id for lp in out.logprobs] == [3, 4, 9]
    expected = logits[:3].log_softmax(-1)[torch.arange(3), torch.tensor([3, 4, 9])]
    assert [lp.logprob for lp in out.logprobs] == pytest.approx(expected.tolist())
    all_right = _verify_one(logits, _row(greedy), [3, 4, 9])
    assert (all_right.token_ids, all_right.num_accepted_drafts) == ([3, 4, 9, 2], 3)  # plus the bonus token
    first_wrong = _verify_one(logits, _row(greedy), [1, 4, 9])
    assert (first_wrong.token_ids, first_wrong.num_accepted_drafts) == ([3], 0)


def test_greedy_verification_applies_penalties_per_position():
    """Position j sees the drafts before it as output: a repetition penalty or the min_tokens ban acts
    exactly as it would have decoding one token at a time."""
    logits = torch.zeros(3, 10)
    logits[:, 4] = 2.0
    logits[:, 5] = 1.5
    # Without penalties the target wants 4 everywhere; with repetition_penalty the second position,
    # which sees draft 4 as generated, prefers 5.
    penalised = SamplingParams(temperature=0.0, repetition_penalty=1.5)
    out = _verify_one(logits, _row(penalised, history=(1, 2)), [4, 4])
    assert out.token_ids == [4, 5]
    # min_tokens: EOS (id 0) is banned for the first two generated tokens only.
    logits = torch.zeros(3, 10)
    logits[:, 0] = 3.0
    logits[:, 7] = 1.0
    banned = SamplingParams(temperature=0.0, min_tokens=2)
    out = _verify_one(logits, _row(banned, history=(1, 2), num_prompt=2), [7, 7])
    assert out.token_ids == [7, 7, 0]


def test_random_verification_never_emits_a_token_outside_top_k():
    torch.manual_seed(3)
    logits = torch.randn(3, 50)
    params = SamplingParams(temperature=1.0, top_k=3)
    allowed = logits.topk(3, dim=-1).indices
    for seed in range(200):
        out = _verify_one(logits, _row(params, generator=torch.Generator().manual_seed(seed)), [int(allowed[0, 0]), 7])
        for position, token_id in enumerate(out.token_ids):
            assert token_id in allowed[position].tolist()


@pytest.mark.slow
def test_verification_follows_the_rejection_rule():
    """The coupled verification (sample the target's token, keep a draft while it matches) against the
    reference rule with a point-mass q: the same distribution over what a step emits."""
    torch.manual_seed(7)
    vocab = 5
    logits = torch.randn(3, vocab) * 1.2
    drafts = [int(logits[0].argmax()), int(logits[1].argmin())]  # a likely and an unlikely draft
    params = SamplingParams(temperature=1.0)
    probs = sampling_probs(logits, [_row(params, history=(1, 2) + tuple(drafts[:j])) for j in range(3)])
    point_mass = torch.zeros(2, vocab, dtype=probs.dtype)
    point_mass[0, drafts[0]] = point_mass[1, drafts[1]] = 1.0
    coupled: dict[tuple[int, ...], int] = {}
    reference: dict[tuple[int, ...], int] = {}
    for seed in range(6000):
        out = _verify_one(logits, _row(params, history=(1, 2), generator=torch.Generator().manual_seed(seed)), drafts)
        coupled[tuple(out.token_ids)] = coupled.get(tuple(out.token_ids), 0) + 1
        emitted, _ = rejection_sample(probs, point_mass, drafts, torch.Generator().manual_seed(10**6 + seed))
        reference[tuple(emitted)] = reference.get(tuple(emitted), 0) + 1
    outcomes = sorted(set(coupled) | set(reference))
    table = torch.tensor([[float(run.get(o, 0)) for o in outcomes] for run in (coupled, reference)])
    table = table[:, table.sum(0) >= 10]  # rare outcomes would make the statistic unreliable
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    statistic = float(((table - expected) ** 2 / expected).sum())
    degrees = table.shape[1] - 1
    z, a = 3.0902, 2.0 / (9.0 * degrees)  # the 0.1% point of chi-square (Wilson-Hilferty)
    assert statistic < degrees * (1.0 - a + z * a**0.5) ** 3, (statistic, degrees)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.9, top_k=4), SamplingParams(temperature=1.3)])
def test_seeded_verification_gives_the_tokens_of_one_at_a_time_sampling(params):
    """The same seed: the tokens a step emits, and the generator state after it, are those of sampling
    the same positions one at a time (so seeded output does not depend on speculation)."""
    torch.manual_seed(1)
    logits = torch.randn(4, 30)
    for seed in range(40):
        drafts = [int(logits[j].argmax()) for j in range(3)]
        with_drafts = torch.Generator().manual_seed(seed)
        out = _verify_one(logits, _row(params, history=(1, 2), generator=with_drafts), drafts)
        one_at_a_time = torch.Generator().manual_seed(seed)
        for j, token_id in enumerate(out.token_ids):
            row = _row(params, history=(1, 2) + tuple(out.token_ids[:j]), generator=one_at_a_time)
            assert sample(logits[j : j + 1], [row]).token_ids == [token_id]
        assert torch.equal(with_drafts.get_state(), one_at_a_time.get_state())


def test_ngram_proposals_match_the_reference():
    rng = random.Random(0)
    for _ in range(2000):
        tokens = [rng.randint(0, 4) for _ in range(rng.randint(0, 40))]
        k, low = rng.randint(0, 6), rng.randint(1, 3)
        high = rng.randint(low, 5)
        assert propose_ngram(tokens, k, low, high) == reference_propose_ngram(tokens, k, low, high)


def test_ngram_prefers_the_longest_then_the_latest_match():
    #         0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [1, 2, 3, 9, 8, 2, 3, 7, 6, 5, 2, 3]
    # suffix [2, 3] occurs at 1 and 5; the latest (5) is followed by 7, 6, ...
    assert propose_ngram(tokens, 3, 2, 2) == [7, 6, 5]
    # a longer suffix [1, 2, 3] only occurs at 0, so with ngram_max 3 it wins
    assert propose_ngram([1, 2, 3, 4, 2, 3, 5, 1, 2, 3], 2, 2, 3) == [4, 2]
    assert propose_ngram([1, 2, 3, 4], 3, 2, 3) == []  # no earlier occurrence
    assert propose_ngram([1, 2, 1, 2], 5, 2, 2) == [1, 2]  # stops where the tokens end
