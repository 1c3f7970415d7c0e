"""AsyncEncoder: embeddings' client of the torch worker. The one dynamic batcher in front of `Embedder`.

Every request's inputs are tokenized on arrival, on the text worker
(engine/serving/text_worker.py: the only thread that uses the embedder's
tokenizers, so a long input never holds up the event loop; errors go back to
that request alone), then queued one item per input. One batching task takes
queued items in arrival order up to the token budget (a single longer input
goes alone), sorts them by length (attention groups neighbours of similar
length; the rest of the forward is packed, padding-free) and runs one
forward on the torch worker. Pooling, Matryoshka truncation and normalisation
run in that same job, so the event loop never does torch work. While a forward
runs, new requests queue up and ride in the next one: many one-input requests
share a forward, and one big request is split across several.

The budget is `max_batch_tokens` real tokens while generation is idle. While it
runs, generation steps and embedding forwards share the one torch worker, and a
stream whose next step waits behind an embedding forward gets its next token
that much later. So, while generation runs:
- a forward gets only the tokens expected to fit in one generation step (at
  least one input), by a cost model (fixed + per-token seconds) fitted to the
  recent forwards (engine/serving/forward_cost.py);
- after a forward, the embedder waits until generation has had its share of the
  worker (`embedding_share` of the time goes to embeddings: with 1/3, a 20 ms
  forward is followed by at least 40 ms of generation steps).
A stream's inter-token time then stays at its idle pace for most tokens, and
within about two steps for the one after each embedding forward, while
embeddings still get a steady share of the worker (and 429s past the queue
bound).

The contract is generation's (engine/serving/torch_worker.py): more than
`max_queued_requests` requests waiting -> QueueFullError; a request still
unanswered at its deadline -> RequestTimeoutError, and its queued inputs are
dropped; the caller's task cancelled (client gone) -> its queued inputs are
dropped; a failed forward -> EngineStepError for the requests in that batch
only; the batching task or the worker dead -> EngineDeadError.

It drives a `Reranker` (engine/pooling/reranker.py) the same way: its inputs are (query, document)
pairs, its `forward_pooled` answers one logit row per pair, and `what` names it in errors.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.errors import EngineDeadError, EngineStepError, RequestTimeoutError
from engine.pooling.embedder import Embedder, EmbedInputs, EmbedResult, finalize
from engine.pooling.reranker import Reranker, TextPair
from engine.serving.forward_cost import ForwardCost
from engine.serving.text_worker import TextWorker
from engine.serving.torch_worker import EMBEDDING_TURN, GENERATION_TURN, RequestLimits, TorchWorker, wait_until

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _EncodeRequest:
    """One embed() call waiting for its vectors."""

    num_inputs: int
    normalize: bool
    dimensions: int | None
    future: asyncio.Future
    rows: list[np.ndarray | None] = field(default_factory=list)  # finished vectors, in input order
    num_pending: int = 0

    def __post_init__(self) -> None:
        self.rows = [None] * self.num_inputs
        self.num_pending = self.num_inputs


@dataclass(eq=False)
class _Item:
    """One input of one request: its token ids and where its vector goes."""

    request: _EncodeRequest
    index: int
    token_ids: list[int]


class AsyncEncoder:
    """Dynamic batching over an `Embedder` (or a `Reranker`); all public methods run on the event loop."""

    def __init__(
        self,
        embedder: Embedder | Reranker,
        *,
        limits: RequestLimits | None = None,
        embedding_share: float = 1 / 3,
        what: str = "embedding",
    ) -> None:
        self.embedder = embedder
        self.what = what  # the model's task, as errors name it: "embedding", "rerank"
        self.limits = limits or RequestLimits()
        self.max_batch_tokens = embedder.config.max_batch_tokens
        if not 0 < embedding_share <= 1:
            raise ValueError(f"embedding_share must be in (0, 1], got {embedding_share}")
        self.embedding_share = embedding_share  # of the worker's time while generation runs
        self._cost = ForwardCost()
        self._generation_owed_until = 0.0  # the worker's generation busy-seconds to reach before the next forward
        self._queue: collections.deque[_Item] = collections.deque()
        self._not_started: set[_EncodeRequest] = set()
        self._num_tokenizing = 0  # admitted requests whose inputs are still being tokenized
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._worker: TorchWorker | None = None
        self._text_worker: TextWorker | None = None
        self._owns_worker = False
        self._owns_text_worker = False
        self.num_forwards = 0  # forwards run so far (tests and logs read it)

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
        """True while the batching task runs (started and not crashed) and the worker is alive."""
        return self._task is not None and not self._task.done() and self._worker is not None and self._worker.is_alive

    @property
    def num_queued_requests(self) -> int:
        """Requests admitted none of whose inputs has gone into a forward yet (tokenizing or queued)."""
        return len(self._not_started) + self._num_tokenizing

    # ---------------------------------------------------------------- lifecycle

    async def start(self, worker: TorchWorker | None = None, text_worker: TextWorker | None = None) -> None:
        """Start batching; forwards run on `worker` (the server's one torch worker) and tokenization on
        `text_worker` (the server's one text worker), or on workers of its own."""
        if self._task is not None:
            return
        self._wakeup = asyncio.Event()
        self._owns_worker = worker is None
        self._worker = worker or TorchWorker("kvserve-embed")
        self._owns_text_worker = text_worker is None
        self._text_worker = text_worker or TextWorker("kvserve-embed-text")
        self._task = asyncio.create_task(self._batch_loop(), name="kvserve-embed-batcher")

    async def stop(self) -> None:
        """Stop batching; requests still queued fail with EngineDeadError."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        self._fail_queued(EngineDeadError(f"the {self.what} model is shutting down"))
        if self._owns_worker and self._worker is not None:
            await self._worker.stop()
        if self._owns_text_worker and self._text_worker is not None:
            await self._text_worker.stop()

    # ---------------------------------------------------------------- requests

    async def embed(
        self,
        inputs: EmbedInputs | Sequence[TextPair],
        *,
        normalize: bool | None = None,
        truncate: bool = False,
        truncation_direction: str = "right",
        dimensions: int | None = None,
    ) -> EmbedResult:
        """Embed one request's inputs (batched with whatever else is queued) -> vectors in input order.

        Raises InvalidRequestError for bad input (nothing is queued then), QueueFullError,
        RequestTimeoutError, EngineStepError, EngineDeadError.
        """
        if not self.is_healthy:
            raise EngineDeadError(f"the {self.what} model is not running")
        deadline = self.limits.admit(self.num_queued_requests, self.what)
        self.embedder.check_dimensions(dimensions)
        assert self._text_worker is not None
        # characters, or token ids; both texts of a pair
        size = sum(sum(map(len, x)) if isinstance(x, tuple) else len(x) for x in inputs)
        self._num_tokenizing += 1  # it holds its place in the queue bound while it waits for the text worker
        try:
            token_ids = await wait_until(
                self._text_worker.run(size, self.embedder.tokenize, inputs, truncate, truncation_direction), deadline
            )
        except TimeoutError:
            raise RequestTimeoutError(f"the {self.what} request timed out while its inputs were tokenized") from None
        finally:
            self._num_tokenizing -= 1
        request = _EncodeRequest(
            num_inputs=len(token_ids),
            normalize=self.embedder.normalize if normalize is None else normalize,
            dimensions=dimensions,
            future=asyncio.get_running_loop().create_future(),
        )
        self._not_started.add(request)
        self._queue.extend(_Item(request, i, ids) for i, ids in enumerate(token_ids))
        assert self._wakeup is not None
        self._wakeup.set()
        try:
            await wait_until(asyncio.shield(request.future), deadline)
        except TimeoutError:
            raise RequestTimeoutError(f"the {self.what} request timed out and was dropped") from None
        finally:
            # Cancelled (client gone), timed out or failed: its queued items are skipped from now on.
            if not request.future.done():
                request.future.cancel()
            self._not_started.discard(request)
        vectors = torch.from_numpy(np.stack(request.rows))  # type: ignore[arg-type]
        return EmbedResult(vectors=vectors, num_prompt_tokens=sum(len(ids) for ids in token_ids))

    # ---------------------------------------------------------------- batching

    def turn_budget(self) -> int:
        """Tokens for the next forward: max_batch_tokens, or while generation runs what fits in one of
        its steps (0 before the first forward was timed: one input goes)."""
        assert self._worker is not None
        step_s = self._worker.recent_turn_seconds(GENERATION_TURN)
        if step_s is None:
            return self.max_batch_tokens
        return min(self._cost.tokens_within(step_s) or 0, self.max_batch_tokens)

    def generation_seconds_owed(self) -> float:
        """Seconds of generation steps still due before the next forward (0 while generation is idle)."""
        assert self._worker is not None
        if self._worker.recent_turn_seconds(GENERATION_TURN) is None:
            return 0.0
        return max(self._generation_owed_until - self._worker.busy_seconds(GENERATION_TURN), 0.0)

    def _note_forward(self, num_tokens: int, seconds: float, shared: bool) -> None:
        """shared: generation was running when the forward's batch was taken (it owes only then)."""
        assert self._worker is not None
        self._cost.note(num_tokens, seconds)
        due = seconds * (1 - self.embedding_share) / self.embedding_share if shared else 0.0
        self._generation_owed_until = self._worker.busy_seconds(GENERATION_TURN) + due

    def _take_batch(self) -> list[_Item]:
        """Queued items in arrival order up to the turn's token budget (at least one), sorted by length."""
        budget = self.turn_budget()
        batch: list[_Item] = []
        num_tokens = 0
        while self._queue:
            item = self._queue[0]
            if item.request.future.done():  # cancelled by its client, timed out or failed: drop
                self._queue.popleft()
                continue
            if batch and num_tokens + len(item.token_ids) > budget:
                break
            batch.append(self._queue.popleft())
            num_tokens += len(item.token_ids)
            self._not_started.discard(item.request)
        batch.sort(key=lambda it: len(it.token_ids))
        return batch

    def _forward(self, batch: list[_Item]) -> tuple[list[np.ndarray], float]:
        """On the torch worker: one forward, then each row truncated and normalised as its request asks.
        Returns the rows and the seconds the forward took."""
        start = time.perf_counter()
        pooled = self.embedder.forward_pooled([it.token_ids for it in batch])  # [B, H]
        rows = []
        for i, item in enumerate(batch):
            row = finalize(pooled[i : i + 1], item.request.normalize, item.request.dimensions)
            rows.append(row[0].numpy())
        return rows, time.perf_counter() - start

    async def _batch_loop(self) -> None:
        assert self._wakeup is not None and self._worker is not None
        while True:
            await self._wakeup.wait()
            while (owed := self.generation_seconds_owed()) > 0:
                await asyncio.sleep(owed)  # generation needs at least this long to run its share
            shared = self._worker.recent_turn_seconds(GENERATION_TURN) is not None
            batch = self._take_batch()
            if not self._queue:
                self._wakeup.clear()
            if not batch:
                continue
            try:
                rows, seconds = await self._worker.run(self._forward, batch, kind=EMBEDDING_TURN)
            except asyncio.CancelledError:
                self._fail_items(batch, EngineDeadError(f"the {self.what} model is shutting down"))
                raise
            except EngineDeadError as exc:
                self._fail_items(batch, exc)
                self._fail_queued(exc)
                return
            except Exception as exc:  # noqa: BLE001 - one failed forward fails its requests, not the server
                logger.exception("%s forward over %d inputs failed", self.what, len(batch))
                self._fail_items(batch, EngineStepError(f"internal error in the {self.what} model: {exc!r}"))
                continue
            self.num_forwards += 1
            self._note_forward(sum(len(item.token_ids) for item in batch), seconds, shared)
            for item, row in zip(batch, rows, strict=True):
                self._deliver(item, row)

    @staticmethod
    def _deliver(item: _Item, row: np.ndarray) -> None:
        request = item.request
        if request.future.done():
            return
        request.rows[item.index] = row
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
