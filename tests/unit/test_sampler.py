"""The sampler's per-row parameters, each against a plain computation."""

from __future__ import annotations

import pytest
import torch

from engine.errors import InvalidRequestError
from engine.params import SamplingParams
from engine.runner.sampler import SamplingRow, sample, sampling_probs

VOCAB = 50


def _row(params: SamplingParams, token_ids=(1, 2, 3), num_prompt=2, seed=None) -> SamplingRow:
    generator = None
    if seed is not None:
        generator = torch.Generator().manual_seed(seed)
    return SamplingRow(params, list(token_ids), num_prompt, eos_token_ids=(0,), generator=generator)


def test_greedy_takes_argmax_per_row():
    logits = torch.randn(4, VOCAB)
    out = sample(logits, [_row(SamplingParams(temperature=0)) for _ in range(4)])
    assert out.token_ids == logits.argmax(-1).tolist()


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = torch.randn(2, VOCAB)
    rows = [_row(SamplingParams(temperature=1.0, top_k=1)), _row(SamplingParams(temperature=1.0, top_p=1e-6))]
    for _ in range(5):
        assert sample(logits, rows).token_ids == logits.argmax(-1).tolist()


def test_top_k_restricts_to_k_best():
    logits = torch.randn(1, VOCAB)
    allowed = set(logits[0].topk(3).indices.tolist())
    row = _row(SamplingParams(temperature=5.0, top_k=3))
    seen = {sample(logits, [row]).token_ids[0] for _ in range(200)}
    assert seen <= allowed and len(seen) > 1


def test_min_p_drops_unlikely_tokens():
    logits = torch.full((1, VOCAB), -10.0)
    logits[0, 7] = 5.0
    logits[0, 9] = 4.5
    row = _row(SamplingParams(temperature=1.0, min_p=0.1))
    seen = {sample(logits, [row]).token_ids[0] for _ in range(200)}
    assert seen == {7, 9}


def test_sampling_frequencies_follow_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0] + [-1e9] * (VOCAB - 3)])
    row = _row(SamplingParams(temperature=1.0, seed=0), seed=0)
    counts = torch.zeros(3)
    for _ in range(3000):
        counts[sample(logits, [row]).token_ids[0]] += 1
    expected = torch.softmax(torch.tensor([2.0, 1.0, 0.0]), 0)
    assert torch.allclose(counts / counts.sum(), expected, atol=0.03)


def test_seeded_row_independent_of_batch():
    logits = torch.randn(3, VOCAB)
    params = SamplingParams(temperature=1.0, seed=42)
    alone = [sample(logits[1:2], [_row(params, seed=42)]).token_ids[0] for _ in range(1)]
    batch_rows = [_row(SamplingParams(temperature=1.0)), _row(params, seed=42), _row(SamplingParams(temperature=0.5))]
    together = sample(logits, batch_rows).token_ids[1]
    assert alone[0] == together


@pytest.mark.parametrize("shaping", [{}, {"min_p": 0.05}], ids=["plain", "min_p"])
def test_a_rows_sampling_distribution_is_the_same_bits_alone_and_in_a_batch(shaping):
    """The distribution a row draws from may not depend on the rows beside it, to the last bit: over a 49k
    vocabulary of nearly flat logits a draw now and then lands within float32 rounding of a CDF boundary, so
    every total the sampler takes of a row must be summed in one order whatever the batch."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 49152, generator=gen) * 0.5
    rows = [_row(SamplingParams(temperature=0.8, seed=seed, **shaping), seed=seed) for seed in range(len(logits))]
    together = sampling_probs(logits, rows)
    for i in range(len(logits)):
        assert torch.equal(sampling_probs(logits[i : i + 1], rows[i : i + 1])[0], together[i]), i


def test_penalties_match_plain_formulas():
    logits = torch.randn(1, VOCAB)
    params = SamplingParams(temperature=0, repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.25)
    token_ids = [4, 5, 5, 6]  # prompt [4, 5], output [5, 6]
    expected = logits.clone()[0]
    for t in {4, 5, 6}:
        expected[t] = expected[t] / 1.5 if expected[t] > 0 else expected[t] * 1.5
    expected[5] -= 0.25 * 1 + 0.5
    expected[6] -= 0.25 * 1 + 0.5
    out = sample(logits, [_row(params, token_ids, num_prompt=2)])
    assert out.token_ids[0] == int(expected.argmax())
    # The penalized logits decide: bias the expected winner away and see it change.
    winner = int(expected.argmax())
    biased = SamplingParams(**{**params.__dict__, "logit_bias": {winner: -100.0}})
    assert sample(logits, [_row(biased, token_ids, num_prompt=2)]).token_ids[0] != winner


def test_logit_bias_forces_token():
    logits = torch.randn(2, VOCAB)
    out = sample(logits, [_row(SamplingParams(temperature=0, logit_bias={13: 100.0}))] * 2)
    assert out.token_ids == [13, 13]


def test_min_tokens_bans_eos_and_stop_ids():
    logits = torch.zeros(1, VOCAB)
    logits[0, 0] = 10.0  # EOS
    logits[0, 8] = 9.0  # a stop token id
    params = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[8])
    assert sample(logits, [_row(params, token_ids=(1, 2), num_prompt=2)]).token_ids[0] not in (0, 8)
    # After min_tokens outputs EOS is allowed again.
    assert sample(logits, [_row(params, token_ids=(1, 2, 3, 4, 5), num_prompt=2)]).token_ids[0] == 0


def test_logprobs_are_raw_log_softmax():
    logits = torch.randn(1, VOCAB)
    out = sample(logits, [_row(SamplingParams(temperature=0, logprobs=3))])
    lp = out.logprobs[0]
    reference = torch.log_softmax(logits[0], 0)
    assert lp.token_id == int(reference.argmax())
    assert lp.logprob == pytest.approx(float(reference.max()), abs=1e-6)
    assert [t for t, _ in lp.top] == reference.topk(3).indices.tolist()


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -1),
        ("top_p", 0),
        ("top_k", -2),
        ("n", 0),
        ("max_tokens", 0),
        ("min_p", 2),
        ("presence_penalty", 3),
        ("repetition_penalty", 0),
        ("logprobs", 21),
        ("seed", -1),
    ],
)
def test_invalid_values_raise_naming_the_field(field, value):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**{field: value})
    assert err.value.param == field


@pytest.mark.parametrize("temperature", [0.3, 1.0, 30.0])
def test_candidate_distribution_equals_full_sort_reference(temperature):
    from engine.runner.sampler import candidate_distribution, reference_distribution

    torch.manual_seed(0)
    vocab = 5000
    logits = torch.randn(7, vocab) * 4 / temperature
    top_k = torch.tensor([vocab, 10, 300, vocab, 4000, vocab, vocab])
    top_p = torch.tensor([0.9, 1.0, 0.5, 0.999, 0.95, 0.3, 1.0])
    min_p = torch.tensor([0.0, 0.0, 0.1, 0.0, 0.0, 0.0, 0.2])
    probs, token_ids, decided = candidate_distribution(logits, top_k, top_p, min_p, num_candidates=64)
    reference = reference_distribution(logits, top_k, top_p, min_p)
    assert bool(decided[1]) and bool(decided[2])  # top-k inside the candidates
    for row in decided.nonzero().flatten().tolist():
        dense = torch.zeros(vocab).scatter(0, token_ids[row], probs[row])
        torch.testing.assert_close(dense, reference[row], atol=1e-6, rtol=1e-5)
    if temperature >= 30.0:
        assert not bool(decided.all())  # flat rows fall back to the full vocabulary


def test_flat_distribution_falls_back_and_still_follows_top_p():
    vocab = 2000
    logits = torch.zeros(1, vocab)
    logits[0, :1000] = 1.0  # nucleus of 0.5 holds ~ the first 731 tokens, far beyond 256 candidates
    row = _row(SamplingParams(temperature=1.0, top_p=0.5))
    seen = {sample(logits, [row]).token_ids[0] for _ in range(300)}
    assert max(seen) < 1000 and len(seen) > 200
