"""AttentionView: one forward at a time, the last two kept, and a caller that goes away mid-forward."""

from __future__ import annotations

import asyncio

import pytest
import torch

from engine.attention.probe import AttentionWeights
from server.errors import APIError
from server.playground.attention_view import KEPT_FORWARDS, AttentionView


class FakeEngine:
    """attention_weights() waits for `release` (when set), then answers with the ids it was given."""

    def __init__(self) -> None:
        self.release: asyncio.Event | None = None
        self.calls: list[tuple] = []

    async def attention_weights(self, token_ids, sliding_window, num_sink_tokens, layer_windows=None):
        self.calls.append((tuple(token_ids), sliding_window, num_sink_tokens, layer_windows))
        if self.release is not None:
            await self.release.wait()
        n = len(token_ids)
        windows = layer_windows or (sliding_window,)  # one layer
        return AttentionWeights(tuple(token_ids), torch.zeros(1, 1, n, n), sliding_window, num_sink_tokens, windows)


def test_the_last_two_forwards_are_kept():
    async def main() -> None:
        view, engine = AttentionView(), FakeEngine()
        plain = await view.weights(engine, [1, 2], None, 0)
        windowed = await view.weights(engine, [1, 2], 4, 1)  # the compare view's pair
        assert await view.weights(engine, [1, 2], None, 0) is plain
        assert await view.weights(engine, [1, 2], 4, 1) is windowed
        assert len(engine.calls) == 2
        await view.weights(engine, [3], None, 0)
        assert len(view.kept) == KEPT_FORWARDS == 2
        assert [k.token_ids for k in view.kept] == [(1, 2), (3,)]  # the oldest went
        await view.weights(engine, [1, 2], None, 0)
        assert len(engine.calls) == 4
        # Each layer under its own window is another forward than every layer under one.
        await view.weights(engine, [1, 2], 4, 0, layer_windows=(None, 4))
        assert engine.calls[-1][3] == (None, 4) and len(engine.calls) == 5
        assert await view.weights(engine, [1, 2], 4, 0, layer_windows=(None, 4)) is view.kept[-1]
        await view.weights(engine, [1, 2], 4, 0)
        assert len(engine.calls) == 6

    asyncio.run(main())


def test_a_caller_that_goes_away_leaves_the_view_busy_until_the_forward_ends():
    async def main() -> None:
        view, engine = AttentionView(), FakeEngine()
        engine.release = asyncio.Event()
        caller = asyncio.create_task(view.weights(engine, [5, 6], None, 0))
        await asyncio.sleep(0.01)
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        assert view.is_running  # the forward goes on: a new one must wait, not pile up behind it
        with pytest.raises(APIError) as busy:
            await view.weights(engine, [7], None, 0)
        assert busy.value.status_code == 429 and busy.value.code == "attention_busy"
        engine.release.set()
        for _ in range(100):
            if not view.is_running:
                break
            await asyncio.sleep(0.01)
        assert not view.is_running
        assert view.kept[-1].token_ids == (5, 6)  # kept: asking again costs no forward
        assert await view.weights(engine, [5, 6], None, 0) is view.kept[-1]
        assert len(engine.calls) == 1

    asyncio.run(main())


def test_a_failed_forward_frees_the_view():
    class Broken(FakeEngine):
        async def attention_weights(self, token_ids, sliding_window, num_sink_tokens, layer_windows=None):
            raise RuntimeError("boom")

    async def main() -> None:
        view = AttentionView()
        with pytest.raises(RuntimeError):
            await view.weights(Broken(), [1], None, 0)
        assert not view.is_running and view.kept == []

    asyncio.run(main())
