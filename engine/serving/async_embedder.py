"""AsyncEmbedder: the dynamic batcher in front of `Embedder`.

Every request's inputs are tokenized on arrival (errors go back to that request alone), then
queued one item per input. One batching task takes queued items in arrival order up to the token
budget (`max_batch_tokens` real tokens; a single longer input goes alone), sorts them by length
(attention groups neighbours of similar length; the rest of the forward is packed, padding-free)
and runs one forward in the embedder's own worker thread, so the event loop keeps serving.
While a forward runs, new requests queue up and ride in the next one: many one-input requests
share a forward, and one big request is split across several.

Threads and generation: forwards run on a single-thread executor, one at a time. In the server
that is the one thread that runs all torch work (engine/serving/torch_thread.py explains why: two
threads doing torch work halve the speed of both), so an embedding forward and a generation
step take turns in FIFO order: neither starves. The token budget bounds how long one embedding
forward holds the thread (~8k MiniLM tokens is well under a second on 2 cores), so generation
latency degrades gracefully rather than stalling. Standalone, the embedder makes its own thread.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from concurrent.futures import Executor
from dataclasses import dataclass, field

import torch

from engine.config import EmbedderConfig
from engine.embedder import Embedder, EmbedInputs, EmbedResult, finalize
from engine.serving.torch_thread import single_torch_thread

logger = logging.getLogger(__name__)

# Requests with more inputs than this are tokenized in the worker thread so a big request does not
# hold the event loop; tiny ones are cheaper to tokenize inline than to hop threads.
_INLINE_TOKENIZE_MAX_INPUTS = 8


@dataclass(eq=False)
class _Request:
    """One embed() call waiting for its pooled vectors."""

    num_inputs: int
    future: asyncio.Future
    pooled: list[torch.Tensor | None] = field(default_factory=list)
    num_pending: int = 0

    def __post_init__(self) -> None:
        self.pooled = [None] * self.num_inputs
        self.num_pending = self.num_inputs


@dataclass(eq=False)
class _Item:
    """One input of one request: its token ids and where its vector goes."""

    request: _Request
    index: int
    token_ids: list[int]


class AsyncEmbedder:
    """Dynamic batching over an `Embedder`; all public methods run on the event loop."""

    def __init__(self, embedder: Embedder) -> None:
        self.embedder = embedder
        self.max_batch_tokens = embedder.config.max_batch_tokens
        self._queue: collections.deque[_Item] = collections.deque()
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._executor: Executor | None = None
        self._owns_executor = False
        self.num_forwards = 0  # forwards run so far (tests and logs read it)

    @classmethod
    def from_config(cls, config: EmbedderConfig) -> AsyncEmbedder:
        return cls(Embedder(config))

    # ---------------------------------------------------------------- facts

    @property
    def model_name(self) -> str:
        return self.embedder.model_name

    @property
    def max_model_len(self) -> int:
        return self.embedder.max_model_len

    @property
    def hidden_size(self) -> int:
        return self.embedder.hidden_size

    @property
    def is_healthy(self) -> bool:
        """True while the batching task runs (started and not crashed)."""
        return self._task is not None and not self._task.done()

    @property
    def num_queued_inputs(self) -> int:
        return len(self._queue)

    # ---------------------------------------------------------------- lifecycle

    async def start(self, executor: Executor | None = None) -> None:
        """Start batching; forwards run on `executor` (one thread), or on a thread of its own."""
        if self._task is not None:
            return
        self._wakeup = asyncio.Event()
        self._owns_executor = executor is None
        self._executor = executor or single_torch_thread("kvserve-embed")
        self._task = asyncio.create_task(self._batch_loop(), name="kvserve-embed-batcher")

    async def stop(self) -> None:
        """Stop batching; requests still queued fail with RuntimeError."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        self._fail_queued(RuntimeError("the embedding model is shutting down"))
        executor, self._executor = self._executor, None
        # Waits for a forward still running, without blocking the event loop.
        if executor is not None and self._owns_executor:
            await asyncio.get_running_loop().run_in_executor(None, executor.shutdown, True)

    # ---------------------------------------------------------------- requests

    async def embed(
        self,
        inputs: EmbedInputs,
        *,
        normalize: bool | None = None,
        truncate: bool = False,
        truncation_direction: str = "right",
        dimensions: int | None = None,
    ) -> EmbedResult:
        """Embed one request's inputs (batched with whatever else is queued) -> vectors in input order.

        Raises InvalidRequestError for bad input (nothing is queued then)."""
        if not self.is_healthy:
            raise RuntimeError("the embedding model is not running")
        self.embedder.check_dimensions(dimensions)
        if len(inputs) > _INLINE_TOKENIZE_MAX_INPUTS:
            loop = asyncio.get_running_loop()
            token_ids = await loop.run_in_executor(None, self.embedder.tokenize, inputs, truncate, truncation_direction)
        else:
            token_ids = self.embedder.tokenize(inputs, truncate, truncation_direction)
        request = _Request(num_inputs=len(token_ids), future=asyncio.get_running_loop().create_future())
        self._queue.extend(_Item(request, i, ids) for i, ids in enumerate(token_ids))
        assert self._wakeup is not None
        self._wakeup.set()
        try:
            await request.future
        except asyncio.CancelledError:
            request.future.cancel()  # its queued items are skipped when batches are formed
            raise
        pooled = torch.stack(request.pooled)  # type: ignore[arg-type]
        vectors = finalize(pooled, self.embedder.normalize if normalize is None else normalize, dimensions)
        return EmbedResult(vectors=vectors, num_prompt_tokens=sum(len(ids) for ids in token_ids))

    # ---------------------------------------------------------------- batching

    def _take_batch(self) -> list[_Item]:
        """Queued items in arrival order up to the token budget (at least one), sorted by length."""
        batch: list[_Item] = []
        num_tokens = 0
        while self._queue:
            item = self._queue[0]
            if item.request.future.done():  # cancelled by its client or failed: drop
                self._queue.popleft()
                continue
            if batch and num_tokens + len(item.token_ids) > self.max_batch_tokens:
                break
            batch.append(self._queue.popleft())
            num_tokens += len(item.token_ids)
        batch.sort(key=lambda it: len(it.token_ids))
        return batch

    async def _batch_loop(self) -> None:
        assert self._wakeup is not None
        loop = asyncio.get_running_loop()
        while True:
            await self._wakeup.wait()
            batch = self._take_batch()
            if not self._queue:
                self._wakeup.clear()
            if not batch:
                continue
            try:
                pooled = await loop.run_in_executor(
                    self._executor, self.embedder.forward_pooled, [it.token_ids for it in batch]
                )
            except asyncio.CancelledError:
                self._fail_items(batch, RuntimeError("the embedding model is shutting down"))
                raise
            except Exception as exc:
                logger.exception("embedding forward over %d inputs failed", len(batch))
                self._fail_items(batch, exc)
                continue
            self.num_forwards += 1
            for item, vector in zip(batch, pooled, strict=True):
                self._deliver(item, vector)

    @staticmethod
    def _deliver(item: _Item, vector: torch.Tensor) -> None:
        request = item.request
        if request.future.done():
            return
        request.pooled[item.index] = vector
        request.num_pending -= 1
        if request.num_pending == 0:
            request.future.set_result(None)

    @staticmethod
    def _fail_items(items: list[_Item], exc: BaseException) -> None:
        for item in items:
            if not item.request.future.done():
                item.request.future.set_exception(exc)

    def _fail_queued(self, exc: BaseException) -> None:
        items = list(self._queue)
        self._queue.clear()
        self._fail_items(items, exc)
