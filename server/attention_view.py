"""AttentionView: runs POST /attention's reference forwards one at a time and keeps the last one.

A forward holds the torch worker for as long as a prefill of the prompt, so only one runs at once
(another request meanwhile: 429 with Retry-After). The page asks for one layer and head at a time;
the last prompt's weights are kept, so switching the layer or head costs no forward.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from engine.runner.attention_probe import AttentionWeights
from engine.serving.async_engine import AsyncEngine
from server.errors import APIError


@dataclass
class AttentionView:
    is_running: bool = False
    last: AttentionWeights | None = None  # float32 [L, H, T, T]: at most ~70 MB for a 30-layer model

    async def weights(
        self, engine: AsyncEngine, token_ids: list[int], sliding_window: int | None, num_sink_tokens: int
    ) -> AttentionWeights:
        last = self.last
        if (
            last is not None
            and last.token_ids == tuple(token_ids)
            and last.sliding_window == sliding_window
            and last.num_sink_tokens == num_sink_tokens
        ):
            return last
        if self.is_running:
            raise APIError(
                429,
                "an attention request is already running; retry after Retry-After",
                type="rate_limit_error",
                code="attention_busy",
                headers={"Retry-After": "1"},
            )
        self.is_running = True
        self.last = None  # the old weights' memory goes before the new ones are made
        job = asyncio.ensure_future(engine.attention_weights(token_ids, sliding_window, num_sink_tokens))
        job.add_done_callback(self._finished)
        # A client that hangs up does not end the forward (the worker runs it to the end): the view
        # stays busy until it does, so hang-ups cannot queue forwards behind each other.
        return await asyncio.shield(job)

    def _finished(self, job: asyncio.Future) -> None:
        self.is_running = False
        if not job.cancelled() and job.exception() is None:
            self.last = job.result()
