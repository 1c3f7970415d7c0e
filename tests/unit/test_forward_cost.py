"""ForwardCost fits fixed + per-token seconds; TorchWorker times each kind of job."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from engine.serving.forward_cost import ForwardCost
from engine.serving.torch_worker import GENERATION_TURN, TorchWorker


def test_the_fit_recovers_a_line_and_sizes_a_turn():
    cost = ForwardCost()
    assert cost.tokens_within(0.01) is None  # nothing timed yet
    for tokens in (16, 64, 256, 1024, 40, 500):
        cost.note(tokens, 0.010 + 0.0002 * tokens)  # 10 ms fixed, 0.2 ms a token
    fixed, per_token = cost.fit()
    assert fixed == pytest.approx(0.010) and per_token == pytest.approx(0.0002)
    assert cost.tokens_within(0.030) == pytest.approx(100, abs=1)
    assert cost.tokens_within(0.005) == 0  # not even the fixed part fits: the caller still sends one input


def test_without_spread_in_sizes_the_cost_per_token_is_the_average():
    cost = ForwardCost()
    for _ in range(5):
        cost.note(50, 0.020)
    assert cost.fit() == (0.0, pytest.approx(0.020 / 50))
    assert cost.tokens_within(0.040) == 100


def test_the_worker_times_each_kind_and_knows_when_it_is_busy():
    worker = TorchWorker()
    gate = threading.Event()

    async def main() -> None:
        assert worker.recent_turn_seconds(GENERATION_TURN) is None  # never ran
        await worker.run(time.sleep, 0.02, kind=GENERATION_TURN)
        assert worker.busy_seconds(GENERATION_TURN) >= 0.02
        assert worker.recent_turn_seconds(GENERATION_TURN) >= 0.02  # ended just now: still active
        assert worker.recent_turn_seconds(GENERATION_TURN, within_s=0.0) is None  # none waiting, none recent
        waiting = asyncio.ensure_future(worker.run(gate.wait, 10, kind=GENERATION_TURN))
        await asyncio.sleep(0.01)
        assert worker.recent_turn_seconds(GENERATION_TURN, within_s=0.0) is not None  # one runs: active
        gate.set()
        await waiting
        worker.want_turns(GENERATION_TURN, True)  # between two steps, the loop still has work
        assert worker.recent_turn_seconds(GENERATION_TURN, within_s=0.0) is not None
        worker.want_turns(GENERATION_TURN, False)
        assert worker.recent_turn_seconds(GENERATION_TURN, within_s=0.0) is None
        assert worker.busy_seconds("embedding") == 0.0
        await worker.stop()

    asyncio.run(main())
