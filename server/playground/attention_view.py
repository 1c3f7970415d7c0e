"""AttentionView: runs POST /attention's reference forwards one at a time and keeps the last two.

A forward holds the torch worker for as long as a prefill of the prompt, so only one runs at once
(another request meanwhile: 429 with Retry-After). The page asks for one layer and head at a time,
for one prompt or (comparing) the same prompt without and with a window: the last two forwards'
weights are kept, so switching the layer or head costs no forward. Each holds L x H x T x T float32
weights: 71 MB for a 30-layer, 9-head model at 256 tokens, 268 MB for 32 layers of 32 heads.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from engine import AsyncEngine
from engine.inspect import AttentionWeights
from server.errors import APIError

KEPT_FORWARDS = 2


@dataclass
class AttentionView:
    is_running: bool = False
    kept: list[AttentionWeights] = field(default_factory=list)  # the newest last, at most KEPT_FORWARDS

    async def weights(
        self,
        engine: AsyncEngine,
        token_ids: list[int],
        sliding_window: int | None,
        num_sink_tokens: int,
        layer_windows: tuple[int | None, ...] | None = None,
    ) -> AttentionWeights:
        """Every layer under sliding_window, or each under its own (layer_windows)."""
        for kept in self.kept:
            if (
                kept.token_ids == tuple(token_ids)
                and kept.sliding_window == sliding_window
                and kept.num_sink_tokens == num_sink_tokens
                and (layer_windows is None or kept.layer_windows == layer_windows)
                and (layer_windows is not None or set(kept.layer_windows) == {sliding_window})
            ):
                return kept
        if self.is_running:
            raise APIError(
                429,
                "an attention request is already running; retry after Retry-After",
                type="rate_limit_error",
                code="attention_busy",
                headers={"Retry-After": "1"},
            )
        self.is_running = True
        del self.kept[: len(self.kept) - KEPT_FORWARDS + 1]  # the oldest goes before the new one is made
        job = asyncio.ensure_future(engine.attention_weights(token_ids, sliding_window, num_sink_tokens, layer_windows))
        job.add_done_callback(self._finished)
        # A client that hangs up does not end the forward (the worker runs it to the end): the view
        # stays busy until it does, so hang-ups cannot queue forwards behind each other.
        return await asyncio.shield(job)

    def _finished(self, job: asyncio.Future) -> None:
        self.is_running = False
        if not job.cancelled() and job.exception() is None:
            self.kept.append(job.result())
