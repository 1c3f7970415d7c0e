"""The one thread that runs a process's torch work.

torch's CPU ops run on OpenMP, and libgomp keeps a separate team of worker
threads for every thread that enters a parallel region. Once two threads have
done torch work, the two teams fight for the cores. Measured on the 2-core
development machine, a SmolLM2 int8 decode step takes 22 ms when the model is
loaded and stepped on one thread. It takes 50-57 ms on either thread once a
second thread has run torch ops, even with that thread idle.

So the server loads both models, runs generation steps and runs embedding
forwards on one single-thread executor, one job at a time in FIFO order (a
generation step and an embedding batch take turns).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor


def single_torch_thread(name: str = "kvserve-torch") -> ThreadPoolExecutor:
    """A one-thread executor for torch work; pass it to every component that runs torch."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
