"""ModelPool: the one owner of which catalogue models are loaded.

A request names a model; `acquire` gives its served form, loading it first when it is not loaded (the
request waits; others, and /health, go on). A load runs on a thread of its own that ends with it, off the
event loop and off the torch worker, so the loaded models keep stepping while it reads and converts weights; the
default models load at start on the torch worker itself, as nothing is served yet. Before a load, the
least recently used idle models are unloaded until the new one fits under --max-loaded-models and
--memory-budget; a model with a request inside (leased: server/catalogue/leases.py) is never one of them.
A model idle past its keep-alive is unloaded by the pool's reaper. Each model has its own engine (its own
KV cache, prefix cache and speculative state); a failed load or a dead engine fails its own requests only.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

from engine import AsyncEncoder, AsyncEngine, ModelLoadError, RequestLimits, TextWorker, TorchWorker
from server.catalogue import served as served_model
from server.catalogue.entries import FOREVER, ModelEntry, format_keep_alive
from server.catalogue.leases import hold, note_load_wait
from server.catalogue.served import Served, ServedGeneration
from server.config import ServerConfig
from server.errors import APIError
from server.openai.reasoning import think_tokens
from server.openai.text import RequestText

logger = logging.getLogger(__name__)

Status = Literal["loaded", "loading", "unloading", "unloaded", "failed"]
RETRY_AFTER_S = 5  # what a request that found no room is told to wait
_REAPER_TICK_S = 0.25


@dataclass(frozen=True)
class Factories:
    """How each task's model is made from its config (on a loader thread, or the torch worker at start)."""

    generation: Callable[[Any], Any]
    embedder: Callable[[Any], Any]
    reranker: Callable[[Any], Any]


@dataclass(frozen=True)
class ModelStatus:
    """One catalogue model as /v1/models and /api/ps show it."""

    entry: ModelEntry
    status: Status
    memory_bytes: int  # measured once loaded, estimated before
    loaded_at: float | None  # time.time() of the end of its load
    expires_at: float | None  # time.time() it unloads if still idle; None: in use, or kept forever
    requests_inside: int
    error: str | None  # why its last load failed


class _Slot:
    """One catalogue model's life: the pool alone changes it."""

    def __init__(self, entry: ModelEntry, keep_alive: float) -> None:
        self.entry = entry
        self.served: Served | None = None
        self.loading: asyncio.Task[Served] | None = None
        self.unloading = False  # its engine is stopping and its memory being freed
        self.keep_alive = keep_alive
        self.leases = 0  # requests holding it (their route picked it; their answer has not ended)
        self.last_used = time.monotonic()
        self.loaded_at: float | None = None
        self.memory_bytes = 0  # measured at load
        self.error: str | None = None

    @property
    def is_idle(self) -> bool:
        return self.served is not None and self.leases == 0 and served_model.num_requests_inside(self.served) == 0

    @property
    def status(self) -> Status:
        if self.served is not None:
            return "loaded"
        if self.loading is not None:
            return "loading"
        if self.unloading:
            return "unloading"
        return "failed" if self.error is not None else "unloaded"

    def expires_in(self, now: float) -> float | None:
        """Seconds until the reaper unloads it (None: never, or in use)."""
        if not self.is_idle or self.keep_alive == FOREVER:
            return None
        return self.last_used + self.keep_alive - now


class ModelPool:
    def __init__(self, config: ServerConfig, factories: Factories) -> None:
        self._config = config
        self._factories = factories
        self._slots = [
            _Slot(e, e.keep_alive if e.keep_alive is not None else config.keep_alive) for e in config.catalogue
        ]
        self._by_name: dict[str, _Slot] = {}
        for slot in self._slots:
            for name in (*slot.entry.names, slot.entry.config.model):
                self._by_name.setdefault(name, slot)
        self._room = asyncio.Lock()  # one placement (evictions, then the load's start) at a time
        self._limits = RequestLimits(config.max_queued_requests, config.request_timeout)
        self._worker: TorchWorker | None = None
        self._text_worker: TextWorker | None = None
        self._one_load = asyncio.Lock()  # loads on demand run one at a time (each takes every core it can)
        self._reaper: asyncio.Task[None] | None = None
        self._is_stopped = False

    # ---- what is served ----
    @property
    def entries(self) -> tuple[ModelEntry, ...]:
        return tuple(slot.entry for slot in self._slots)

    def find(self, name: str) -> ModelEntry | None:
        slot = self._by_name.get(name)
        return slot.entry if slot is not None else None

    def default(self, task: str) -> ModelEntry | None:
        return next((slot.entry for slot in self._slots if slot.entry.task == task), None)

    def loaded(self, entry: ModelEntry) -> Served | None:
        """The model's served form if it is loaded now (no load started, no lease taken)."""
        return self._slot(entry).served

    def statuses(self) -> list[ModelStatus]:
        now, wall = time.monotonic(), time.time()
        rows = []
        for slot in self._slots:
            expires_in = slot.expires_in(now)
            inside = served_model.num_requests_inside(slot.served) if slot.served is not None else 0
            rows.append(
                ModelStatus(
                    entry=slot.entry,
                    status=slot.status,
                    memory_bytes=slot.memory_bytes if slot.served else served_model.estimated_bytes(slot.entry),
                    loaded_at=slot.loaded_at if slot.served else None,
                    expires_at=wall + max(expires_in, 0.0) if expires_in is not None else None,
                    requests_inside=max(slot.leases, inside),
                    error=slot.error,
                )
            )
        return rows

    # ---- life cycle ----
    async def start(self, worker: TorchWorker, text_worker: TextWorker) -> None:
        """Load the models that load at start (the defaults first, on the torch worker), then start the reaper.
        Raises what a default model's load raises."""
        self._worker, self._text_worker = worker, text_worker
        for slot in self._slots:
            if slot.entry.preload:
                logger.info("loading %s model %s", _TASK_WORDS[slot.entry.task], slot.entry.config.model)
                slot.served = await self._load(slot.entry, on_worker=True)
                self._note_loaded(slot)
        self._reaper = asyncio.create_task(self._reap(), name="kvserve-model-reaper")

    async def stop(self) -> None:
        """Stop every loaded model: the requests inside fail with EngineDeadError. Idempotent."""
        self._is_stopped = True
        if self._reaper is not None:
            self._reaper.cancel()
            await asyncio.gather(self._reaper, return_exceptions=True)
        for slot in self._slots:
            if slot.served is not None:
                await served_model.stop(slot.served)

    # ---- requests ----
    async def acquire(self, entry: ModelEntry, keep_alive: float | None = None) -> Served:
        """The model loaded and held for the current request (released at its end); loads it first if needed.
        keep_alive: the request's own (seconds, FOREVER), from now on the model's. Raises APIError."""
        slot = self._slot(entry)
        if keep_alive is not None:
            slot.keep_alive = keep_alive
        slot.last_used = time.monotonic()
        served = slot.served
        # A model loaded on demand whose engine died loads again; a default model's death stays visible
        # (/health answers 503, the engine's own errors answer its requests) for the orchestrator to act on.
        if served is not None and not entry.preload and not served_model.is_healthy(served) and slot.leases == 0:
            logger.warning("%s: its engine stopped; loading it again", entry.name)
            await self._unload(slot, "its engine stopped")
            served = None
        if served is None:
            waiting_since = time.monotonic_ns()
            served = await self._ensure_loaded(slot)
            note_load_wait(time.monotonic_ns() - waiting_since)
        slot.leases += 1
        if not hold(lambda: self._release(slot)):
            self._release(slot)  # no request scope (a script, a test harness): nothing to hold it for
        return served

    def _release(self, slot: _Slot) -> None:
        slot.leases -= 1
        slot.last_used = time.monotonic()

    async def load(self, entry: ModelEntry) -> Served:
        """Load it now (the admin's POST /v1/models/{id}/load) and let it expire as if a request had used it."""
        slot = self._slot(entry)
        slot.last_used = time.monotonic()
        return slot.served or await self._ensure_loaded(slot)

    async def unload(self, entry: ModelEntry) -> bool:
        """Unload it now (the admin's unload, or a request's keep_alive 0 without a prompt): the requests
        inside it fail with EngineDeadError. False if it was not loaded."""
        slot = self._slot(entry)
        if slot.loading is not None:
            await asyncio.gather(asyncio.shield(slot.loading), return_exceptions=True)
        if slot.served is None:
            return False
        await self._unload(slot, "asked to")
        return True

    # ---- loading and room ----
    async def _ensure_loaded(self, slot: _Slot) -> Served:
        if self._is_stopped or self._worker is None:
            raise APIError(
                503, "the server is not serving models now", type="service_unavailable", code="model_loading"
            )
        load = slot.loading
        if load is None:
            async with self._room:  # waits while another placement evicts and starts its load
                if slot.served is not None:
                    return slot.served
                load = slot.loading
                if load is None:
                    await self._make_room(slot)
                    load = asyncio.create_task(self._load_into(slot), name=f"kvserve-load-{slot.entry.name}")
                    # Its failure is every waiter's; when all of them left, it is still retrieved here.
                    load.add_done_callback(lambda task: task.cancelled() or task.exception())
                    slot.loading = load
        # Shielded: a client that leaves stops waiting, the load goes on for the next request.
        return await asyncio.shield(load)

    async def _load_into(self, slot: _Slot) -> Served:
        entry = slot.entry
        started = time.monotonic()
        logger.info("loading %s model %s on demand", _TASK_WORDS[entry.task], entry.name)
        try:
            slot.served = await self._load(entry, on_worker=False)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            slot.error = str(exc)
            if isinstance(exc, ModelLoadError):
                logger.error("model %s failed to load: %s", entry.name, exc)
            else:
                logger.exception("model %s failed to load", entry.name)
            raise APIError(500, f"model {entry.name!r} failed to load: {exc}", code="model_load_failed") from exc
        finally:
            slot.loading = None
        self._note_loaded(slot)
        logger.info(
            "loaded %s in %.1f s (%s; keep-alive %s)",
            entry.name,
            time.monotonic() - started,
            _mib(slot.memory_bytes),
            format_keep_alive(slot.keep_alive),
        )
        return slot.served

    def _note_loaded(self, slot: _Slot) -> None:
        assert slot.served is not None
        slot.error = None
        slot.loaded_at = time.time()
        slot.last_used = time.monotonic()
        slot.memory_bytes = served_model.measured_bytes(slot.entry, slot.served)

    async def _make_room(self, slot: _Slot) -> None:
        """Unload LRU idle models until `slot` fits; 400 if it can never fit, 503 if every other model is busy."""
        need = served_model.estimated_bytes(slot.entry)
        budget = self._budget_bytes(slot.entry)
        if budget is not None and need > budget:
            raise APIError(
                400,
                f"model {slot.entry.name!r} needs about {_mib(need)} (weights and KV cache), more than the "
                f"memory budget of {_mib(budget)} (--memory-budget)",
                param="model",
                code="model_too_large",
            )
        while True:
            others = [s for s in self._slots if s is not slot and (s.served is not None or s.loading is not None)]
            used = sum(
                s.memory_bytes if s.served is not None else served_model.estimated_bytes(s.entry) for s in others
            )
            too_many = self._config.max_loaded_models is not None and len(others) + 1 > self._config.max_loaded_models
            too_big = budget is not None and used + need > budget
            if not (too_many or too_big):
                return
            idle = sorted((s for s in others if s.is_idle), key=lambda s: s.last_used)
            if not idle:
                limit = "--max-loaded-models" if too_many else "--memory-budget"
                raise APIError(
                    503,
                    f"model {slot.entry.name!r} cannot be loaded now: every loaded model has requests in it and "
                    f"there is no room for another ({limit}); retry later",
                    type="service_unavailable",
                    code="models_busy",
                    headers={"Retry-After": str(RETRY_AFTER_S)},
                )
            await self._unload(idle[0], f"to make room for {slot.entry.name}")

    def _budget_bytes(self, entry: ModelEntry) -> int | None:
        budget = self._config.memory_budget
        if budget is None or isinstance(budget, int):
            return budget
        return int(budget * _memory_of(entry.config.device))

    async def _unload(self, slot: _Slot, why: str) -> None:
        served, slot.served = slot.served, None
        if served is None:
            return
        logger.info("unloading %s (%s; it held %s)", slot.entry.name, why, _mib(slot.memory_bytes))
        slot.loaded_at = None
        slot.unloading = True  # "unloaded" only once nothing here holds its weights
        try:
            await served_model.stop(served)
            del served
            # Off the loop: the collection frees the weights and the KV pool, the trim gives the pages back.
            await asyncio.get_running_loop().run_in_executor(None, _free_memory)
        finally:
            slot.unloading = False

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(_REAPER_TICK_S)
            now = time.monotonic()
            for slot in self._slots:
                expires_in = slot.expires_in(now)
                if expires_in is not None and expires_in <= 0:
                    with contextlib.suppress(Exception):
                        await self._unload(slot, f"idle for {format_keep_alive(slot.keep_alive)}")

    async def _load(self, entry: ModelEntry, *, on_worker: bool) -> Served:
        assert self._worker is not None and self._text_worker is not None
        loop = asyncio.get_running_loop()

        async def run(fn: Callable[..., Any], *args: Any) -> Any:
            if on_worker:
                return await self._worker.run(fn, *args)
            async with self._one_load:
                return await _on_a_thread_of_its_own(loop, fn, *args)

        if entry.task == "generate":
            generation = await run(self._factories.generation, entry.config)
            # A load's transient buffers (file blocks before interleaving, converted tensors) are freed but kept
            # by the C heap: given back here, a 0.75B Q8_0 model holds 260 MB less from its first request on.
            await run(_trim_heap)
            # The loop detokenizes with the engine's tokenizer; the text worker encodes with its own copy.
            text_tokenizer = await self._text_worker.run(0, generation.tokenizer.copy)
            reasoning = think_tokens(self._config.reasoning_parser, generation.tokenizer.vocabulary())
            engine = AsyncEngine(generation.engine, generation.tokenizer, limits=self._limits)
            await engine.start(self._worker)
            return ServedGeneration(entry.name, engine, RequestText(self._text_worker, text_tokenizer), reasoning)
        factory = self._factories.embedder if entry.task == "embed" else self._factories.reranker
        what = "embedding" if entry.task == "embed" else "rerank"
        encoder = AsyncEncoder(await run(factory, entry.config), limits=self._limits, what=what)
        await run(_trim_heap)
        await encoder.start(self._worker, self._text_worker)
        return encoder

    def install(self, entry: ModelEntry, served: Served) -> None:
        """Put an already loaded model in its slot (apps assembled by hand, without the lifespan)."""
        slot = self._slot(entry)
        slot.served = served
        slot.loaded_at = time.time()

    def _slot(self, entry: ModelEntry) -> _Slot:
        return next(slot for slot in self._slots if slot.entry is entry)


_TASK_WORDS = {"generate": "generation", "embed": "embedding", "rerank": "rerank"}


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:.0f} MiB"


def _memory_of(device: str) -> int:
    """Total bytes of the memory a model on `device` lives in: the GPU's, or the machine's RAM."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_properties(torch.device(device)).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


async def _on_a_thread_of_its_own(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) on a new thread that ends with it. A thread that runs torch ops gets an OpenMP team of its
    own; while that thread lives, the runtime counts more threads than cores and makes every parallel
    region of the stepping models wait to be woken (measured: decode at half speed for as long as a
    long-lived loader thread stayed). A loader that exits takes its team with it."""
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-load")
    try:
        return await loop.run_in_executor(executor, fn, *args)
    finally:
        executor.shutdown(wait=False)


def _free_memory() -> None:
    """After an unload: the model's reference cycles collected, then the heap given back."""
    gc.collect()
    _trim_heap()


def _trim_heap() -> None:
    """Freed C heap given back to the system. No gc.collect here: a full collection holds the GIL for as long
    as the process has objects to walk, and the models streaming beside a load would stall that long; ctypes
    releases the GIL for the trim itself."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
