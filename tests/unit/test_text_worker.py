"""TextWorker: one thread, smaller jobs first, errors to their caller, cancelled jobs skipped."""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine.errors import EngineDeadError
from engine.serving.text_worker import TextWorker


def test_jobs_run_on_one_thread_that_is_not_the_loop():
    async def main() -> set[int]:
        worker = TextWorker()
        threads = set(await asyncio.gather(*(worker.run(i, threading.get_ident) for i in range(20))))
        await worker.stop()
        return threads

    threads = asyncio.run(main())
    assert len(threads) == 1 and threading.get_ident() not in threads


def test_a_small_job_waits_only_for_the_job_running_not_for_bigger_ones_queued():
    gate = threading.Event()
    order: list[str] = []

    def job(name: str) -> str:
        if name == "running":
            gate.wait(10)
        order.append(name)
        return name

    async def main() -> None:
        worker = TextWorker()
        running = asyncio.ensure_future(worker.run(2_000_000, job, "running"))
        await asyncio.sleep(0.05)  # the worker has taken it
        big = [asyncio.ensure_future(worker.run(2_000_000, job, f"big-{i}")) for i in range(3)]
        small = asyncio.ensure_future(worker.run(40, job, "small"))
        await asyncio.sleep(0.05)
        gate.set()
        assert await small == "small"
        await asyncio.gather(running, *big)
        await worker.stop()

    asyncio.run(main())
    assert order == ["running", "small", "big-0", "big-1", "big-2"]  # equal sizes keep their arrival order


def test_errors_reach_their_caller_and_the_worker_goes_on():
    def fail() -> None:
        raise ValueError("bad text")

    async def main() -> None:
        worker = TextWorker()
        with pytest.raises(ValueError, match="bad text"):
            await worker.run(1, fail)
        assert await worker.run(1, lambda: 7) == 7
        await worker.stop()
        assert not worker.is_alive
        with pytest.raises(EngineDeadError):
            await worker.run(1, lambda: 7)

    asyncio.run(main())


def test_a_job_whose_caller_left_before_it_started_is_skipped():
    gate = threading.Event()
    ran: list[str] = []

    async def main() -> None:
        worker = TextWorker()
        blocker = asyncio.ensure_future(worker.run(1, gate.wait, 10))
        await asyncio.sleep(0.05)
        left = asyncio.ensure_future(worker.run(1, ran.append, "left"))
        await asyncio.sleep(0.01)
        left.cancel()
        await asyncio.sleep(0.01)
        gate.set()
        await blocker
        await worker.run(1, ran.append, "stayed")
        await worker.stop()

    asyncio.run(main())
    assert ran == ["stayed"]
