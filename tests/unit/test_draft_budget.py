"""The draft budget: the step-cost fit, and slots given where they pay for themselves."""

from __future__ import annotations

import itertools

import pytest

from engine.spec.draft_budget import MIN_TIMED_STEPS, StepCostModel, plan_draft_slots


def _step_seconds(num_seqs: int, num_drafts: int, cost=(0.004, 0.003, 0.002)) -> float:
    return cost[0] + cost[1] * num_seqs + cost[2] * num_drafts


def _shapes(count: int):
    """(sequences, drafts) of a mixed run: batches of 1 to 4, with and without drafts."""
    return [(1 + i % 4, (i // 4) % 3 * (1 + i % 4)) for i in range(count)]


def test_the_cost_model_recovers_a_linear_step_time():
    model = StepCostModel()
    shapes = _shapes(MIN_TIMED_STEPS)
    for num_seqs, num_drafts in shapes[:-1]:
        model.observe(num_seqs, num_drafts, _step_seconds(num_seqs, num_drafts))
    assert model.fit() is None  # not enough steps yet
    model.observe(*shapes[-1], _step_seconds(*shapes[-1]))
    assert model.fit() == pytest.approx((0.004, 0.003, 0.002))


def test_the_cost_model_needs_steps_of_different_shapes():
    model = StepCostModel()
    for _ in range(3 * MIN_TIMED_STEPS):
        model.observe(4, 0, 0.01)  # never a draft: what one costs is unknown
    assert model.fit() is None


def test_the_cost_model_follows_a_change_of_load():
    model = StepCostModel()
    for num_seqs, num_drafts in _shapes(400):
        model.observe(num_seqs, num_drafts, _step_seconds(num_seqs, num_drafts))
    for num_seqs, num_drafts in _shapes(400):
        model.observe(num_seqs, num_drafts, _step_seconds(num_seqs, num_drafts, (0.004, 0.003, 0.006)))
    assert model.fit()[2] == pytest.approx(0.006, rel=0.05)


def test_without_a_cost_model_everyone_gets_their_most():
    assert plan_draft_slots([0.9, 0.1], [3, 2], 2, None) == [3, 2]


def test_free_drafts_are_all_taken():
    """Bound by reading weights: another position costs nothing, so every allowed draft is worth it."""
    assert plan_draft_slots([0.9, 0.05], [4, 4], 2, (0.05, 0.001, 0.0)) == [4, 4]


def test_costly_drafts_go_where_they_are_likely_kept():
    # 7 ms a step, 3 ms a sequence or a draft. Candidate 0 keeps 90% of drafts, candidate 1 10%.
    assert plan_draft_slots([0.9, 0.1], [3, 3], 2, (0.007, 0.003, 0.003)) == [3, 0]


def test_drafts_stop_paying_in_a_large_batch_when_each_position_costs_as_much_as_a_token():
    """Arithmetic-bound: 8 sequences' tokens already fill the step; a draft kept 60% of the time adds
    less than the step's average of tokens per second."""
    assert plan_draft_slots([0.6] * 8, [3] * 8, 8, (0.002, 0.003, 0.003)) == [0] * 8
    # One sequence: its first draft pays (0.6 of a token for 3 ms, against 1 token for 10 ms), its
    # second does not (0.36 for 3 ms, against 1.6 for 13 ms).
    assert plan_draft_slots([0.6], [3], 1, (0.007, 0.003, 0.003)) == [1]


def test_the_plan_is_the_best_split():
    """Against every split of slots: the greedy plan's tokens per second is the best one."""
    rates, most, cost = [0.8, 0.5, 0.3], [3, 3, 3], (0.006, 0.002, 0.002)

    def goodput(slots):
        tokens = len(rates) + sum(sum(a ** (j + 1) for j in range(s)) for a, s in zip(rates, slots))
        return tokens / (cost[0] + cost[1] * len(rates) + cost[2] * sum(slots))

    best = max(itertools.product(*(range(m + 1) for m in most)), key=goodput)
    plan = plan_draft_slots(rates, most, len(rates), cost)
    assert goodput(plan) == pytest.approx(goodput(best))
